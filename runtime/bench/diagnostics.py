"""What a benchmark run's token stream and expert cache did: pure functions over its records.

A random-weight model decoded greedily falls into a short loop, its routing repeats and any
cache hits almost always; these figures say whether a run was such a loop and how good its
cache was against the best possible one:

* :func:`cycle_period`: the shortest period ``p <= 8`` with which the last half of a row's
  tokens repeats (None: it does not), or, for a noisy loop whose last half (12 tokens or more)
  holds at most 4 distinct ids, that number of ids;
* :func:`distinct_tokens`, :func:`distinct_pairs`: distinct token ids over all rows, distinct
  ``(layer, expert)`` pairs the decode steps used;
* :func:`quarter_hit_rates`: the share of expert-tensor uses that were hits in any pool, over
  the decode steps of the run's first and last quarter, from the runtime's ``hits`` counters
  snapshotted at every token;
* :func:`belady_hit_rate`: the hit rate of Belady's MIN (on a miss with the cache full, evict
  the item whose next use is furthest in the future: the optimal offline policy for unit-size
  items) over a sequence of keys with a capacity in items, the cache starting with the best
  content it could hold (a run's cache starts full); :func:`lru_hit_rate` beside it.
  ``O(n log n)``: the next use of every position is precomputed, the cache is a max-heap of
  next uses with lazy deletion.

The worker (runtime/bench/worker.py) records the inputs; the report prints the results.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

__all__ = ["MAX_PERIOD", "cycle_period", "run_cycle", "distinct_tokens", "distinct_pairs", "step_keys", "hit_rate",
           "quarter_hit_rates", "belady_hit_rate", "lru_hit_rate", "expert_capacity", "summarize_run", "workload_record"]

MAX_PERIOD = 8
NOISY_IDS = 4  # a last half drawn from this few ids is a (noisy) loop ...
NOISY_MIN = 12  # ... when it has at least this many tokens
NONE = "none"  # the counters' miss state


def cycle_period(tokens, max_period: int = MAX_PERIOD, exact_only: bool = False) -> int | None:
    """The shortest period ``p <= max_period`` with which the last half of ``tokens`` repeats
    (``t[i] == t[i + p]`` throughout it), or None. The half must hold at least two periods and
    four tokens, so that a short run is never called a loop on too little evidence.

    A random-weight model's greedy loop is often not exact: its two or three tokens alternate
    irregularly (near-ties that round differently from step to step). Unless ``exact_only``, a
    last half of at least :data:`NOISY_MIN` tokens drawn from at most :data:`NOISY_IDS` distinct
    ids is a loop too, and its period is that number of ids (natural text repeats far fewer
    tokens: about 20 distinct in 32)."""
    toks = list(tokens)
    half = toks[len(toks) // 2:]
    for p in range(1, max_period + 1):
        if len(half) < max(4, 2 * p):
            break
        if all(half[i] == half[i + p] for i in range(len(half) - p)):
            return p
    if not exact_only and len(half) >= NOISY_MIN:
        distinct = len(set(half))
        if distinct <= min(NOISY_IDS, max_period) and len(half) >= 4 * distinct:
            return distinct
    return None


def run_cycle(rows) -> tuple[int | None, list]:
    """``(shortest period over the rows or None, each row's period)``."""
    per = [cycle_period(r) for r in rows or []]
    found = [p for p in per if p is not None]
    return (min(found) if found else None), per


def distinct_tokens(rows) -> int:
    return len({t for r in rows or [] for t in r})


def step_keys(steps) -> list:
    """The ``(layer, expert)`` uses of a list of steps, each step a list of ``(layer, experts)``
    layer calls, in order (a layer call's experts in ascending id, each once)."""
    out = []
    for step in steps:
        for layer, experts in step:
            for e in sorted(set(int(x) for x in experts)):
                out.append((int(layer), e))
    return out


def distinct_pairs(steps) -> int:
    return len(set(step_keys(steps)))


def hit_rate(hits: dict | None) -> float | None:
    """Hits in any pool / all uses of a ``{state: count}`` mapping (None when there were none)."""
    if not hits:
        return None
    total = sum(v for v in hits.values() if isinstance(v, (int, float)))
    if total <= 0:
        return None
    return (total - hits.get(NONE, 0)) / total


def _sub(a: dict, b: dict) -> dict:
    return {k: v - b.get(k, 0) for k, v in a.items()}


def quarter_hit_rates(snapshots: list) -> tuple[float | None, float | None]:
    """Hit rates over the first and the last quarter of the decode steps.

    ``snapshots[k]`` is the ``hits`` counter (``{state: count}``) once token ``k`` was known:
    ``snapshots[0]`` after the prefill, so decode step ``k`` (``k >= 1``) used
    ``snapshots[k] - snapshots[k - 1]``. A quarter is at least one step."""
    steps = len(snapshots) - 1
    if steps < 1:
        return None, None
    q = max(1, steps // 4)
    first = _sub(snapshots[q], snapshots[0])
    last = _sub(snapshots[steps], snapshots[steps - q])
    return hit_rate(first), hit_rate(last)


def _prefill(keys: list, capacity: int) -> list:
    """The first ``capacity`` distinct keys in order of first use: the best starting content
    of a cache of that size for this sequence (what MIN would load into free slots)."""
    seen: dict = {}
    for k in keys:
        if len(seen) >= capacity:
            break
        seen.setdefault(k, True)
    return list(seen)


def belady_hit_rate(keys, capacity: int, warm: int = 0, start_full: bool = False) -> float | None:
    """The hit rate of Belady's MIN over ``keys`` with room for ``capacity`` items (the most hits
    any policy gets); the first ``warm`` uses fill the cache (with the same policy) but are not
    counted (MIN then need not be the best for the rest). ``start_full``:
    the cache starts with the best content it could hold (:func:`_prefill`) instead of empty,
    so that no policy starting from any content does better (a run's cache is not empty when it
    starts: earlier runs and the loader filled it). None when no use is counted."""
    keys = list(keys)
    n = len(keys)
    counted = n - min(warm, n)
    if counted <= 0:
        return None
    if capacity <= 0:
        return 0.0
    nxt = [n] * n  # position of the next use of keys[i] (n + i: never again)
    last: dict = {}
    for i in range(n - 1, -1, -1):
        nxt[i] = last.get(keys[i], n + i)  # distinct "never" values keep the heap's order total
        last[keys[i]] = i
    cached: dict = {}  # key -> its next use
    heap: list = []  # (-next use, key), stale entries skipped
    if start_full:
        for k in _prefill(keys, capacity):
            cached[k] = last[k]  # ``last`` now holds each key's first use
            heapq.heappush(heap, (-last[k], k))
    hits = 0
    for i, k in enumerate(keys):
        if k in cached:
            if i >= warm:
                hits += 1
        elif len(cached) >= capacity:
            while True:
                neg, victim = heapq.heappop(heap)
                if cached.get(victim) == -neg:
                    del cached[victim]
                    break
        cached[k] = nxt[i]
        heapq.heappush(heap, (-nxt[i], k))
    return hits / counted


def lru_hit_rate(keys, capacity: int, warm: int = 0, start_full: bool = False) -> float | None:
    """The hit rate of least-recently-used eviction over ``keys`` (as :func:`belady_hit_rate`)."""
    keys = list(keys)
    counted = len(keys) - min(warm, len(keys))
    if counted <= 0:
        return None
    if capacity <= 0:
        return 0.0
    cache: OrderedDict = OrderedDict((k, True) for k in (reversed(_prefill(keys, capacity)) if start_full else ()))
    hits = 0
    for i, k in enumerate(keys):
        if k in cache:
            cache.move_to_end(k)
            if i >= warm:
                hits += 1
            continue
        if len(cache) >= capacity:
            cache.popitem(last=False)
        cache[k] = True
    return hits / counted


def expert_capacity(pool_bytes: dict, expert_bytes: dict, slots: dict | None = None) -> tuple[int, bool]:
    """The cache's capacity in experts and whether it is an upper bound (more than one pool).

    ``slots``: experts per pool where the plan gives them (its slot counts); else each pool's
    bytes / the bytes of one expert in that pool's form (``expert_bytes``: full tensors,
    compressed, SM only, E only), summed over the pools and rounded down (the runtime caches
    tensors, so a pool's remainder still holds parts of an expert). An expert in a pool other
    than ``full`` is still a hit, so with mixed pools the total over-counts what one pool of the
    same bytes holds: MIN's hit rate is then an upper bound."""
    total, used = 0.0, 0
    for pool, b in (pool_bytes or {}).items():
        if slots is not None and pool in slots:
            n = float(int(slots[pool]))
        else:
            per = int(expert_bytes.get(pool) or 0)
            n = int(b) / per if per > 0 and b else 0.0
        if n > 0:
            total += n
            used += 1
    return int(total + 1e-9), used > 1


def summarize_run(tokens, steps, snapshots, capacity: int | None, upper_bound: bool = False) -> dict:
    """A run's diagnostics fields: ``distinct_tokens``, ``cycle`` (and ``cycle_rows``), and with
    ``steps`` (prefill first, then one per decode step) and ``snapshots`` (hits per token):
    ``distinct_experts``, ``hit_rate_first_quarter``, ``hit_rate_last_quarter``,
    ``belady_hit_rate`` (and ``lru_hit_rate``) over the decode steps' uses at ``capacity``
    experts, both starting from the best content (``start_full``)."""
    period, per_row = run_cycle(tokens)
    out = {"distinct_tokens": distinct_tokens(tokens), "cycle": period, "cycle_rows": sum(p is not None for p in per_row)}
    if snapshots:
        first, last = quarter_hit_rates(snapshots)
        out.update(hit_rate_first_quarter=first, hit_rate_last_quarter=last)
    if steps:
        # the decode steps' uses; MIN and LRU start from the best content the cache could hold
        # (whatever the prefill and earlier runs left, no policy from any start does better)
        keys = step_keys(steps[1:])
        out["distinct_experts"] = len(set(keys))
        out["decode_expert_uses"] = len(keys)
        if capacity is not None:
            out.update(cache_capacity_experts=int(capacity), capacity_upper_bound=bool(upper_bound),
                       belady_hit_rate=belady_hit_rate(keys, capacity, start_full=True),
                       lru_hit_rate=lru_hit_rate(keys, capacity, start_full=True))
    return out


def workload_record(case: dict, gen: list, forced=None) -> dict:
    """The run record's ``workload`` (what ran: forcing that did not take is said, never
    silent), ``seed`` / ``temperature`` when sampling, ``argmax_tokens`` under teacher forcing
    (the token check compares these), ``distinct_tokens`` and ``cycle`` of the generated rows."""
    workload = case.get("workload") or "greedy"
    out: dict = {"workload": workload}
    if workload == "sample":
        out.update(seed=int(case.get("seed") or 0), temperature=float(case.get("temperature") or 1.0))
    if case.get("forced"):
        if forced is not None:  # a ForcedTokens (its argmax_tokens()) or the argmax rows themselves
            out["argmax_tokens"] = forced.argmax_tokens() if hasattr(forced, "argmax_tokens") else forced
        want = case["forced"]
        if any(list(g) != list(w[: len(g)]) for g, w in zip(gen, want)):
            out["workload"] = f"{workload} (forcing not applied: the tokens are not the forced stream)"
            out["forcing_failed"] = True
    period, rows = run_cycle(gen)
    out.update(distinct_tokens=distinct_tokens(gen), cycle=period, cycle_rows=sum(p is not None for p in rows))
    return out
