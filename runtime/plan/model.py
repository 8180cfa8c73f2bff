"""The planner's probability model: how many of a token's top-k experts hit each cache pool.

Model. In one sparse layer the experts, sorted by popularity (rank ``r = 0`` hottest; see
runtime.plan.stats), are the cache *slots*. A token activates ``k`` distinct slots. We model
the token's choice as **conditional Poisson sampling** (CPS) of size ``k``: slot ``r`` is a
Bernoulli variable with probability ``q[r]`` (independent), conditioned on exactly ``k`` of them
being on. The ``q`` are solved for (a fixed point on the log-odds, Chen, Dempster & Liu 1994) so
that the CPS inclusion probability of every rank is its observed one (the update is on the log-odds,
``logit q += logit(target) - logit(pi)``, which converges also for ranks chosen by almost every token), ``pi[r] = k * p[r]``.

Pools. A plan gives each pool ``m_pool`` slots per sparse layer; slots are assigned by rank,
hottest first, in the order ``full -> compressed -> sm_only -> e_only``, the rest are ``none``
(misses). This is the order the runtime's cache converges to (runtime.engine.cache offers a used
tensor to the pools best-first and evicts the least frequently used).

Counts. With independent Bernoulli slots, the number of hits in one pool is Poisson-binomial;
its distribution is a dynamic programme over the pool's slots (``LayerSet._pmfs``). Conditioning on
``k`` hits in all, the count vector ``c = (c_full, c_compressed, c_sm_only, c_e_only, c_none)``
has the exact CPS probability ``prod_pool PB_pool(c_pool) / P(sum = k)``.

Expected makespan. ``E[T] = sum_c P(c) * simulate(layer_tasks(c))`` with
runtime.plan.simulate (the fetcher's own list schedule, memoised per count vector): no
closed-form approximation is involved.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from itertools import combinations

import numpy as np

from zipmoe.runtime.plan.simulate import Costs, makespan_for_counts
from zipmoe.runtime.engine.states import STATES

__all__ = ["POOL_ORDER", "solve_cps", "cps_inclusion", "compositions", "MakespanTable", "StepTable", "LayerSet"]

POOL_ORDER = STATES  # by rank, hottest first


def _pb_prefix(q: np.ndarray, k: int) -> np.ndarray:
    """f[i, j] = P(exactly j of the first i Bernoullis are on), j <= k."""
    n = len(q)
    f = np.zeros((n + 1, k + 1))
    f[0, 0] = 1.0
    for i in range(n):
        f[i + 1] = f[i] * (1 - q[i])
        f[i + 1, 1:] += f[i, :-1] * q[i]
    return f


def cps_inclusion(q: np.ndarray, k: int) -> np.ndarray:
    """Inclusion probability of every slot under CPS of size ``k`` with Poisson probabilities ``q``."""
    q = np.asarray(q, dtype=np.float64)
    n = len(q)
    f = _pb_prefix(q, k)
    g = _pb_prefix(q[::-1], k)[::-1]  # g[i, j] = P(j of slots i.. are on)
    z = f[n, k]
    pi = np.empty(n)
    for i in range(n):
        # P(k-1 of the others) = sum_j f[i, j] * g[i+1, k-1-j]
        pi[i] = q[i] * float(np.dot(f[i, :k], g[i + 1, k - 1::-1])) / z
    return pi


def _capped_targets(t: np.ndarray, k: int, cap: float = 1 - 1e-6) -> np.ndarray:
    """Inclusion targets summing to ``k``, none above ``cap``: excess goes to the others pro rata."""
    t = np.maximum(np.asarray(t, dtype=np.float64), 1e-12)
    for _ in range(len(t)):
        over = t > cap
        if not over.any():
            break
        free = ~over
        t[over] = cap
        rest = k - cap * over.sum()
        t[free] *= rest / t[free].sum()
    return np.clip(t, 1e-12, cap)


def solve_cps(p: Sequence[float], k: int, tol: float = 1e-8, max_iter: int = 500) -> np.ndarray:
    """Poisson probabilities ``q`` whose CPS of size ``k`` includes rank ``r`` with ``k * p[r]``.

    ``p`` are selection shares (sum 1). Targets are clipped to ``[1e-12, 1 - 1e-9]`` (a rank
    chosen by every token is made almost sure).
    """
    p = np.asarray(p, dtype=np.float64)
    n = len(p)
    if k < 1 or k > n:
        raise ValueError(f"top_k={k} must be between 1 and the number of experts ({n})")
    if k == n:
        return np.full(n, 1 - 1e-12)
    target = _capped_targets(k * p / p.sum(), k)
    logit = np.log(target) - np.log1p(-target)
    for _ in range(max_iter):
        q = 1 / (1 + np.exp(-logit))
        pi = cps_inclusion(q, k)
        err = np.max(np.abs(pi - target))
        if err < tol:
            break
        pi = np.clip(pi, 1e-300, 1 - 1e-16)
        logit += (np.log(target) - np.log1p(-target)) - (np.log(pi) - np.log1p(-pi))
    return 1 / (1 + np.exp(-logit))


@lru_cache(maxsize=64)
def compositions(k: int, parts: int = len(POOL_ORDER)) -> np.ndarray:
    """All vectors of ``parts`` non-negative ints summing to ``k`` (stars and bars), shape [n, parts]."""
    out = []
    for bars in combinations(range(k + parts - 1), parts - 1):
        prev, row = -1, []
        for b in bars:
            row.append(b - prev - 1)
            prev = b
        row.append(k + parts - 1 - prev - 1)
        out.append(row)
    return np.array(out, dtype=np.int64)


def _boundaries(slots: dict[str, int], n: int) -> list[tuple[int, int]]:
    a, out = 0, []
    for pool in POOL_ORDER[:-1]:
        m = max(0, int(slots.get(pool, 0)))
        b = min(n, a + m)
        out.append((a, b))
        a = b
    out.append((a, n))
    return out


class MakespanTable:
    """Simulated layer makespan for every count vector, for one tensor layout, L and costs."""

    def __init__(self, k: int, tensors: Sequence[tuple[int, int, int]], L: int, costs: Costs,
                 window: int | None = None) -> None:
        self.k, self.tensors, self.L, self.costs, self.window = k, tuple(map(tuple, tensors)), L, costs, window
        self.comps = compositions(k)
        self.values = np.array([
            makespan_for_counts(dict(zip(POOL_ORDER, map(int, c))), self.tensors, L, costs, window) for c in self.comps
        ])


#: how far the miss curve's last point (``k`` misses in one layer, the others full hits) may stray
#: from the all-miss state (``k`` misses in every layer) before the plan warns that its passes disagree
CURVE_AGREEMENT = 0.15


def curve_disagreement(step_costs: dict) -> str | None:
    """One warning line when a profile's two measures of a layer of ``k`` misses disagree by more
    than :data:`CURVE_AGREEMENT`: the miss curve's point at ``k`` against ``k`` times the all-miss
    state's cost per miss. They agreed within 10% in every GPU profile of docs/benchmarks.md but one
    (§27b, an H100, DeepSeek's shape: 36.3 ms against 50.8, and the plan built on the curve was
    2.2x short of its run; its passes had not held every expert, docs/planner.md "The passes'
    budget", and the clean profile of §27c agreed within 1.15x); None when they agree or either is
    missing."""
    curve = {int(j): float(v) for j, v in (step_costs.get("miss_curve_s") or {}).items()}
    miss = float((step_costs.get("per_expert_s") or {}).get("none") or 0.0)
    if not curve or miss <= 0:
        return None
    k = max(curve)
    state = k * miss
    ratio = curve[k] / state
    if abs(ratio - 1.0) <= CURVE_AGREEMENT:
        return None
    return (f"warning: the profile's passes disagree: {k} misses in one layer cost {1e3 * curve[k]:.1f} ms in the miss "
            f"curve's pass and {1e3 * state:.1f} ms in the all-miss state's ({ratio:.2f}x); the disk or the cores served "
            "them at other rates, and the predictions lean on the curve: measure the profile again "
            "(`zipmoe plan FILE --profile-only --remeasure`) before trusting them")


class StepTable:
    """What a sparse layer adds to the resident decode step, for every count vector, from the
    per-state costs measured by serving (runtime/plan/passes.py ``state_step_costs``).

    ``per_expert_s[state]``: the seconds one chosen expert in ``state`` adds to a step over the
    step with every expert a full hit (graphed where the runtime has graphs), measured with all
    ``k`` experts of every layer in that state. A layer whose ``k`` experts are all full hits
    adds nothing when ``graphs`` (it runs from its CUDA graph).

    Any other layer: with ``miss_curve_s`` (``{j: seconds}``, what a layer with ``j`` misses and
    ``k - j`` full hits adds, measured for j = 1..k), its fetches are counted in misses' worth,
    ``n = sum(count[s] * per_expert_s[s] / per_expert_s["none"])`` over the fetched states, and the
    layer adds the curve at ``n`` (linear between the measured points, from ``k *
    per_expert_s["full"]`` at 0): a lone fetch costs its latency, several share the disk and the
    workers (on the CPU box a lone miss added 1.96 ms to a layer, four 4.6-6.3 ms). Without the
    curve: ``sum(count[state] * per_expert_s[state])``, exact on the pure layers, linear in
    between (it charges a lone fetch only its share of a layer full of fetches).

    A compressed hit reads nothing from the disk (docs/planner.md, "Compressed hits beside
    misses", 7 Dec):
    - a layer whose fetches are all compressed hits adds at most the linear sum, which is exact
      on the pure compressed layer (the curve at its misses' worth charged a whole compressed
      layer the latency of a lone miss: 10.7 ms against the 7.4 ms measured on the H100, §22o);
    - with ``compressed_beside_misses_s`` (β, measured by serving layers of ``j`` misses and
      ``k - j`` compressed hits), a layer with disk-reading fetches adds the curve at those
      fetches' worth (misses, SM-only and E-only hits) plus β per compressed hit: the
      decompression of a compressed hit runs on workers the misses' reads leave idle. Without β
      (an older profile) such a layer is counted as before."""

    def __init__(self, k: int, per_expert_s: dict, graphs: bool, miss_curve_s: dict | None = None,
                 compressed_beside_misses_s: float | None = None) -> None:
        self.k, self.graphs = int(k), bool(graphs)
        self.per_expert_s = {s: float(per_expert_s[s]) for s in POOL_ORDER}
        beta = None if compressed_beside_misses_s is None else max(0.0, float(compressed_beside_misses_s))
        self.comps = compositions(self.k)
        a = np.array([self.per_expert_s[s] for s in POOL_ORDER])
        curve = {int(j): float(v) for j, v in (miss_curve_s or {}).items()}
        linear = self.comps @ a
        if curve and a[-1] > 0:
            xs = np.array([0.0] + sorted(curve))
            ys = np.array([self.k * a[0]] + [curve[j] for j in sorted(curve)])
            ys = np.maximum.accumulate(ys)  # more fetches never cost less
            slope = (ys[-1] - ys[-2]) / max(1e-12, xs[-1] - xs[-2]) if len(xs) > 1 else 0.0

            def at(n):
                return np.where(n <= xs[-1], np.interp(n, xs, ys), ys[-1] + (n - xs[-1]) * slope)

            w = a[1:] / a[-1]  # a fetched state's misses' worth
            n = (self.comps[:, 1:] * w).sum(axis=1)
            n_disk = (self.comps[:, 2:] * w[1:]).sum(axis=1)  # SM only, E only, miss: they read
            self.values = np.where(n > 0, at(n), linear)
            only_compressed = (n > 0) & (n_disk == 0)
            self.values = np.where(only_compressed, np.minimum(self.values, linear), self.values)
            if beta is not None:
                beside = at(n_disk) + self.comps[:, 1] * beta
                self.values = np.where(n_disk > 0, beside, self.values)
        else:
            self.values = linear
        if self.graphs:
            self.values[self.comps[:, 0] == self.k] = 0.0

    @classmethod
    def of(cls, k: int, step_costs: dict) -> "StepTable":
        """The table for a profile's ``step_costs`` (runtime/plan/passes.py ``state_step_costs``)."""
        sc = step_costs
        return cls(k, sc["per_expert_s"], bool(sc.get("graphs")), sc.get("miss_curve_s"),
                   sc.get("compressed_beside_misses_s"))


class LayerSet:
    """All sparse layers at once: ``Q[l]`` are layer ``l``'s CPS Poisson probabilities by rank.

    :meth:`distribution` is the CPS count distribution of every layer at once, vectorised (the
    planner's search evaluates many plans); tests/test_planner.py checks it against the one-layer
    form written out and against Monte Carlo draws.
    """

    def __init__(self, Q: np.ndarray, k: int, table: MakespanTable) -> None:
        self.Q = np.atleast_2d(np.asarray(Q, dtype=np.float64))
        self.k, self.table = k, table
        self.comps = compositions(k)

    def _pmfs(self, a: int, b: int) -> np.ndarray:
        nl, k = self.Q.shape[0], self.k
        f = np.zeros((nl, k + 1))
        f[:, 0] = 1.0
        for i in range(a, b):
            qi = self.Q[:, i:i + 1]
            g = f * (1 - qi)
            g[:, 1:] += f[:, :-1] * qi
            f = g
        return f

    def distribution(self, slots: dict[str, int]) -> np.ndarray:
        """P[l, i]: probability of count vector ``comps[i]`` in layer ``l``."""
        prob = np.ones((self.Q.shape[0], len(self.comps)))
        for j, (a, b) in enumerate(_boundaries(slots, self.Q.shape[1])):
            prob *= self._pmfs(a, b)[:, self.comps[:, j]]
        return prob / prob.sum(axis=1, keepdims=True)

    def expected(self, slots: dict[str, int]) -> np.ndarray:
        """Expected makespan of every layer (seconds), shape [layers]."""
        return self.distribution(slots) @ self.table.values

    def hits(self, slots: dict[str, int]) -> np.ndarray:
        """Expected chosen experts per state (POOL_ORDER), per layer: shape [layers, 5]."""
        return self.distribution(slots) @ self.comps

    def evaluate(self, slots: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
        """``(expected(slots), hits(slots))`` from one count distribution."""
        prob = self.distribution(slots)
        return prob @ self.table.values, prob @ self.comps
