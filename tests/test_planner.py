"""The planner's model and search: CPS inclusion, DP vs Monte Carlo, rank statistics, search."""

from __future__ import annotations

import json

import numpy as np
import pytest

from zipmoe.errors import ModelError
from zipmoe.runtime.plan.model import (
    POOL_ORDER,
    LayerSet,
    MakespanTable,
    _boundaries,
    _pb_prefix,
    compositions,
    cps_inclusion,
    solve_cps,
)
from zipmoe.runtime.plan.search import POOLS, search
from zipmoe.runtime.plan.stats import from_traces, rank_distribution, uniform
from zipmoe.runtime.plan.simulate import Costs

COSTS = Costs(disk_bw=2e9, disk_latency=80e-6, decomp_bw_per_worker=1.5e9, merge_bw=4e9, compute_s_per_expert=150e-6)
NUMEL = 1 << 20
TENSORS = [(2 * 2 * NUMEL, 2 * NUMEL * 17 // 100, 2 * NUMEL), (2 * NUMEL, NUMEL * 17 // 100, NUMEL)]  # gate_up, down


# The one-layer form of the model, written out: what LayerSet vectorises (and Monte Carlo draws).
def pool_pmf(q: np.ndarray, k: int) -> np.ndarray:
    """Poisson-binomial pmf of the number of ``q`` slots that are on, truncated at ``k``."""
    return _pb_prefix(np.asarray(q, dtype=np.float64), k)[-1]


def count_distribution(q: np.ndarray, k: int, slots: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
    """``(C, P)``: every count vector ``C[i]`` (per POOL_ORDER, summing to ``k``) and its probability."""
    q = np.asarray(q, dtype=np.float64)
    comps = compositions(k)
    prob = np.ones(len(comps))
    for j, (a, b) in enumerate(_boundaries(slots, len(q))):
        pmf = pool_pmf(q[a:b], k)
        prob *= pmf[comps[:, j]]
    z = prob.sum()
    return comps, prob / z


def expected_makespan(q: np.ndarray, k: int, slots: dict[str, int], table: MakespanTable) -> float:
    """E[layer makespan] under CPS for a plan's slots (per POOL_ORDER)."""
    _, prob = count_distribution(q, k, slots)
    return float(prob @ table.values)


def expected_hits(q: np.ndarray, k: int, slots: dict[str, int]) -> dict[str, float]:
    """Expected chosen experts per state, per token (sums to ``k``)."""
    comps, prob = count_distribution(q, k, slots)
    return {pool: float(prob @ comps[:, j]) for j, pool in enumerate(POOL_ORDER)}


def sample_counts(q: np.ndarray, k: int, slots: dict[str, int], n: int, rng: np.random.Generator) -> np.ndarray:
    """Monte Carlo: ``n`` CPS draws (rejection: Poisson samples of size != k are redrawn), count vectors."""
    q = np.asarray(q, dtype=np.float64)
    bounds = _boundaries(slots, len(q))
    out = np.zeros((0, len(POOL_ORDER)), dtype=np.int64)
    while len(out) < n:
        on = rng.random((max(1024, 4 * (n - len(out))), len(q))) < q
        on = on[on.sum(axis=1) == k]
        counts = np.stack([on[:, a:b].sum(axis=1) for a, b in bounds], axis=1)
        out = np.concatenate([out, counts])
    return out[:n]


def _rank_p(rng, n, skew):
    p = rng.dirichlet(np.full(n, skew))
    return np.sort(p)[::-1]


def _feasible(p, k, most=0.95):
    """Mix with the uniform distribution until no rank exceeds ``most / k`` (tokens pick distinct experts)."""
    n = len(p)
    if p[0] * k > most:
        lam = (p[0] - most / k) / (p[0] - 1 / n)
        p = (1 - lam) * p + lam / n
    return p / p.sum()


@pytest.mark.parametrize("n,k", [(8, 1), (8, 2), (16, 4), (60, 4), (64, 8)])
def test_cps_weights_reproduce_the_inclusion_targets(n, k):
    rng = np.random.default_rng(n * 10 + k)
    p = _feasible(_rank_p(rng, n, 0.5), k)
    q = solve_cps(p, k)
    assert np.allclose(cps_inclusion(q, k), k * p, atol=1e-7)
    # a rank chosen by (almost) every token: the target is capped, the rest share the excess
    hot = np.array([0.6, 0.3, 0.05, 0.05])
    assert np.allclose(cps_inclusion(solve_cps(hot, 2), 2), [1, 0.75, 0.125, 0.125], atol=1e-5)


def test_pool_pmf_is_poisson_binomial():
    q = np.array([0.1, 0.5, 0.9])
    pmf = pool_pmf(q, 3)
    brute = np.zeros(4)
    for bits in range(8):
        on = [(bits >> i) & 1 for i in range(3)]
        brute[sum(on)] += np.prod([q[i] if on[i] else 1 - q[i] for i in range(3)])
    assert np.allclose(pmf, brute)


@pytest.mark.parametrize("seed", range(6))
def test_dp_count_distribution_agrees_with_monte_carlo(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(4, 33))
    k = int(rng.integers(1, min(n, 6) + 1))
    p = _feasible(_rank_p(rng, n, float(rng.choice([0.3, 1.0, 5.0]))), k)
    q = solve_cps(p, k)
    cuts = np.sort(rng.integers(0, n + 1, 4))
    slots = dict(zip(POOLS, np.diff(np.concatenate([[0], cuts])).tolist()))
    comps, prob = count_distribution(q, k, slots)
    assert prob.sum() == pytest.approx(1.0)
    draws = sample_counts(q, k, slots, 20000, rng)
    emp = np.array([np.mean(np.all(draws == c, axis=1)) for c in comps])
    # 20 000 draws: the standard error of a probability is at most 0.0036
    assert np.max(np.abs(emp - prob)) < 0.02
    assert np.allclose(draws.mean(axis=0), prob @ comps, atol=0.05)
    # vectorised LayerSet gives the same distribution as the single-layer function
    table = MakespanTable(k, TENSORS, 2, COSTS)
    ls = LayerSet(np.stack([q, q]), k, table)
    assert np.allclose(ls.distribution(slots)[1], prob)
    assert ls.expected(slots)[0] == pytest.approx(expected_makespan(q, k, slots, table))
    assert np.allclose(ls.hits(slots)[0], list(expected_hits(q, k, slots).values()))


def test_rank_statistics_sort_counts_and_smooth():
    p = rank_distribution(np.array([0, 10, 3, 0]), alpha=0.5)
    assert np.all(np.diff(p) <= 0) and p.sum() == pytest.approx(1.0)
    assert p[0] == pytest.approx(10.5 / 15) and p[-1] > 0
    # Good-Turing (the default): the experts seen once give the unseen ones their mass (2 of 40
    # selections here, shared by the four never seen), the seen keep their shares scaled
    g = rank_distribution(np.array([0, 0, 0, 0, 25, 10, 1, 1, 3]))
    assert g.sum() == pytest.approx(1.0) and np.all(np.diff(g) <= 0)
    assert g[0] == pytest.approx(25 / 40 * (1 - 2 / 40)) and g[-1] == pytest.approx(2 / 40 / 4)
    # ... but at most half a selection each (6 singletons of 20 would give 0.3 to two experts)
    h = rank_distribution(np.array([0, 12, 2, 0, 1, 1, 1, 1, 1, 1]))
    assert h[-1] == pytest.approx(0.5 / 20) and h[-1] < h[-3]
    # every expert seen: nothing moves, the hottest ranks are not flattened
    assert np.allclose(rank_distribution(np.array([1, 6, 3])), [0.6, 0.3, 0.1])
    u = uniform(8, 2, [0, 1])
    assert u.source == "uniform prior" and np.allclose(u.rank_p[1], 1 / 8)


def _write_trace(path, cid, layers, num_experts, top_k, tokens, skew, seed=0, **header):
    rng = np.random.default_rng(seed)
    w = 1.0 / np.arange(1, num_experts + 1) ** skew
    perms = {l: rng.permutation(num_experts) for l in layers}  # hot ids differ per layer
    with open(path, "w") as f:
        f.write(json.dumps({"container_id": cid, "num_layers": max(layers) + 1, "num_experts": num_experts,
                            "top_k": top_k, "layers": layers, **header}) + "\n")
        for _ in range(tokens):
            step = {}
            for l in layers:
                ranks = rng.choice(num_experts, size=top_k, replace=False, p=w / w.sum())
                step[str(l)] = [[int(perms[l][r]) for r in ranks]]
            f.write(json.dumps({"layers": step}) + "\n")
    return path


def test_from_traces_ranks_by_popularity_not_id(tmp_path):
    t = _write_trace(tmp_path / "t.jsonl", "abc", [0, 1], 8, 2, 400, skew=1.5)
    st = from_traces([t], container_id="abc", num_experts=8, top_k=2, layers=[0, 1])
    assert st.source == "trace" and st.tokens == 400
    for l in (0, 1):
        assert np.all(np.diff(st.rank_p[l]) <= 0) and st.rank_p[l][0] > 0.25
    with pytest.raises(ModelError, match="another model"):
        from_traces([t], container_id="xyz", num_experts=8, top_k=2, layers=[0, 1])
    with pytest.raises(ModelError, match="experts"):
        from_traces([t], container_id="abc", num_experts=16, top_k=2, layers=[0, 1])


def test_from_traces_counts_decode_steps_when_the_trace_marks_them(tmp_path):
    """A prompt spreads over every expert, decoding keeps to two: the plan is for output tokens,
    so a trace that marks its steps' input shapes is counted from its decode steps alone."""
    E, k = 8, 2

    def write(path, mark: bool, decode_steps: int):
        with open(path, "w") as f:
            f.write(json.dumps({"container_id": "abc", "num_layers": 1, "num_experts": E, "top_k": k, "layers": [0]}) + "\n")
            for _ in range(4):  # four prompts of 40 tokens over all experts, then decode on experts 5 and 6
                prefill = {"layers": {"0": [[i % E, (i + 1) % E] for i in range(40)]}}
                if mark:
                    prefill["input"] = [1, 40]
                f.write(json.dumps(prefill) + "\n")
                for _ in range(decode_steps):
                    step = {"layers": {"0": [[5, 6]]}}
                    if mark:
                        step["input"] = [1, 1]
                    f.write(json.dumps(step) + "\n")
        return path

    st = from_traces([write(tmp_path / "m.jsonl", True, 8)], container_id="abc", num_experts=E, top_k=k, layers=[0])
    assert st.basis == "decode steps" and st.decode_steps == 32 and st.summary()["decode_steps"] == 32
    assert st.rank_p[0][:2].sum() > 0.95  # the two decode experts take (nearly) every selection
    old = from_traces([write(tmp_path / "o.jsonl", False, 8)], container_id="abc", num_experts=E, top_k=k, layers=[0])
    assert old.basis == "all tokens" and old.decode_steps == 0
    assert old.rank_p[0][:2].sum() < 0.5  # the prompts' 320 selections spread over all 8
    few = from_traces([write(tmp_path / "f.jsonl", True, 2)], container_id="abc", num_experts=E, top_k=k, layers=[0])
    assert few.basis == "all tokens" and few.decode_steps == 8  # below MIN_DECODE_STEPS


def test_search_beats_every_single_pool_plan_on_a_skewed_trace(tmp_path):
    E, k, layers = 16, 2, [0, 1, 2, 3]
    t = _write_trace(tmp_path / "t.jsonl", "abc", layers, E, k, 2000, skew=1.2)
    st = from_traces([t], container_id="abc", num_experts=E, top_k=k, layers=layers)
    table = MakespanTable(k, TENSORS, 2, COSTS)
    ls = LayerSet(np.stack([solve_cps(st.rank_p[l], k) for l in layers]), k, table)
    slot_bytes = {"full": sum(t[0] for t in TENSORS), "compressed": sum(t[1] + t[2] for t in TENSORS),
                  "sm_only": sum(t[2] for t in TENSORS), "e_only": sum(t[1] for t in TENSORS)}
    strict = 0
    for frac in (0.25, 0.4, 0.6):
        per_layer = int(frac * E * slot_bytes["full"])
        res = search(lambda s: float(ls.expected(s).sum()), per_layer_bytes=per_layer, slot_bytes=slot_bytes, experts=E)
        singles = [v for name, (_, v) in res.singles.items()]
        assert res.best_value <= min(singles) + 1e-15
        assert sum(res.best[p] * slot_bytes[p] for p in POOLS) <= per_layer
        strict += res.best_value < min(singles) * 0.99
    assert strict >= 2  # a mixed plan is clearly better at most budgets


def test_serving_overheads_recover_what_the_runtime_adds():
    """The profile's all-miss pass: reads that took longer than latency + bytes/bw move the
    latency, and layer time beyond the schedule model becomes a per-tensor overhead."""
    from dataclasses import replace

    from zipmoe.runtime.plan.fits import serving_overheads
    from zipmoe.runtime.plan.simulate import makespan_for_counts

    base = Costs(disk_bw=1e9, disk_latency=1e-4, decomp_bw_per_worker=1e9, merge_bw=1e11, compute_s_per_expert=2e-4)
    tensors = [(4 << 20, 700 << 10, 2 << 20, 2), (2 << 20, 350 << 10, 1 << 20, 1)]
    true = replace(base, disk_latency=6e-4, merge_overhead_s=3e-4)  # what serving really costs
    k, steps, layers = 4, 6, 10
    n = k * len(tensors) * steps * layers
    nbytes = n // len(tensors) * sum(t[1] + t[2] for t in tensors)
    serving = {"reads": n, "read_bytes": nbytes, "read_s": n * 6e-4 + nbytes / 1e9,
               "experts_per_layer": k, "layer_makespan_s": makespan_for_counts({"none": k}, tensors, 4, true, 6)}
    got = serving_overheads(base, tensors, serving, 4, 6)
    assert got["disk_latency"] == pytest.approx(6e-4)
    assert got["merge_overhead_s"] == pytest.approx(3e-4, rel=0.05)
    # reads as fast as measured alone and layers as the model says: nothing added
    calm = {**serving, "read_s": n * 1e-4 + nbytes / 1e9, "layer_makespan_s": makespan_for_counts({"none": k}, tensors, 4, base, 6)}
    assert serving_overheads(base, tensors, calm, 4, 6) == {"disk_latency": pytest.approx(1e-4), "merge_overhead_s": 0.0}


def test_serving_overheads_split_by_the_compressed_pass():
    """With the compressed pass, the per-tensor overhead comes from compressed hits (nothing
    read) and the all-miss pass's remainder slows the reads: both passes' layers are then
    reproduced, and a compressed hit is not charged what the reads cost."""
    from dataclasses import replace

    from zipmoe.runtime.plan.fits import serving_overheads
    from zipmoe.runtime.plan.simulate import makespan_for_counts

    base = Costs(disk_bw=1e9, disk_latency=1e-4, decomp_bw_per_worker=1e9, merge_bw=1e11, compute_s_per_expert=2e-4)
    tensors = [(4 << 20, 700 << 10, 2 << 20, 2), (2 << 20, 350 << 10, 1 << 20, 1)]
    true = replace(base, disk_bw=0.4e9, merge_overhead_s=3e-4)  # what serving really costs
    k = 4
    serving = {"reads": 1, "read_bytes": 1, "read_s": 1.0, "experts_per_layer": k,
               "layer_makespan_s": makespan_for_counts({"none": k}, tensors, 4, true, 6)}
    comp = {"experts_per_layer": k, "compressed_share": 1.0,
            "layer_makespan_s": makespan_for_counts({"compressed": k}, tensors, 4, true, 6)}
    got = serving_overheads(base, tensors, serving, 4, 6, compressed=comp)
    assert got["merge_overhead_s"] == pytest.approx(3e-4, rel=0.02)
    assert got["disk_bw"] == pytest.approx(0.4e9, rel=0.02)
    assert got["disk_latency"] == base.disk_latency
    fitted = replace(base, **got)
    for counts in ({"none": k}, {"compressed": k}, {"e_only": 2, "compressed": 2}):
        assert makespan_for_counts(counts, tensors, 4, fitted, 6) == pytest.approx(
            makespan_for_counts(counts, tensors, 4, true, 6), rel=0.02)
    # the all-miss rule charges the compressed hits the reads' share: far more than they cost
    old = replace(base, **serving_overheads(base, tensors, {**serving, "read_s": 0.0}, 4, 6))
    assert makespan_for_counts({"compressed": k}, tensors, 4, old, 6) > 1.5 * comp["layer_makespan_s"]
    # a compressed pass whose experts did not stay compressed is not used
    assert "disk_bw" not in serving_overheads(base, tensors, serving, 4, 6, compressed={**comp, "compressed_share": 0.5})


def _two_layer_inputs():
    """A two-layer container layout (8 experts, top-2) and skewed activation statistics."""
    from zipmoe.runtime.plan.layout import ContainerLayout
    from zipmoe.runtime.plan.stats import ActivationStats

    E, k, layers = 8, 2, [0, 1]
    units = [("gate_up", (64, 32), 4096, 700, 2048), ("down", (32, 32), 2048, 350, 1024)]
    layout = ContainerLayout(path="m.zmoe", container_id="abc", file_size=0, num_layers=2, num_experts=E, top_k=k,
                             sparse_layers=layers, dense_bytes=1 << 20, dense_matmul_bytes=1 << 20, units=units,
                             expert_full_bytes=6144, expert_working=20000, max_segment=2048, total_expert_full=2 * E * 6144)
    p = rank_distribution(np.array([40, 20, 10, 5, 3, 2, 1, 1]))
    return E, k, layers, layout, ActivationStats("abc", E, k, layers, {0: p, 1: p}, "trace")


def test_dense_time_of_a_plan_grows_with_the_experts_it_fetches():
    """On few cores the decode workers slow the dense part: the planner takes a plan's dense time
    between the profile's resident and fetching figures, by the share of experts it fetches, and
    the search's objective includes it."""
    from zipmoe.runtime.plan.planner import Planner

    E, k, layers, layout, stats = _two_layer_inputs()
    costs = {"disk_bw": 1e9, "disk_latency": 1e-4, "decomp_bw_per_worker": 1e9, "merge_bw": 1e10,
             "compute_s_per_expert": 1e-4, "dense_s_per_token": 0.010, "dense_s_per_token_fetching": 0.030}
    pl = Planner(layout, stats, {"costs": costs}, 1)
    everything = pl.describe({"full": E, "compressed": 0, "sm_only": 0, "e_only": 0})
    nothing = pl.describe({"full": 0, "compressed": 0, "sm_only": 0, "e_only": 0})
    half = pl.describe({"full": 2, "compressed": 0, "sm_only": 0, "e_only": 0})
    assert everything["expected_dense_s_per_token"] == pytest.approx(0.010)
    assert nothing["expected_dense_s_per_token"] == pytest.approx(0.030)
    share = 1 - half["expected_hits"]["full"] / k
    assert half["expected_dense_s_per_token"] == pytest.approx(0.010 + 0.020 * share)
    assert pl.tpot_s({"full": 2}) == pytest.approx(half["expected_tpot_s"])
    # without the fetching figure (older profiles) the dense time is the resident one for every plan
    old = Planner(layout, stats, {"costs": {k2: v for k2, v in costs.items() if k2 != "dense_s_per_token_fetching"}}, 1)
    assert old.describe({"full": 0})["expected_dense_s_per_token"] == pytest.approx(0.010)


def test_prefetch_credit_is_bounded_by_the_time_between_layers():
    """With the calibration's recall the planner hides that share of a layer's fetch time, never
    more than the dense time between two sparse layers, never the computes; none without a recall."""
    from zipmoe.runtime.plan.planner import Planner

    E, k, layers, layout, stats = _two_layer_inputs()
    costs = {"disk_bw": 1e7, "disk_latency": 1e-4, "decomp_bw_per_worker": 1e9, "merge_bw": 1e10,
             "compute_s_per_expert": 1e-4, "dense_s_per_token": 0.010}
    nothing = {"full": 0, "compressed": 0, "sm_only": 0, "e_only": 0}
    everything = {"full": E, "compressed": 0, "sm_only": 0, "e_only": 0}
    off = Planner(layout, stats, {"costs": costs}, 1)
    assert off.describe(nothing)["expected_prefetch_credit_s_per_token"] == 0.0
    on = Planner(layout, stats, {"costs": costs}, 1, prefetch_recall=0.8)
    d_off, d_on = off.describe(nothing), on.describe(nothing)
    credit = d_on["expected_prefetch_credit_s_per_token"]
    assert 0 < credit <= 0.010 + 1e-12  # at most the dense time, spread over the layers
    assert d_on["expected_tpot_s"] == pytest.approx(d_off["expected_tpot_s"] - credit)
    fetch = d_off["expected_sparse_s_per_token"] - len(layers) * k * 1e-4
    assert credit == pytest.approx(min(0.8 * fetch, 0.010))
    # every expert resident: nothing to fetch, nothing to hide
    assert on.describe(everything)["expected_prefetch_credit_s_per_token"] == pytest.approx(0.0, abs=1e-12)


def test_calibration_side_file_gives_the_recall(tmp_path):
    from zipmoe.runtime.plan.calibrate import prediction_path, read_recall

    a, b, c = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    prediction_path(a).write_text(json.dumps({"prefetch": True, "precision": 0.9, "recall": 0.8}))
    prediction_path(b).write_text(json.dumps({"prefetch": False, "precision": None, "recall": None}))
    assert read_recall([a, b, c]) == pytest.approx(0.8)
    assert read_recall([b, c]) is None
