"""The expert cache: four pools sharing the budget, one state per expert tensor.

Pools (DESIGN.md, "The runtime"):

========== ======================================== ======================================
pool       holds                                    bytes per expert tensor
========== ======================================== ======================================
full       the bf16 compute tensor, on the device   ``2 * numel``
compressed its E chunks and SM chunk as stored      ``e_bytes + sm_bytes`` (about 66%)
sm_only    its SM chunk                             ``sm_bytes`` (50%)
e_only     its E chunks                             ``e_bytes`` (about 16%)
========== ======================================== ======================================

Every expert tensor is in at most one pool (its *state*; none = a miss). Each pool has a byte
capacity; the sum of the capacities is what the budget leaves after the dense weights and the
working set (see :mod:`zipmoe.runtime.serve.core`).

Policy. Each tensor has an activation count (incremented once per layer call that uses it)
and a last-use clock. After a tensor has been used, it is *offered* to the pools above its
current state, best first (full, compressed, sm_only, e_only); a pool takes it when it has
room, or can make room by evicting tensors used *strictly less often* (victims in order of
count, then least recent use first) that are not pinned by the layer being computed. At equal
counts the tensor already cached stays: admitting on ties would turn the policy into LRU,
which thrashes when a forward step touches more tensors than a pool holds (every step evicts
what the next step needs).

Evicted tensors go down where they can (the *cascade*): a tensor evicted from the compressed
pool still holds its SM and E bytes, so it is offered, on the same terms as any offer, to the
SM-only and E-only pools with the part each keeps (``demote``, given by the runtime, which
knows what a pool's data is). Other evicted tensors are dropped (their state becomes none):
the full pool's bf16 tensor is not the stored bytes. Without the cascade, the lower pools fill
with whatever first found room there, and a tensor pushed out of the compressed pool by a
hotter one became a miss although the E-only pool below had room for its E bytes; with it, the
pools follow the planner's assignment rule (hottest tensors in the first pool, the next ones in
the next). Measured (docs/benchmarks.md section 7): on the CPU models tried, the pools had
converged without it (hits moved by at most 0.03 per layer). So each pool converges to the
most frequently used tensors it can hold.
"""

from __future__ import annotations

import heapq
import itertools

__all__ = ["Pool", "ExpertCache", "POOLS"]

POOLS = ("full", "compressed", "sm_only", "e_only")


class Pool:
    def __init__(self, name: str, capacity: int) -> None:
        self.name = name
        self.capacity = int(max(0, capacity))
        self.used = 0
        self.items: dict[int, tuple[int, object]] = {}  # uid -> (nbytes, data)
        self._heap: list = []  # (count, last, uid) lazily invalidated
        # optional hooks (the full pool's device slots, serve/slots.py): adopt(uid, data) -> the
        # data to keep; release(uid, data) when a tensor leaves the pool
        self.adopt = None
        self.release = None

    def __len__(self) -> int:
        return len(self.items)


class ExpertCache:
    def __init__(self, capacities: dict, demote=None) -> None:
        """``demote(pool_name, data)``: the forms ``{lower_pool: (nbytes, data)}`` a tensor evicted
        from ``pool_name`` keeps (the cascade); None or ``{}`` drops it. Without it, evicted
        tensors are dropped."""
        self.pools = {name: Pool(name, capacities.get(name, 0)) for name in POOLS}
        self.demote = demote  # None: no cascade (planner_check --no-cascade)
        self.demotions = 0  # evicted tensors that went to a lower pool
        self.state: dict[int, str] = {}
        self.count: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self._clock = itertools.count(1)
        self.pinned: set[int] = set()

    # --- queries
    def state_of(self, uid: int) -> str | None:
        return self.state.get(uid)

    def get(self, uid: int):
        st = self.state.get(uid)
        return None if st is None else self.pools[st].items[uid][1]

    def used_bytes(self) -> int:
        return sum(p.used for p in self.pools.values())

    def capacity_bytes(self) -> int:
        return sum(p.capacity for p in self.pools.values())

    def summary(self) -> dict:
        return {n: {"capacity": p.capacity, "used": p.used, "tensors": len(p)} for n, p in self.pools.items()}

    # --- updates
    def touch(self, uid: int) -> None:
        self.count[uid] = self.count.get(uid, 0) + 1
        self.last[uid] = next(self._clock)
        st = self.state.get(uid)
        if st is not None:
            heapq.heappush(self.pools[st]._heap, (self.count[uid], self.last[uid], uid))

    def _prio(self, uid: int) -> tuple[int, int]:
        return (self.count.get(uid, 0), self.last.get(uid, 0))

    def can_take(self, pool_name: str, uid: int, nbytes: int) -> bool:
        pool = self.pools[pool_name]
        if nbytes > pool.capacity:
            return False
        free = pool.capacity - pool.used
        if free >= nbytes:
            return True
        need = nbytes - free
        mine = self._prio(uid)
        for victim, vbytes in self._victims(pool, mine[0]):
            need -= vbytes
            if need <= 0:
                return True
        return False

    def _victims(self, pool: Pool, below: int):
        """Evictable tensors of ``pool`` used fewer than ``below`` times, lowest (count, last) first."""
        seen = set()
        for cnt, last, uid in sorted(pool._heap) if len(pool._heap) < 64 else self._heap_iter(pool):
            if uid in seen or uid not in pool.items or (cnt, last) != self._prio(uid):
                continue
            seen.add(uid)
            if cnt >= below:
                break
            if uid in self.pinned:
                continue
            yield uid, pool.items[uid][0]

    @staticmethod
    def _heap_iter(pool: Pool):
        # a copy popped in order: O(k log n) for the k victims we look at
        h = list(pool._heap)
        while h:
            yield heapq.heappop(h)

    def offer(self, uid: int, forms: dict) -> str | None:
        """Place ``uid`` in the best pool above its state that takes it.

        ``forms[pool] = (nbytes, data or zero-argument callable making it)`` for the pools this
        tensor can enter now. Returns the new state (or the old one when no pool took it).
        """
        cur = self.state.get(uid)
        for name in POOLS:
            if cur == name:
                return cur
            if name not in forms:
                continue
            nbytes, data = forms[name]
            if not self.can_take(name, uid, nbytes):
                continue
            pool = self.pools[name]
            need = nbytes - (pool.capacity - pool.used)
            evicted = []
            if need > 0:
                for victim, vbytes in list(self._victims(pool, self._prio(uid)[0])):
                    evicted.append((victim, pool.items[victim][1]))
                    self._remove(victim)
                    need -= vbytes
                    if need <= 0:
                        break
            if cur is not None:
                self._remove(uid)
            if callable(data):
                data = data()
            if pool.adopt is not None:
                data = pool.adopt(uid, data)
            pool.items[uid] = (nbytes, data)
            pool.used += nbytes
            self.state[uid] = name
            heapq.heappush(pool._heap, (*self._prio(uid), uid))
            self._compact(pool)
            for victim, vdata in evicted:
                self._cascade(victim, name, vdata)
            return name
        return cur

    def _cascade(self, uid: int, from_pool: str, data) -> None:
        """Offer a tensor just evicted from ``from_pool`` to the pools below it, with what it keeps."""
        if self.demote is None:
            return
        below = POOLS[POOLS.index(from_pool) + 1 :]
        forms = {k: v for k, v in (self.demote(from_pool, data) or {}).items() if k in below}
        if forms and self.offer(uid, forms) is not None:
            self.demotions += 1

    def put(self, uid: int, pool_name: str, nbytes: int, data) -> bool:
        """Place without competing (warm start): only if it fits in the free space."""
        pool = self.pools[pool_name]
        if self.state.get(uid) is not None or pool.capacity - pool.used < nbytes:
            return False
        if pool.adopt is not None:
            data = pool.adopt(uid, data)
        pool.items[uid] = (nbytes, data)
        pool.used += nbytes
        self.state[uid] = pool_name
        heapq.heappush(pool._heap, (*self._prio(uid), uid))
        return True

    def _remove(self, uid: int) -> None:
        st = self.state.pop(uid, None)
        if st is None:
            return
        pool = self.pools[st]
        nbytes, data = pool.items.pop(uid)
        pool.used -= nbytes
        if pool.release is not None:
            pool.release(uid, data)

    def drop(self, uid: int) -> None:
        self._remove(uid)

    def clear(self) -> None:
        for uid in list(self.state):
            self._remove(uid)
        for p in self.pools.values():
            p._heap.clear()

    @staticmethod
    def _compact(pool: Pool) -> None:
        if len(pool._heap) > 4 * len(pool.items) + 64:
            live = {}
            for cnt, last, uid in pool._heap:
                if uid in pool.items and (uid not in live or (cnt, last) > live[uid]):
                    live[uid] = (cnt, last)
            pool._heap = [(c, l, u) for u, (c, l) in live.items()]
            heapq.heapify(pool._heap)
