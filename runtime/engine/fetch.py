"""The records of a layer's fetches: one expert tensor being made whole (:class:`_Fetch`), one
expert's fetches (:class:`_Group`), the latch of a split job, and which tensors need work in
which order (:func:`expert_type`, :func:`issue_order`). Used by :mod:`.fetcher` and the stages
it owns (:mod:`.reader`, :mod:`.decoder`, :mod:`.device_side`)."""

from __future__ import annotations

import threading

from zipmoe.runtime.engine.order import priority
from zipmoe.runtime.engine.tensors import ExpertTensor

__all__ = ["issue_order", "expert_type", "PREFETCH_RANK", "report_failure", "fan_out"]


def _reads_of(state) -> tuple[bool, bool]:
    """(read E?, read SM?) for a tensor fetched from this cache state."""
    return state in (None, "none", "sm_only"), state in (None, "none", "e_only")


def expert_type(states: list) -> str:
    """``full`` when every tensor is whole, ``I`` when one must read its SM chunk, else ``II``."""
    if all(s == "full" for s in states):
        return "full"
    if any(_reads_of(s)[1] for s in states):
        return "I"
    return "II"


def issue_order(experts: list, states: dict, tensors: dict) -> tuple[list, dict]:
    """Experts that need work, in the order they enter the window, and each tensor's rank.

    Ranks come from :func:`schedule_model.order` over the layer's tensor tasks; an expert's
    place is its best-ranked tensor's. Returns ``(experts, {uid: rank})``.
    """
    # the keys :func:`schedule_model.order` sorts :class:`Task` records by, from the tensors' sizes
    # (a Task per tensor per layer call was the largest piece of the serving thread's issue)
    keys = []
    best = {}  # expert -> its best-ranked tensor's key
    for e in experts:
        b = None
        for t, st in zip(tensors[e], states[e]):
            k = (*priority(st or "none", t.full_bytes, t.e_bytes, t.sm_bytes), len(keys), t.uid)
            keys.append(k)
            if b is None or k < b:
                b = k
        if expert_type(states[e]) != "full":
            best[e] = b
    keys.sort()
    rank = {k[3]: r for r, k in enumerate(keys)}
    need = sorted(best, key=best.__getitem__)
    return need, rank


class _Fetch:
    """One expert tensor being made whole."""

    __slots__ = ("tensor", "state", "out", "e_parts", "sm_parts", "host", "exp_host", "sm_host", "w", "bufs",
                 "ranges", "done", "reported", "_lock", "plog", "group", "cancelled")

    def __init__(self, tensor: ExpertTensor, state):
        self.tensor = tensor
        self.state = state
        self.done = None  # done(f, exc): tells the layer this fetch finished (set when submitted)
        self.reported = False
        self._lock = threading.Lock()
        self.plog = None  # (range index, bytes, seconds, direct?) of each piece read
        self.group = None  # the _Group (one expert's fetches) it belongs to
        self.cancelled = False  # a dropped prefetch: jobs not started yet skip their work
        self.out = None
        self.e_parts = None
        self.sm_parts = None
        self.host = None  # CUDA: the bf16 staging (host merge) or E / SM halves (device merge), views
        self.exp_host = None  # of the group's staging ring slot (engine/staging.py)
        self.sm_host = None
        self.w = None  # the tensor the expert computes with (out, or out converted to the compute dtype)
        self.ranges: list = []  # the file ranges it reads (coalesced), one buffer each
        self.bufs: list = []  # the aligned read buffers (store.buffers) behind e_parts / sm_parts


    def report(self, exc) -> None:
        """Tell the layer once that this fetch finished (``exc``: its error or None); a second
        report (a job that failed after its fetch was reported) is ignored."""
        with self._lock:
            if self.reported:
                return
            self.reported = True
        self.done(self, exc)


def report_failure(fn, args, exc) -> None:
    """A queued job raised outside its own error handling (the ``on_error`` of the reader and
    decode threads): report it to the fetch it was for, so that its layer learns it at once."""
    f = args[0] if args and isinstance(args[0], _Fetch) else None
    if f is None or f.done is None:
        raise exc
    f.report(exc)


class _Cancelled(Exception):
    """A dropped prefetch's job that had not started yet (not an error)."""


class _Group:
    """The fetches of one expert: one window slot, its working bytes, done when all report."""

    __slots__ = ("layer", "expert", "prefetch", "fetches", "states", "remaining", "reserved", "errors",
                 "dropped", "released", "slot", "n", "dev", "event", "offs", "latch", "used_by")

    def __init__(self, layer, expert, prefetch: bool) -> None:
        self.layer = layer
        self.expert = expert
        self.prefetch = prefetch  # issued on a prediction and not (yet) needed
        self.fetches: list = []  # per tensor: a _Fetch, or None when whole in the cache
        self.states: list = []
        self.remaining = 0  # fetches submitted and not yet reported
        self.reserved = 0
        self.errors: list = []
        self.dropped = False
        self.released = False
        # the device side (engine/staging.py): its staging ring slot until staged, the elements of
        # its buffers, its device buffer (taken when staged; the tensors' ``out`` are views of
        # it), the copy's event
        self.slot = None
        self.n = 0
        self.dev = None
        self.event = None
        self.used_by = None  # the compute stream its buffer was marked as used by when staged
        self.offs = ()  # each fetch's element offset in the buffers (device_side.place)
        # staged: counts the group's fetches down on the threads that finish them (one more for
        # the issue itself), so that whichever finishes last hands the group to the stager (or, the
        # issue, stages it there)
        self.latch = None


PREFETCH_RANK = 1 << 40  # added to a prefetch's ranks: after every demand job in the queues


def fan_out(workers, rank, job, f, items: list, *extra) -> None:
    """Run ``job(f, *item, latch, *extra)`` for every item of one fetch: every item but the first
    queued on ``workers`` at ``rank``, the first run here; ``latch`` counts them down (the last
    job learns the first error). An item that could not be queued counts as failed. One queued
    job fans out so that a Ctrl-C (it lands only in the serving thread) cannot leave a fetch half
    queued, and the thread that queued the fan-out goes back to its own work after one queue
    operation."""
    latch = _Latch(len(items))
    queued = 1
    try:
        for item in items[1:]:
            workers.submit(rank, job, f, *item, latch, *extra)
            queued += 1
    except BaseException as exc:  # noqa: BLE001
        for _ in range(len(items) - queued):
            latch.count_down(exc)  # never the last: the first job below is still to run
    job(f, *items[0], latch, *extra)


class _Latch:
    """Counts down the jobs of one split tensor; the last one learns the first error."""

    __slots__ = ("n", "exc", "lock")

    def __init__(self, n: int) -> None:
        self.n = n
        self.exc = None
        self.lock = threading.Lock()

    def count_down(self, exc) -> tuple[bool, BaseException | None]:
        with self.lock:
            if exc is not None and self.exc is None:
                self.exc = exc
            self.n -= 1
            return self.n == 0, self.exc

