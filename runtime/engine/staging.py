"""The device side of a fetch on CUDA: a fixed ring of pinned host staging slots, and the copy
stream that moves them to the device.

One :class:`StagingRing` per runtime: ``window`` slots (one per expert in flight), each large
enough for the largest expert's staged bytes (its E and SM bytes for the device merge, or its
bf16 bytes when the host merges), in one page-aligned host allocation registered with CUDA
(``cudaHostRegister``: page-locked, so the copies are truly asynchronous, and rounded to a page
only; torch's pinned allocator rounds every block up to a power of two, which for a 17 MB
expert is 32 MB). A group (one expert's fetches) takes a slot when it is issued; the decode
workers write into it; once every fetch of the group has finished, the thread that finished
the last one (a reader or decode thread) hands the group to the one stager thread (not the
serving thread), which calls
:meth:`CopyStream.stage_new`, which queues, on the copy stream and under the stream's lock, one
host-to-device copy of the slot and (device merge) one Triton merge launch over the whole
expert, into one device buffer the expert's tensors are views of, and records an event. The slot goes back to the ring with that event: the host waits on it only
when the ring comes round to that slot before the copy ran (counted: ``staging_waits``); the
stager forgets the events of copies that have run (:meth:`StagingRing.reap`), so that taking a
slot seldom asks the device anything. The
serving thread's compute stream waits on the group's event (a device-side wait, no host sync)
before the expert computes. Nothing syncs per tensor.

Where the device is not CUDA (a test forcing these paths on the CPU) the same code runs with
plain host memory and synchronous copies.
"""

from __future__ import annotations

import mmap
import threading
from collections import deque

import numpy as np
import torch

__all__ = ["StagingRing", "CopyStream", "cuda_block_bytes", "own_device", "PAGE"]

PAGE = mmap.PAGESIZE


def cuda_block_bytes(nbytes: int) -> int:
    """What torch's CUDA caching allocator really takes for one allocation of ``nbytes``: rounded
    up to 512 bytes, and above 10 MiB (a block of its own, not split from a shared segment)
    to 2 MiB."""
    n = max(512, -(-int(nbytes) // 512) * 512)
    if n > 10 << 20:
        n = -(-n // (2 << 20)) * (2 << 20)
    return n


def own_device(w):
    """``w`` itself, or a copy when it is a view into a larger buffer (a fetch group's device
    buffer): what a pool keeps must not hold the rest of that buffer alive."""
    if w.untyped_storage().nbytes() > w.numel() * w.element_size():
        return w.clone()
    return w


class StagingRing:
    """``slots`` host staging slots of ``slot_bytes`` each, page-locked where ``pin``."""

    def __init__(self, slots: int, slot_bytes: int, pin: bool) -> None:
        self.slot_bytes = -(-max(1, int(slot_bytes)) // 64) * 64
        n = max(1, int(slots))
        self.nbytes = -(-(n * self.slot_bytes) // PAGE) * PAGE
        self._mm = mmap.mmap(-1, self.nbytes)
        self.host_np = np.frombuffer(self._mm, dtype=np.uint8)  # the same bytes as numpy (cheap views)
        self.host = torch.from_numpy(self.host_np)
        self.pinned = False
        self.pin_error = None
        if pin:
            try:
                rc = int(torch.cuda.cudart().cudaHostRegister(self.host.data_ptr(), self.nbytes, 0))
                self.pinned = rc == 0
                if rc:
                    self.pin_error = f"cudaHostRegister returned {rc}"
            except Exception as exc:  # pragma: no cover - depends on the driver
                self.pin_error = str(exc)
        self.free: deque = deque(range(n))
        self.events: list = [None] * n
        self.waits = 0
        self._unreaped: deque = deque()  # slots released with a copy's event, oldest first (reap)
        self._lock = threading.Lock()  # events[i] and _unreaped, between release / reap

    @property
    def slots(self) -> int:
        return len(self.events)

    def acquire(self) -> int:
        """A free slot; waits for the copy that last read it if that has not run yet (a slot
        :meth:`reap` found copied costs no CUDA call here)."""
        i = self.free.popleft()
        ev = self.events[i]
        if ev is not None:
            if not ev.query():
                self.waits += 1
                ev.synchronize()
            self.events[i] = None
        return i

    def view(self, i: int, nbytes: int) -> torch.Tensor:
        lo = i * self.slot_bytes
        return self.host[lo : lo + nbytes]

    def view_np(self, i: int, nbytes: int) -> np.ndarray:
        """:meth:`view` as a numpy array (what the decode workers write: slicing it costs no torch call)."""
        lo = i * self.slot_bytes
        return self.host_np[lo : lo + nbytes]

    def release(self, i: int, event=None) -> None:
        """Give slot ``i`` back; ``event``: the copy that reads it (None: nothing reads it). Called
        by the thread that stages (the stager thread) while the serving thread acquires:
        the event is in place before the slot is free."""
        with self._lock:
            self.events[i] = event
            if event is not None:
                self._unreaped.append(i)
        self.free.append(i)

    def reap(self) -> None:
        """Forget the events of released slots whose copies have run, oldest first, stopping at
        the first still running (the copies run in order on one stream): called by the stager
        after it releases a slot, so that :meth:`acquire` on the serving thread seldom asks the
        device anything."""
        while True:
            with self._lock:
                if not self._unreaped:
                    return
                i = self._unreaped[0]
                ev = self.events[i]
            if ev is not None and not ev.query():
                return
            with self._lock:
                if self._unreaped and self._unreaped[0] == i:
                    self._unreaped.popleft()
                if self.events[i] is ev:  # (not a later copy's, released meanwhile)
                    self.events[i] = None

    def close(self) -> None:
        if self.pinned:
            try:
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaHostUnregister(self.host.data_ptr())
            except Exception:  # pragma: no cover
                pass
            self.pinned = False


class CopyStream:
    """Stages finished groups to the device on a side stream (CUDA) or synchronously (CPU)."""

    def __init__(self, device, ring: StagingRing, device_merge: bool) -> None:
        self.device = torch.device(device)
        self.ring = ring
        self.device_merge = device_merge
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=self.device, priority=-1) if self.cuda else None
        # one device buffer the E and SM bytes land in before the merge: reused by every group,
        # safe because every use is on the copy stream, in order; the threads that stage (the
        # reader and decode threads that finish a group) queue each copy and its merge under one
        # lock, so that no other group's copy lands in it between the two
        self._dev_in = None
        self._lock = threading.Lock()

    @property
    def dev_in_bytes(self) -> int:
        return 0 if self._dev_in is None else cuda_block_bytes(self._dev_in.numel()) if self.cuda else self._dev_in.numel()

    @staticmethod
    def layout(tensors: list) -> tuple[list, int]:
        """Each tensor's element offset in the group's buffers, and their total elements."""
        offs, n = [], 0
        for t in tensors:
            offs.append(n)
            n += -(-t.numel // 64) * 64  # keep every part 128-byte aligned (bf16) / 64 (uint8)
        return offs, n

    def alloc_out(self, n: int) -> torch.Tensor:
        """The group's device output (bf16, ``n`` elements), owned by the copy stream."""
        if self.stream is None:
            return torch.empty(n, dtype=torch.bfloat16, device=self.device)
        with torch.cuda.stream(self.stream):
            return torch.empty(n, dtype=torch.bfloat16, device=self.device)

    def stage_new(self, slot: int, n: int):
        """:meth:`alloc_out` and :meth:`stage` under one switch to the copy stream (a stream
        switch costs the serving thread more than the copy's launch): returns ``(out, event)``."""
        if self.stream is None:
            out = self.alloc_out(n)
            return out, self.stage(slot, n, out)
        host = self.ring.view(slot, 2 * n)
        with self._lock, torch.cuda.stream(self.stream):  # (the stream's device becomes the current one)
            out = torch.empty(n, dtype=torch.bfloat16, device=self.device)
            if self.device_merge:
                if self._dev_in is None or self._dev_in.numel() < 2 * n:
                    self._dev_in = torch.empty(self.ring.slot_bytes, dtype=torch.uint8, device=self.device)
                d = self._dev_in[: 2 * n]
                d.copy_(host, non_blocking=True)
                _merge_on_current_device()(d[:n], d[n:], out)
            else:
                out.copy_(host.view(torch.bfloat16), non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        return out, ev

    def stage(self, slot: int, n: int, out: torch.Tensor):
        """Queue the copy of slot ``slot`` (its first ``2n`` bytes) and, with the device merge,
        the merge into ``out``; returns the event the compute stream waits on (None on the CPU)."""
        from zipmoe import kernels

        host = self.ring.view(slot, 2 * n)
        if self.stream is None:
            if self.device_merge:
                kernels.merge(host[:n], host[n:], out)
            else:
                out.copy_(host.view(torch.bfloat16))
            return None
        with self._lock, torch.cuda.stream(self.stream):
            if self.device_merge:
                if self._dev_in is None or self._dev_in.numel() < 2 * n:
                    self._dev_in = torch.empty(self.ring.slot_bytes, dtype=torch.uint8, device=self.device)
                d = self._dev_in[: 2 * n]
                d.copy_(host, non_blocking=True)
                kernels.merge(d[:n], d[n:], out)
            else:
                out.copy_(host.view(torch.bfloat16), non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        return ev


_MERGE = None


def _merge_on_current_device():
    """The merge for CUDA tensors on the current device: Triton's kernel launched directly
    (``kernels.merge`` checks the devices and switches to theirs first, which the copy stream's
    context has done already: same kernel, same bits), or ``kernels.merge`` without Triton."""
    global _MERGE
    if _MERGE is None:
        from zipmoe import kernels

        if kernels.triton_available():
            from zipmoe.kernels.triton_merge import merge_triton

            _MERGE = merge_triton
        else:  # pragma: no cover - CUDA without Triton
            _MERGE = kernels.merge
    return _MERGE
