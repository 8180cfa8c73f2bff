"""runtime/bench/diagnostics.py: Belady's MIN against a brute-force optimum, LRU never better,
cycle detection on loops and on text, the quarter hit rates and the capacity in experts."""

from __future__ import annotations

import functools
import random

import pytest

from zipmoe.runtime.bench import diagnostics as d


def _optimal_hits(keys, capacity, warm=0, start_full=False) -> int:
    """The most hits any demand-paging policy gets (every miss inserts; evict any item), from
    an empty cache or, with ``start_full``, from the best of every starting content."""
    import itertools

    keys = tuple(keys)

    @functools.lru_cache(maxsize=None)
    def best(i, cache):
        if i == len(keys):
            return 0
        k = keys[i]
        count = 1 if i >= warm else 0
        if k in cache:
            return count + best(i + 1, cache)
        if len(cache) < capacity:
            return best(i + 1, frozenset(cache | {k}))
        return max(best(i + 1, frozenset((cache - {v}) | {k})) for v in cache)

    if not start_full:
        return best(0, frozenset())
    universe = sorted(set(keys))
    return max(best(0, frozenset(s)) for r in range(min(capacity, len(universe)) + 1)
               for s in itertools.combinations(universe, r))


@pytest.mark.parametrize("start_full", [False, True])
@pytest.mark.parametrize("seed", range(30))
def test_belady_is_the_optimum_and_lru_never_beats_it(seed, start_full):
    rng = random.Random(seed)
    n = rng.randint(1, 14)
    universe = rng.randint(1, 6)
    keys = [rng.randrange(universe) for _ in range(n)]
    cap = rng.randint(1, 4)
    warm = 0  # MIN maximises all hits; with uncounted leading uses it need not maximise the rest
    counted = n - warm
    opt = _optimal_hits(keys, cap, warm, start_full)
    got = d.belady_hit_rate(keys, cap, warm, start_full=start_full)
    if counted == 0:
        assert got is None
        return
    assert got == pytest.approx(opt / counted)
    assert d.lru_hit_rate(keys, cap, warm, start_full=start_full) <= got + 1e-12
    if start_full:
        assert got >= d.belady_hit_rate(keys, cap, warm) - 1e-12


def test_belady_edge_cases_and_tuple_keys():
    assert d.belady_hit_rate([], 3) is None
    assert d.belady_hit_rate([1, 2, 1], 0) == 0.0
    assert d.belady_hit_rate([1, 1, 1, 1], 1) == pytest.approx(0.75)
    assert d.belady_hit_rate([1, 2, 3, 1, 2, 3], 3, warm=3) == 1.0
    # a loop larger than the cache: LRU never hits, MIN keeps most of it
    loop = [(0, e) for e in range(5)] * 20
    assert d.lru_hit_rate(loop, 4) == 0.0
    assert d.belady_hit_rate(loop, 4) > 0.7
    big = [random.Random(1).randrange(300) for _ in range(20000)]
    assert 0 < d.belady_hit_rate(big, 50) < 1  # fast enough for a long run


def test_cycle_period_on_loops_and_text():
    assert d.cycle_period([5, 9, 3, 7, 1, 4, 4, 4, 4, 4, 4, 4]) == 1
    assert d.cycle_period([1, 2, 3, 4, 5, 6, 7] + [8, 9] * 10) == 2
    assert d.cycle_period(list(range(10)) + [1, 2, 3] * 6) == 3
    assert d.cycle_period(list(range(40))) is None
    assert d.cycle_period([1, 2]) is None  # too short to say
    # a random-weight model's noisy loop (seen on the tiny synthetic Mixtral): no exact period
    noisy = [371] + [54, 17] * 11 + [17, 17, 17, 54, 17, 17, 17, 54, 17, 54, 17, 17, 54] + [17] * 6 + [54] + [17] * 21
    assert d.cycle_period(noisy, exact_only=True) is None and d.cycle_period(noisy) == 2
    assert d.cycle_period(list(range(10)) + [0, 1, 2, 3, 4, 5, 6, 7, 8, 9] * 3) is None  # period 10 > 8
    from zipmoe.runtime.plan.workload import teacher_forced

    _, forced = teacher_forced(None, {"vocab_size": 256}, rows=8, prompt_tokens=32, new_tokens=64)
    assert all(d.cycle_period(r) is None for r in forced)
    period, rows = d.run_cycle([[1] * 10, list(range(10))])
    assert period == 1 and rows == [1, None]
    assert d.distinct_tokens([[1, 2], [2, 3]]) == 3


def test_quarter_hit_rates_and_pairs():
    snaps = [{"full": 0, "none": 0}]
    for k in range(1, 9):  # 8 decode steps: misses first, hits later
        prev = snaps[-1]
        snaps.append({"full": prev["full"] + (k > 4) * 2, "none": prev["none"] + (k <= 4) * 2})
    first, last = d.quarter_hit_rates(snaps)
    assert first == 0.0 and last == 1.0
    assert d.quarter_hit_rates([{"full": 1}]) == (None, None)
    steps = [[(0, [1, 2, 3])], [(0, [1, 2]), (1, [1])], [(0, [2]), (1, [1])]]
    assert d.distinct_pairs(steps[1:]) == 3
    out = d.summarize_run([[1, 2, 3, 4, 5, 6, 7, 8]], steps, snaps[:3], capacity=2)
    assert out["distinct_experts"] == 3 and out["cycle"] is None and out["belady_hit_rate"] is not None
    assert out["decode_expert_uses"] == 5


def test_expert_capacity():
    per = {"full": 100, "compressed": 66, "sm_only": 50, "e_only": 16}
    assert d.expert_capacity({"full": 1000, "compressed": 0, "sm_only": 0, "e_only": 0}, per) == (10, False)
    assert d.expert_capacity({"full": 250, "compressed": 132, "sm_only": 0, "e_only": 0}, per) == (4, True)
    assert d.expert_capacity({"full": 290, "compressed": 120, "sm_only": 0, "e_only": 0}, per) == (4, True)  # 2.9 + 1.8
    assert d.expert_capacity({"full": 1000}, per, slots={"full": 7}) == (7, False)
