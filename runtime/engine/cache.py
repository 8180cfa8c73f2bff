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
working set (see :mod:`zipmoe.runtime.engine.core`).

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

Structure (O(1) LFU with frequency buckets). Each pool keeps its residents in buckets by count
(``{count: OrderedDict(uid -> None)}``, least recent use first within a bucket) and a sorted list
of the counts that have a bucket. A touch moves a resident from bucket ``c`` to ``c + 1`` (its
place there: after every resident used before it, i.e. at the end, as touches come in clock
order); an admission walks the buckets from the lowest count up and stops at the first victim
set that makes room, or at the admitted tensor's own count. Nothing is added per hit: the memory
is the counts and clocks of the tensors ever used (bounded by the number of expert tensors) plus
one bucket entry per resident. (The previous heap got an entry per hit: 1.92 M entries after
10k tokens with every expert resident, and one admission copied and popped all of them, 6.1 s.)

Aging. Every ``age_every`` touches (the runtime sets it to ``age_tokens`` tokens' worth of
expert uses: ``age_tokens * top_k * tensors per expert * sparse layers``, i.e. exactly
``age_tokens`` tokens at batch 1; :data:`DEFAULT_AGE_TOKENS`, ``zipmoe.load(cache_age=N)``,
0 turns aging off) every count is halved (rounded down) and the buckets rebuilt (O(tensors)
once per period, so O(1) per touch amortised). Without it counts only grow: after a change of
topic the experts now hot could not displace those that were hot for the first thousands of
tokens (their counts would have to catch up first). With it a count is an exponentially
decayed use frequency (half-life ``age_tokens`` tokens), the ranking the planner assumes is the
recent one, and the counts stay small.
"""

from __future__ import annotations

import bisect
import itertools
from collections import OrderedDict

from zipmoe.runtime.engine.settings import DEFAULT_AGE_TOKENS  # counts halve every this many tokens (module doc)

__all__ = ["Pool", "ExpertCache", "POOLS", "DEFAULT_AGE_TOKENS", "aging_period"]

POOLS = ("full", "compressed", "sm_only", "e_only")


def aging_period(age_tokens: int, top_k: int, tensors_per_expert: int, sparse_layers: int) -> int:
    """``ExpertCache(age_every=)`` for counts that halve every ``age_tokens`` tokens at batch 1:
    a token touches ``top_k`` experts' tensors in every sparse layer (the module doc, "Aging")."""
    return int(age_tokens) * max(1, int(top_k)) * max(1, int(tensors_per_expert)) * max(1, int(sparse_layers))


class Pool:
    """One pool: its residents (``items``) and their LFU buckets (see the module doc)."""

    def __init__(self, name: str, capacity: int) -> None:
        self.name = name
        self.capacity = int(max(0, capacity))
        self.used = 0
        self.items: dict[int, tuple[int, object]] = {}  # uid -> (nbytes, data)
        self.buckets: dict[int, OrderedDict] = {}  # count -> residents, least recent first
        self.counts: list[int] = []  # the keys of ``buckets``, ascending
        # optional hooks (the full pool's device slots, engine/slots.py): adopt(uid, data) -> the
        # data to keep; release(uid, data) when a tensor leaves the pool
        self.adopt = None
        self.release = None

    def __len__(self) -> int:
        return len(self.items)

    # --- buckets
    def _bucket(self, cnt: int) -> OrderedDict:
        b = self.buckets.get(cnt)
        if b is None:
            b = self.buckets[cnt] = OrderedDict()
            bisect.insort(self.counts, cnt)
        return b

    def _unbucket(self, uid: int, cnt: int) -> None:
        b = self.buckets[cnt]
        del b[uid]
        if not b:
            del self.buckets[cnt]
            del self.counts[bisect.bisect_left(self.counts, cnt)]

    def _enter(self, uid: int, cnt: int, last: int, last_of) -> None:
        """Put ``uid`` in bucket ``cnt`` at its place by last use (the residents used after it,
        at most those touched since, i.e. the layer's own, move behind it)."""
        b = self._bucket(cnt)
        later = []
        while b:
            tail = next(reversed(b))
            if last_of(tail) <= last:
                break
            later.append(tail)
            b.popitem(last=True)
        b[uid] = None
        for t in reversed(later):
            b[t] = None

    def entries(self) -> int:
        """Bucket entries (one per resident): the structure's size, for the tests."""
        return sum(len(b) for b in self.buckets.values())


class ExpertCache:
    def __init__(self, capacities: dict, demote=None, age_every: int = 0) -> None:
        """``demote(pool_name, data)``: the forms ``{lower_pool: (nbytes, data)}`` a tensor evicted
        from ``pool_name`` keeps (the cascade); None or ``{}`` drops it. Without it, evicted
        tensors are dropped. ``age_every``: halve every count after this many touches (0: never)."""
        self.pools = {name: Pool(name, capacities.get(name, 0)) for name in POOLS}
        # the pools that can hold anything (capacities are fixed): what an admission offers to
        self.open_pools = frozenset(name for name, p in self.pools.items() if p.capacity > 0)
        self.demote = demote  # None: no cascade (planner_check --no-cascade)
        self.demotions = 0  # evicted tensors that went to a lower pool
        self.state: dict[int, str] = {}
        self.count: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self._clock = itertools.count(1)
        self.pinned: set[int] = set()
        self.age_every = max(0, int(age_every))
        self._since_aging = 0
        self.agings = 0  # how many times the counts were halved
        self.examined = 0  # bucket entries looked at by admissions (the tests bound it)
        # bytes each pool took from fetches (``admitted``) and from the cascade (``cascaded``): the
        # runtime copies what the SM-only and E-only pools take of either into arrays of their own
        # on the serving thread, which the planner charges; the compressed pool keeps the read
        # buffers themselves (engine/adopt.py). runtime/plan/replay.py, docs/planner.md
        # "Admission copies"
        self.admitted = {name: 0 for name in POOLS}
        self.cascaded = {name: 0 for name in POOLS}
        self._cascading = False

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

    def structure_size(self) -> int:
        """Entries the policy keeps (counts, clocks, bucket entries): bounded by the number of
        tensors ever used plus the residents, whatever the number of hits."""
        return len(self.count) + len(self.last) + sum(p.entries() + len(p.counts) for p in self.pools.values())

    # --- updates
    def touch(self, uid: int) -> None:
        old = self.count.get(uid, 0)
        self.count[uid] = old + 1
        self.last[uid] = next(self._clock)
        st = self.state.get(uid)
        if st is not None:
            pool = self.pools[st]
            pool._unbucket(uid, old)
            pool._bucket(old + 1)[uid] = None  # the most recent use: the end of its bucket
        if self.age_every:
            self._since_aging += 1
            if self._since_aging >= self.age_every:
                self.age()

    def age(self) -> None:
        """Halve every count (rounded down) and rebuild the buckets; forget tensors whose count
        reaches 0 and that no pool holds."""
        self._since_aging = 0
        self.agings += 1
        for uid in list(self.count):
            c = self.count[uid] >> 1
            if c == 0 and uid not in self.state:
                del self.count[uid]
                self.last.pop(uid, None)
            else:
                self.count[uid] = c
        for pool in self.pools.values():
            pool.buckets.clear()
            pool.counts.clear()
            for uid in sorted(pool.items, key=lambda u: self.last.get(u, 0)):
                pool._bucket(self.count.get(uid, 0))[uid] = None

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
        for victim, vbytes in self._victims(pool, self._prio(uid)[0]):
            need -= vbytes
            if need <= 0:
                return True
        return False

    def _victims(self, pool: Pool, below: int):
        """Evictable tensors of ``pool`` used fewer than ``below`` times, lowest (count, last) first."""
        for cnt in list(pool.counts):
            if cnt >= below:
                return
            b = pool.buckets.get(cnt)
            if not b:
                continue
            for uid in list(b):
                self.examined += 1
                if uid in self.pinned:
                    continue
                yield uid, pool.items[uid][0]

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
                chosen = []
                for victim, vbytes in self._victims(pool, self._prio(uid)[0]):
                    chosen.append(victim)
                    need -= vbytes
                    if need <= 0:
                        break
                for victim in chosen:
                    evicted.append((victim, pool.items[victim][1]))
                    self._remove(victim)
            if cur is not None:
                self._remove(uid)
            if callable(data):
                data = data()
            (self.cascaded if self._cascading else self.admitted)[name] += nbytes
            self._insert(pool, uid, nbytes, data)
            for victim, vdata in evicted:
                self._cascade(victim, name, vdata)
            return name
        return cur

    def _insert(self, pool: Pool, uid: int, nbytes: int, data) -> None:
        if pool.adopt is not None:
            data = pool.adopt(uid, data)
        pool.items[uid] = (nbytes, data)
        pool.used += nbytes
        self.state[uid] = pool.name
        cnt, last = self._prio(uid)
        pool._enter(uid, cnt, last, lambda u: self.last.get(u, 0))

    def _cascade(self, uid: int, from_pool: str, data) -> None:
        """Offer a tensor just evicted from ``from_pool`` to the pools below it, with what it keeps."""
        if self.demote is None:
            return
        below = POOLS[POOLS.index(from_pool) + 1 :]
        forms = {k: v for k, v in (self.demote(from_pool, data) or {}).items() if k in below}
        if not forms:
            return
        outer, self._cascading = self._cascading, True
        try:
            if self.offer(uid, forms) is not None:
                self.demotions += 1
        finally:
            self._cascading = outer

    def put(self, uid: int, pool_name: str, nbytes: int, data) -> bool:
        """Place without competing (warm start): only if it fits in the free space."""
        pool = self.pools[pool_name]
        if self.state.get(uid) is not None or pool.capacity - pool.used < nbytes:
            return False
        self._insert(pool, uid, nbytes, data)
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
        pool._unbucket(uid, self.count.get(uid, 0))

    def drop(self, uid: int) -> None:
        self._remove(uid)

    def pin(self, uid: int) -> None:
        """A running layer uses ``uid``: no admission may evict it until :meth:`unpin_all`."""
        self.pinned.add(uid)

    def unpin_all(self) -> None:
        self.pinned.clear()

    def clear(self) -> None:
        for uid in list(self.state):
            self._remove(uid)
