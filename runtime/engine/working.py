"""What the experts in flight hold: :class:`WorkingSet`, the window's share of the budget.

The runtime reserves ``window`` experts' worth of working bytes (``expert_working`` each: the
bf16 merge buffers and aligned read buffers of one expert, see :func:`working_bytes_of`). A
fetch group takes its bytes with :meth:`WorkingSet.hold` when it is issued and gives them back
with :meth:`release`; a finished fetch's read buffers come back with :meth:`recycle` and stay
idle for reuse in what the window reserves and the experts in flight do not use (the idle ones
beyond that are dropped). ``on_change`` is called after every change, so that the owner can
note its peak of held bytes.
"""

from __future__ import annotations

import threading

__all__ = ["WorkingSet", "working_bytes_of"]


def working_bytes_of(t) -> int:
    """Working bytes of one expert tensor in flight: its bf16 merge buffer, its read buffers and,
    when the model computes in another dtype (float32), the converted tensor."""
    extra = t.compute_bytes if t.compute_itemsize != 2 else 0
    return t.full_bytes + t.staging_bytes() + extra


class WorkingSet:
    """``window`` experts in flight, ``expert_working`` bytes each at most.

    ``buffers``: the store's :class:`~zipmoe.runtime.engine.reads.ReadBuffers` (idle read
    buffers live in the window's room). ``staged``: the device side stages through a ring (on
    CUDA: a group's bf16 buffers are one device buffer the fetcher counts per group, and the
    window's ring slots are held whole by the ring, so neither is room for idle buffers).
    ``ring_bytes``: the ring's slots that the window's share includes.
    """

    def __init__(self, buffers, *, window: int, expert_working: int, staged: bool = False, ring_bytes: int = 0,
                 on_change=None) -> None:
        self.buffers = buffers
        self.window = int(window)
        self.expert_working = int(expert_working)
        self.staged = bool(staged)
        self.ring_bytes = int(ring_bytes)
        self.inflight = 0
        self._lock = threading.Lock()
        self._on_change = on_change
        self._bytes: dict = {}  # uid -> (tensor, bytes_of): the same on every fetch of a tensor

    def bytes_of(self, t, bufs=None) -> int:
        """A fetch's own working bytes (staged: its expert's device buffer and staging slot are
        counted once per expert, by the group and by the ring). ``bufs``: the read buffers the
        fetch took (``Reader.prepare``), counted as they are instead of a miss's (the tensor's
        staging bytes, the most a fetch of it may take): a fetch that reads half a tensor, or
        nothing (a compressed hit), leaves the rest of the window's room to idle buffers."""
        memo = self._bytes.get(t.uid)
        if memo is None or memo[0] is not t:
            memo = self._bytes[t.uid] = (t, working_bytes_of(t) - (t.full_bytes if self.staged else 0), t.staging_bytes())
        if bufs is None:
            return memo[1]
        return memo[1] - memo[2] + sum(len(b) for b in bufs)

    def _idle_room(self) -> int:
        return self.window * self.expert_working - self.ring_bytes - self.inflight

    def hold(self, n: int) -> None:
        with self._lock:
            self.inflight += n
            self.buffers.trim(self._idle_room())
        self._changed()

    def release(self, n: int) -> None:
        with self._lock:
            self.inflight -= n
        self._changed()

    def recycle(self, bufs: list) -> None:
        """Take back a finished fetch's read buffers (after :meth:`release` of its bytes)."""
        if bufs:
            with self._lock:
                self.buffers.put(bufs, self._idle_room())

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change()
