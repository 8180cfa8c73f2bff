"""The compressed pool keeps a fetch's read buffers instead of a copy of them: :class:`Adopter`.

A tensor read from the disk (a miss, or the half an SM-only or E-only hit reads) lies in
page-aligned read buffers (engine/reads.py) as its stored E chunks and SM bytes, the very form
the compressed pool keeps. Copying them into exact-size arrays on admission cost the serving
thread 138 µs per fetched tensor on the H200 (docs/benchmarks.md §22p), on the path between a
layer's last read and the next layer's first. The pool takes the buffers themselves instead:

* **Counted as they are.** An adopted entry's bytes are the aligned ranges it read (what the
  read touched: up to a page more at each end of a range, and the small gaps a coalesced read
  crosses), plus any half it already held as its own arrays (an SM-only or E-only hit's):
  ``ExpertTensor.kept_bytes``, which the planner's replay counts too. The
  pages of a reused buffer beyond that are given back to the kernel (``MADV_DONTNEED``), so the
  resident memory is what the budget counts.
* **Given back for reuse.** When the pool lets an adopted tensor go, its buffers return to the
  idle read buffers (:meth:`WorkingSet.recycle`, within the room the window leaves them), so a
  run at capacity maps no fresh buffers (a page fault per 4 KiB on a reader) for its reads.
  Not while a fetch still decodes from it (a compressed hit, prefetched or dropped, borrows the
  entry's parts until its group is released): such buffers wait for the last borrower's
  release (a compressed hit promoted to the full pool leaves its entry so). Evictions inside an admission are given back after the admission (the cascade copies
  what an SM-only or E-only pool keeps from the evicted views first).
* **What a lower pool keeps is copied.** An evicted compressed tensor demoted to the SM-only or
  E-only pool keeps its half as exact-size arrays (``device_side.demote``), so that half of a
  buffer never pins the whole.

``enabled`` off makes the compressed pool copy as before (the profile's β pass, whose pool holds
every expert and never evicts: adopted buffers would not come back, and its misses would read into
fresh mappings that serving at capacity does not make).

The bits are the same: the pool keeps the bytes the disk gave, in the buffers they were read
into, and nothing writes into an adopted buffer until the pool has let it go and no fetch
reads it.
"""

from __future__ import annotations

import mmap

__all__ = ["Adopter", "COPYING_POOLS"]

#: the host pools that copy what they take (fetched or demoted halves, on the serving thread):
#: the compressed pool adopts the read buffers instead. The planner charges these copies
#: (runtime/plan/replay.py) and holds plans with such pools to its larger margin (planner.py)
COPYING_POOLS = ("sm_only", "e_only")


def _trim_tail(buf, used: int) -> None:
    """Give the pages of ``buf`` beyond ``used`` bytes back to the kernel (a reused buffer may be
    larger than this read)."""
    page = mmap.PAGESIZE
    start = -(-used // page) * page
    if len(buf) - start >= page and hasattr(buf, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
        try:
            buf.madvise(mmap.MADV_DONTNEED, start, len(buf) - start)
        except (OSError, ValueError):  # pragma: no cover - a kernel that refuses: the pages stay
            pass


class Adopter:
    """The compressed pool's adopted read buffers (see the module doc).

    ``store``: the :class:`~zipmoe.runtime.engine.reads.ExpertStore` (its ``buffer_size``);
    ``working``: the :class:`~zipmoe.runtime.engine.working.WorkingSet` whose idle buffers take
    them back. Used from the serving thread only."""

    def __init__(self, store, working) -> None:
        self.store = store
        self.working = working
        self._bufs: dict = {}  # uid -> the read buffers its compressed entry keeps
        self._borrowed: dict = {}  # uid -> fetches in flight that decode from its entry's parts
        self._orphans: dict = {}  # uid -> buffers let go while borrowed: given back with the last borrower
        self._later: list | None = None  # inside an admission: buffers to give back after it
        # False: the compressed pool copies as the lower pools do (the profile's β pass, whose pool
        # holds every expert and never evicts, would otherwise map a fresh buffer for many misses)
        self.enabled = True
        self.adopted = 0  # tensors whose buffers a pool took
        self.returned = 0  # buffers given back for reuse
        self.waited = 0  # buffers let go while a fetch still read them (given back after it)

    def attach(self, cache) -> None:
        """Become the compressed pool's release hook of ``cache``."""
        cache.pools["compressed"].release = self.released

    def form(self, f) -> tuple[int, object]:
        """The compressed pool's form of fetch ``f`` (which read some of its tensor): its bytes
        and a callable that takes the buffers when the pool takes the tensor."""
        return f.tensor.kept_bytes(f.state), lambda: self._take(f)

    def _take(self, f):
        bufs = f.bufs
        f.bufs = []  # the fetch's release no longer hands them back: the pool has them
        for (off, ln), buf in zip(f.ranges, bufs):
            _trim_tail(buf, self.store.buffer_size(off, ln))
        self._bufs[f.tensor.uid] = bufs
        self.adopted += 1
        return f.e_parts, f.sm_parts

    # --- fetches that read an entry's parts
    def borrow(self, uid: int) -> None:
        self._borrowed[uid] = self._borrowed.get(uid, 0) + 1

    def give_back(self, uid: int) -> None:
        """A fetch that borrowed ``uid``'s parts is released (every job of its group finished)."""
        n = self._borrowed.get(uid, 0) - 1
        if n > 0:
            self._borrowed[uid] = n
            return
        self._borrowed.pop(uid, None)
        bufs = self._orphans.pop(uid, None)
        if bufs:
            self._give(bufs)

    # --- the pool lets a tensor go
    def released(self, uid: int, data) -> None:
        bufs = self._bufs.pop(uid, None)
        if not bufs:
            return
        if uid in self._borrowed:
            self.waited += len(bufs)
            self._orphans.setdefault(uid, []).extend(bufs)
            return
        self._give(bufs)

    def _give(self, bufs: list) -> None:
        if self._later is not None:
            self._later.extend(bufs)
        else:
            self._return(bufs)

    def _return(self, bufs: list) -> None:
        self.returned += len(bufs)
        self.working.recycle(bufs)

    def __enter__(self):
        self._later = []
        return self

    def __exit__(self, *exc) -> None:
        later, self._later = self._later, None
        if later:
            self._return(later)
