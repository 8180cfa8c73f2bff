"""The expert cache's LFU structure: bounded memory, aging, the admission rule kept (vs a brute-force reference)."""

from __future__ import annotations

import random

from zipmoe.runtime.engine.cache import POOLS, ExpertCache


class _Reference:
    """The admission rule written the slow, obvious way (docs/runtime.md "The cache")."""

    def __init__(self, caps):
        self.caps = dict(caps)
        self.items = {p: {} for p in POOLS}
        self.state, self.count, self.last, self.clock = {}, {}, {}, 0
        self.pinned = set()

    def touch(self, uid):
        self.clock += 1
        self.count[uid] = self.count.get(uid, 0) + 1
        self.last[uid] = self.clock

    def offer(self, uid, forms):
        cur = self.state.get(uid)
        for name in POOLS:
            if cur == name:
                return cur
            if name not in forms:
                continue
            nbytes = forms[name][0]
            items = self.items[name]
            free = self.caps.get(name, 0) - sum(items.values())
            if nbytes > self.caps.get(name, 0):
                continue
            victims = sorted((self.count[u], self.last[u], u) for u in items
                             if self.count[u] < self.count[uid] and u not in self.pinned)
            chosen, need = [], nbytes - free
            for _, _, u in victims:
                if need <= 0:
                    break
                chosen.append(u)
                need -= items[u]
            if need > 0:
                continue
            for u in chosen:
                del items[u]
                del self.state[u]
            if cur is not None:
                del self.items[cur][uid]
            items[uid] = nbytes
            self.state[uid] = name
            return name
        return cur


def test_admissions_match_the_reference_rule():
    rng = random.Random(0)
    caps = {"full": 500, "compressed": 300, "e_only": 100}
    c, ref = ExpertCache(caps), _Reference(caps)
    sizes = {u: rng.choice((40, 50, 60)) for u in range(60)}
    weights = [1.0 / (u + 1) for u in range(60)]
    for step in range(3000):
        layer = rng.choices(range(60), weights=weights, k=6)
        c.pinned = ref.pinned = set(layer)
        for u in layer:
            c.touch(u)
            ref.touch(u)
        for u in layer:
            forms = {"full": (sizes[u], u), "compressed": (sizes[u] * 2 // 3, u), "e_only": (sizes[u] // 6, u)}
            assert c.offer(u, forms) == ref.offer(u, forms), step
        assert c.state == ref.state, step
    for name in POOLS:
        assert c.pools[name].used == sum(ref.items[name].values())


def test_memory_is_bounded_by_tensors_not_hits():
    c = ExpertCache({"full": 10 * 8})
    for u in range(10):
        c.touch(u)
        assert c.offer(u, {"full": (8, u)}) == "full"
    size = c.structure_size()
    for i in range(100_000):
        c.touch(i % 10)  # every one a hit
    assert c.structure_size() == size
    assert sum(p.entries() for p in c.pools.values()) == 10
    assert all(len(c.pools[p].counts) <= len(c.pools[p]) for p in POOLS)


def test_an_admission_looks_only_at_the_victims_it_needs():
    c = ExpertCache({"full": 1000})
    for u in range(1000):  # 1000 residents, counts 1..many
        for _ in range(1 + u % 7):
            c.touch(u)
        c.offer(u, {"full": (1, u)})
    for _ in range(100_000):
        c.touch(5)
    for _ in range(3):
        c.touch(5000)
    c.examined = 0
    assert c.offer(5000, {"full": (1, 5000)}) == "full"
    # one victim needed: the walk stops there (the heap copied and popped all hits before)
    assert c.examined <= 2  # can_take's walk and offer's walk
    c.pinned = {u for u in range(1000) if u % 7 == 0}  # the 143 count-1 residents can't go
    c.examined = 0
    for _ in range(3):
        c.touch(5001)
    assert c.offer(5001, {"full": (1, 5001)}) == "full"
    assert c.examined <= 2 * (len(c.pinned) + 1)


def test_aging_lets_new_hot_experts_displace_old_ones():
    def run(age_every):
        c = ExpertCache({"full": 4}, age_every=age_every)
        for _ in range(2000):  # topic 1: experts 0-3 hot
            for u in range(4):
                c.touch(u)
                c.offer(u, {"full": (1, u)})
        for _ in range(300):  # topic 2: experts 10-13 hot, the old ones never used again
            for u in range(10, 14):
                c.touch(u)
                c.offer(u, {"full": (1, u)})
        return c

    old = run(0)
    assert sorted(old.pools["full"].items) == [0, 1, 2, 3]  # counts never decay: stuck
    new = run(64)
    assert sorted(new.pools["full"].items) == [10, 11, 12, 13]
    assert new.agings > 0 and max(new.count.values()) < 64
    # aging keeps the ranking among the tensors used at the same rate
    assert new.structure_size() <= old.structure_size()


def test_aging_keeps_ties_by_recency_and_the_buckets_consistent():
    c = ExpertCache({"full": 3}, age_every=10)
    for u in (1, 2, 3):
        c.touch(u)
        c.offer(u, {"full": (1, u)})
    for _ in range(4):
        c.touch(3)
    c.touch(2)
    c.touch(1)
    c.touch(4)  # the 10th touch: counts halve
    assert c.agings == 1
    assert c.count[1] == 1 and c.count[2] == 1 and c.count[3] == 2 and 4 not in c.count
    for _ in range(4):
        c.touch(9)
    assert c.offer(9, {"full": (1, 9)}) == "full"
    assert c.state_of(2) is None and c.state_of(1) == "full"  # equal counts: the least recent goes
    for p in c.pools.values():
        for cnt, b in p.buckets.items():
            assert all(c.count.get(u, 0) == cnt for u in b)


def test_admitted_bytes_count_fetches_not_the_cascade():
    from zipmoe.runtime.engine.cache import ExpertCache

    def demote(pool, data):
        return {"e_only": (1, "e")} if pool == "compressed" else None

    cache = ExpertCache({"compressed": 3, "e_only": 10}, demote=demote)
    for uid in (1, 2, 3):
        cache.touch(uid)
        cache.touch(uid) if uid == 3 else None
        cache.offer(uid, {"compressed": (3, "c"), "e_only": (1, "e")})
    # 1 enters compressed, 2 (same count) goes to e_only, 3 (used more) evicts 1 from compressed,
    # which the cascade moves down to e_only without a copy
    assert cache.state_of(3) == "compressed" and cache.state_of(1) == "e_only" and cache.demotions == 1
    assert cache.admitted == {"full": 0, "compressed": 6, "sm_only": 0, "e_only": 1}
