"""Search the partitions of the budget among the four cache pools.

A plan is a number of expert *slots* per sparse layer in each pool (``full``, ``compressed``,
``sm_only``, ``e_only``; runtime.plan.model assigns them to ranks hottest first in that
order). A slot costs, per pool, the bytes of one average expert in that form (``slot_bytes``:
full = bf16 bytes, compressed = E + SM as stored, sm_only = SM, e_only = E). Every sparse
layer gets the same slots, so a plan costs ``sum_pool slots * slot_bytes * layers`` bytes.

Objective: the expected time per output token, ``sum_l E[makespan_l]``
(runtime.plan.model.LayerSet.expected) plus the plan's time outside the sparse layers
(runtime.plan.planner.Planner.tpot_s: it grows with the share of experts fetched).

Search:

1. single-pool plans (as many slots of one pool as fit) and the empty plan;
2. a grid over the budget's shares of the four pools, in steps of 1/8 (the 495 points with
   shares summing to at most 1), converted to whole slots;
3. refinement around the best point found: pattern search in slot space, moving ``d`` slots of
   one pool into as many slots of another (or into unused bytes) as the freed bytes buy, with
   ``d`` halving from ``experts/8`` down to 1 until no move improves; and a greedy fill of any
   bytes left over.

Every evaluated plan is memoised; the best one is never worse than the best single-pool plan,
because those are candidates too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from zipmoe.runtime.plan.model import compositions
from zipmoe.runtime.engine.states import POOLS

__all__ = ["POOLS", "SearchResult", "search", "single_pool_plans"]


@dataclass
class SearchResult:
    best: dict[str, int]
    best_value: float
    singles: dict[str, tuple[dict[str, int], float]]  # pool -> (slots, value); "none" = empty plan
    evaluated: int
    history: list = field(default_factory=list)  # every evaluated plan, best first: (slots, value)


def _fit(slots: dict[str, int], experts: int) -> dict[str, int]:
    """At most ``experts`` slots in all: trim the colder pools first."""
    out, left = {}, experts
    for p in POOLS:
        m = max(0, min(int(slots.get(p, 0)), left))
        out[p] = m
        left -= m
    return out


def single_pool_plans(per_layer: int, slot_bytes: dict[str, int], experts: int) -> dict[str, dict[str, int]]:
    plans = {"none": {p: 0 for p in POOLS}}
    for p in POOLS:
        plans[p] = _fit({p: per_layer // max(1, slot_bytes[p])}, experts)
    return plans


def search(evaluate: Callable[[dict[str, int]], float], *, per_layer_bytes: int, slot_bytes: dict[str, int],
           experts: int, grid: int = 8) -> SearchResult:
    """Minimise ``evaluate(slots)`` over plans costing at most ``per_layer_bytes`` per layer."""
    memo: dict[tuple, float] = {}

    def cost(s: dict[str, int]) -> int:
        return sum(s[p] * slot_bytes[p] for p in POOLS)

    def ok(s: dict[str, int]) -> bool:
        return all(s[p] >= 0 for p in POOLS) and sum(s.values()) <= experts and cost(s) <= per_layer_bytes

    def value(s: dict[str, int]) -> float:
        key = tuple(s[p] for p in POOLS)
        if key not in memo:
            memo[key] = float(evaluate(dict(s)))
        return memo[key]

    def fill(s: dict[str, int]) -> dict[str, int]:
        """Spend leftover bytes: add slots best pool first while they fit."""
        s = dict(s)
        for p in POOLS:
            room = (per_layer_bytes - cost(s)) // max(1, slot_bytes[p])
            s[p] += max(0, min(room, experts - sum(s.values())))
        return s

    singles_slots = single_pool_plans(per_layer_bytes, slot_bytes, experts)
    singles = {name: (s, value(s)) for name, s in singles_slots.items()}
    best = min((s for s, _ in singles.values()), key=value)

    # 2. grid over budget shares
    for shares in compositions(grid, len(POOLS) + 1):
        s = _fit({p: int(shares[j] * per_layer_bytes // (grid * max(1, slot_bytes[p]))) for j, p in enumerate(POOLS)}, experts)
        if ok(s) and value(s) < value(best):
            best = s
    # 3. refine: pattern search in slot space
    d = max(1, experts // grid)
    while True:
        improved = False
        candidates = [fill(best)]
        for src in POOLS:
            for dst in POOLS + ("unused",):
                if dst == src:
                    continue
                s = dict(best)
                s[src] -= d
                if s[src] < 0:
                    continue
                if dst != "unused":
                    room = (per_layer_bytes - cost(s)) // max(1, slot_bytes[dst])
                    s[dst] += max(0, min(room, experts - sum(s.values())))
                candidates.append(s)
            s = dict(best)
            s[src] += d
            candidates.append(s)
        for s in candidates:
            if ok(s) and value(s) < value(best) - 1e-15:
                best, improved = s, True
        if not improved:
            if d == 1:
                break
            d = max(1, d // 2)
    history = [(dict(zip(POOLS, k)), v) for k, v in sorted(memo.items(), key=lambda kv: kv[1])]
    return SearchResult(best=dict(best), best_value=value(best), singles=singles, evaluated=len(memo), history=history)
