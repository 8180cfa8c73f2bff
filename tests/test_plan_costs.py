"""The planner's measured-state cost model, its choice against full tensors only, and the
default plan chat/serve/bench fit at load (runtime/plan/{model,planner,passes,default}.py)."""

from __future__ import annotations

from zipmoe.runtime.plan.planner import margin_for

import json

import numpy as np
import pytest

from zipmoe.runtime.plan.model import POOL_ORDER, StepTable, compositions


def _layout_and_stats(skew: float = 0.0, E: int = 16, k: int = 2):
    from zipmoe.runtime.plan.layout import ContainerLayout
    from zipmoe.runtime.plan.stats import ActivationStats, rank_distribution

    layers = [0, 1, 2, 3]
    units = [("gate_up", (64, 32), 4096, 700, 2048), ("down", (32, 32), 2048, 350, 1024)]
    layout = ContainerLayout(path="m.zmoe", container_id="abc", file_size=0, num_layers=4, num_experts=E, top_k=k,
                             sparse_layers=layers, dense_bytes=1 << 20, dense_matmul_bytes=1 << 20, units=units,
                             expert_full_bytes=6144, expert_working=20000, max_segment=2048,
                             total_expert_full=len(layers) * E * 6144)
    p = rank_distribution(np.array([(r + 1.0) ** -skew for r in range(E)]) * 1000)
    return layout, ActivationStats("abc", E, k, layers, {l: p for l in layers}, "trace")


def _profile(per_expert: dict, graphs: bool = True, resident: float = 0.010) -> dict:
    costs = {"disk_bw": 1e9, "disk_latency": 1e-4, "decomp_bw_per_worker": 1e9, "merge_bw": 1e10,
             "compute_s_per_expert": 1e-4}
    return {"costs": costs, "step_costs": {"resident_step_s": resident, "graphs": graphs, "per_expert_s": per_expert}}


def test_step_table_is_exact_on_pure_layers_linear_in_between_and_free_when_graphed():
    a = {"full": 0.001, "compressed": 0.002, "sm_only": 0.003, "e_only": 0.004, "none": 0.006}
    k = 3
    t = StepTable(k, a, graphs=True)
    for i, c in enumerate(compositions(k)):
        want = 0.0 if c[0] == k else sum(n * a[s] for n, s in zip(c, POOL_ORDER))
        assert t.values[i] == pytest.approx(want)
    host = StepTable(k, a, graphs=False)  # no graphs (the CPU): an all-full layer costs its host path
    assert host.values[[i for i, c in enumerate(compositions(k)) if c[0] == k][0]] == pytest.approx(3 * 0.001)


def test_a_miss_curve_that_strays_from_the_all_miss_state_is_a_warning():
    """The H100's DeepSeek profile of §27b: six misses in one layer 36.3 ms in the curve's pass
    against 6 x 8.467 ms in the all-miss state (0.71x), and the plan built on it was 2.2x short;
    the H200's qwen profile (33.3 against 4 x 8.47 ms) agrees."""
    from zipmoe.runtime.plan.model import curve_disagreement

    ds = {"per_expert_s": {"full": 0.0003, "compressed": 0.00658, "sm_only": 0.00575, "e_only": 0.0061, "none": 0.008467},
          "miss_curve_s": {"1": 0.00149, "2": 0.00944, "3": 0.01808, "4": 0.02624, "5": 0.03006, "6": 0.03629}}
    line = curve_disagreement(ds)
    assert line.startswith("warning: the profile's passes disagree: 6 misses in one layer cost 36.3 ms in the miss curve's "
                           "pass and 50.8 ms in the all-miss state's (0.71x)") and "--remeasure" in line, line
    qwen = {"per_expert_s": {"none": 0.00847}, "miss_curve_s": {"1": 0.009, "2": 0.017, "3": 0.025, "4": 0.0333}}
    assert curve_disagreement(qwen) is None
    assert curve_disagreement({"per_expert_s": {"none": 0.008}}) is None  # no curve: nothing to compare


def test_plan_warns_when_the_profiles_resident_pass_was_not_resident():
    """The same H100 profile's resident pass: 1210 full hits, 118 compressed, 16 misses (its
    passes' budget from the layout's estimate, short on CUDA: docs/planner.md, "The passes'
    budget"); a clean one says nothing."""
    from zipmoe.runtime.plan.planner import resident_warning

    ds = {"runtime": {"states": {"resident": {"state_share": 0.9003, "hits": {"full": 1210, "compressed": 118, "sm_only": 0,
                                                                               "e_only": 0, "none": 16}}}}}
    line = resident_warning(ds)
    assert line.startswith("warning: the profile's resident pass served 90.0% of its expert uses as full hits "
                           "(full 1210, compressed 118, none 16)"), line
    assert resident_warning({"runtime": {"states": {"resident": {"state_share": 1.0, "hits": {"full": 3072}}}}}) is None
    assert resident_warning({}) is None  # an older profile that does not say


def test_step_table_with_a_miss_curve_charges_a_lone_fetch_its_latency():
    """Measured on the CPU box: a lone miss adds more to a layer than a quarter of four misses."""
    a = {"full": 0.0, "compressed": 0.0005, "sm_only": 0.0008, "e_only": 0.0009, "none": 0.001}
    curve = {1: 0.002, 2: 0.0035, 3: 0.0037, 4: 0.004}
    t = StepTable(4, a, graphs=False, miss_curve_s=curve)
    comps = [tuple(c) for c in compositions(4)]
    val = dict(zip(comps, t.values))
    assert val[(3, 0, 0, 0, 1)] == pytest.approx(0.002)  # one miss: the curve's first point
    assert val[(0, 0, 0, 0, 4)] == pytest.approx(0.004)
    assert val[(2, 0, 0, 0, 2)] == pytest.approx(0.0035)
    # two compressed hits are one miss's worth of fetching, but they read nothing: a layer of
    # compressed hits alone adds at most their linear sum (exact on the pure compressed layer)
    assert val[(2, 2, 0, 0, 0)] == pytest.approx(2 * 0.0005)
    assert val[(0, 4, 0, 0, 0)] == pytest.approx(4 * 0.0005)
    # beside a miss without a measured β: counted in misses' worth, as before
    assert val[(1, 2, 0, 0, 1)] == pytest.approx(0.0035)
    assert val[(4, 0, 0, 0, 0)] == 0.0
    # more fetching never costs less, even where a measured point dips
    dip = StepTable(4, a, graphs=False, miss_curve_s={1: 0.002, 2: 0.0015, 3: 0.003, 4: 0.004})
    v = dict(zip(comps, dip.values))
    assert v[(2, 0, 0, 0, 2)] >= v[(3, 0, 0, 0, 1)]


def test_step_table_charges_a_compressed_hit_beside_misses_its_measured_beta():
    """With β (what a compressed hit adds beside misses, measured), a layer with disk-reading
    fetches adds the curve at those fetches' worth plus β per compressed hit; layers without
    compressed hits, and layers with no disk-reading fetch, are what they were."""
    a = {"full": 0.0, "compressed": 0.0005, "sm_only": 0.0008, "e_only": 0.0009, "none": 0.001}
    curve = {1: 0.002, 2: 0.0035, 3: 0.0037, 4: 0.004}
    beta = 0.0001
    without = dict(zip(map(tuple, compositions(4)), StepTable(4, a, graphs=True, miss_curve_s=curve).values))
    t = StepTable.of(4, {"per_expert_s": a, "graphs": True, "miss_curve_s": curve, "compressed_beside_misses_s": beta})
    val = dict(zip(map(tuple, compositions(4)), t.values))
    assert val[(0, 2, 0, 0, 2)] == pytest.approx(0.0035 + 2 * beta)
    assert val[(0, 3, 0, 0, 1)] == pytest.approx(0.002 + 3 * beta)
    # an SM-only hit reads its E bytes: it counts toward the disk, at its misses' worth
    assert val[(0, 1, 3, 0, 0)] == pytest.approx(np.interp(3 * 0.8, [0, 1, 2, 3, 4], [0, 0.002, 0.0035, 0.0037, 0.004]) + beta)
    for c, v in val.items():
        if c[1] == 0 or sum(c[2:]) == 0:
            assert v == pytest.approx(without[c]), c
    assert val[(4, 0, 0, 0, 0)] == 0.0  # graphed


def test_state_step_costs_measures_beta_from_the_mixed_pass_less_its_admissions():
    from zipmoe.runtime.plan.passes import state_step_costs

    L, k = 4, 4
    base = 0.010
    passes = {"resident": {"step_s": base}, "graphs": True,
              "none": {"step_s": base + L * k * 0.006, "state_share": 1.0},
              "misses_2": {"step_s": base + L * 0.016, "misses_per_layer": 2, "steps": 8, "admit_s": 8 * L * 0.0002},
              # two misses and two compressed hits per layer: 1 ms per layer more, of which the misses'
              # admission into the compressed pool took 0.4 ms more than into the full pool
              "compressed_beside_misses": {"step_s": base + L * 0.017, "misses_per_layer": 2, "steps": 8,
                                    "admit_s": 8 * L * 0.0006}}
    for s in ("compressed", "sm_only", "e_only"):
        passes[s] = {"step_s": base + L * k * 0.002, "state_share": 1.0}
    sc = state_step_costs(passes, k, L)
    assert sc["compressed_beside_misses_at"] == 2
    assert sc["compressed_beside_misses_admit_s"] == pytest.approx(0.0004)
    assert sc["compressed_beside_misses_s"] == pytest.approx((0.001 - 0.0004) / 2)
    # no mixed pass (an older profile): no β, the table counts as before
    del passes["compressed_beside_misses"]
    assert "compressed_beside_misses_s" not in state_step_costs(passes, k, L)


def test_planner_chooses_full_only_when_the_measured_states_say_so_and_prints_why():
    """With compressed hits nearly as dear as misses (what the H200 measured with the mixed
    pools), no mixed plan pays: the planner predicts it and keeps full tensors only."""
    from zipmoe.runtime.plan.planner import make_plan

    layout, stats = _layout_and_stats(skew=0.2)
    prof = _profile({"full": 0.0002, "compressed": 0.0045, "sm_only": 0.0050, "e_only": 0.0052, "none": 0.0055})
    budget = layout.min_budget(1) + layout.total_expert_full // 3
    plan = make_plan(layout, budget, stats, prof, workers=1)
    assert plan["profile"]["cost_model"] == "measured states"
    assert plan["slots"]["per_layer"]["compressed"] == plan["slots"]["per_layer"]["sm_only"] == 0
    assert plan["slots"]["per_layer"]["e_only"] == 0 and plan["slots"]["per_layer"]["full"] > 0
    text = "\n".join(plan["explain"])
    assert "full tensors only is the best plan found" in text and "compressed" in text
    # the prediction: the resident step plus what the layers add
    assert plan["expected_tpot_s"] > 0.010
    assert "fitted to a served run" not in text
    # a profile whose misses were fitted to a served run says so, with the arithmetic
    prof["step_costs"]["served_fit"] = {"scale": 1.6, "measured_step_s": 0.050, "model_step_s": 0.035,
                                        "passes_miss_s": 0.0034, "steps": 64, "capacity": 300 << 20}
    text = "\n".join(make_plan(layout, budget, stats, prof, workers=1)["explain"])
    assert "a miss fitted to a served run at capacity (64 steps, 300 MiB of full tensors)" in text
    assert "50.0 ms per step measured against 35.0 ms charged with the passes' 3.400 ms per miss, so misses cost 1.60x" in text
    # the first touch netted out of the measured step is named where it counts (0.1 ms or more)
    prof["step_costs"]["served_fit"]["first_touch_s"] = 0.0032
    text = "\n".join(make_plan(layout, budget, stats, prof, workers=1)["explain"])
    assert ("50.0 ms per step measured (3.2 of them first touches of fresh memory, not the misses') against 35.0 ms"
            in text)
    prof["step_costs"]["served_fit"]["first_touch_s"] = 2e-6
    text = "\n".join(make_plan(layout, budget, stats, prof, workers=1)["explain"])
    assert "first touches" not in text and "50.0 ms per step measured against 35.0 ms" in text


def test_planner_mixes_pools_when_decompression_is_cheap_against_the_disk():
    from zipmoe.runtime.plan.planner import make_plan

    layout, stats = _layout_and_stats(skew=0.2)
    prof = _profile({"full": 0.0001, "compressed": 0.0004, "sm_only": 0.0030, "e_only": 0.0040, "none": 0.0100})
    budget = layout.min_budget(1) + layout.total_expert_full // 3
    plan = make_plan(layout, budget, stats, prof, workers=1)
    assert plan["slots"]["per_layer"]["compressed"] > 0
    full_only = plan["alternatives"]["full only"]["expected_tpot_s"]
    assert plan["expected_tpot_s"] < (1 - margin_for(plan["slots"]["per_layer"])) * full_only
    assert any("against" in line and "full tensors only" in line for line in plan["explain"])


def test_a_mixed_plan_needs_a_clear_predicted_gain_over_full_tensors_only(monkeypatch):
    from zipmoe.runtime.plan import planner

    layout, stats = _layout_and_stats(skew=0.2)
    prof = _profile({"full": 0.0001, "compressed": 0.0004, "sm_only": 0.0030, "e_only": 0.0040, "none": 0.0100})
    budget = layout.min_budget(1) + layout.total_expert_full // 3
    monkeypatch.setattr(planner, "PREFER_FULL_MARGIN", 0.99)  # nothing can be that much faster
    monkeypatch.setattr(planner, "COPY_FREE_MARGIN", 0.99)
    plan = planner.make_plan(layout, budget, stats, prof, workers=1)
    assert plan["slots"]["per_layer"]["compressed"] == 0 and plan["slots"]["per_layer"]["full"] > 0
    # it says what it passed over: the best mix's figure against full tensors only, and the margin
    full_s = plan["alternatives"]["full only"]["expected_tpot_s"]
    line = next(x for x in plan["explain"] if x.startswith("the best mix found"))
    assert "compressed" in line and "must be 99% faster (at most 0.01x its time) to be chosen" in line
    mix_s = float(line.split("is predicted ")[1].split(" ms")[0]) / 1e3
    assert mix_s < full_s  # faster, but not by the margin
    ratio = float(line.split("(")[2].split("x full tensors only")[0])
    assert ratio == pytest.approx(full_s / mix_s, rel=1e-2) and ratio > 1


def test_no_passed_over_line_when_full_tensors_only_is_the_best_found():
    from zipmoe.runtime.plan.planner import make_plan

    layout, stats = _layout_and_stats(skew=0.2)
    prof = _profile({"full": 0.0002, "compressed": 0.0045, "sm_only": 0.0050, "e_only": 0.0052, "none": 0.0055})
    plan = make_plan(layout, layout.min_budget(1) + layout.total_expert_full // 3, stats, prof, workers=1)
    assert not any(x.startswith("the best mix found") for x in plan["explain"])


def test_part_slots_spend_every_pool_byte_and_mix_their_whole_slot_corners():
    """The pools are shared by every layer: a layer's share of 1.5 full slots is 1.5 * layers
    slots, modelled as 2 slots in half the layers and 1 in the others (on the CPU demo at 400M
    whole slots per layer left 0.9 of 1.9 full slots unused and the plan over-predicted full
    tensors only's misses: 67% against 50% measured)."""
    from zipmoe.runtime.plan.planner import Planner, make_plan, part_slot_corners

    assert part_slot_corners({"full": 2}) == [({"full": 2, "compressed": 0, "sm_only": 0, "e_only": 0}, 1.0)]
    corners = part_slot_corners({"full": 1.5, "e_only": 0.25})
    assert sum(w for _, w in corners) == pytest.approx(1.0) and len(corners) == 4
    assert dict((tuple(c.values()), w) for c, w in corners)[(2, 0, 0, 1)] == pytest.approx(0.5 * 0.25)
    layout, stats = _layout_and_stats(skew=0.8)
    prof = _profile({"full": 0.0002, "compressed": 0.0045, "sm_only": 0.0050, "e_only": 0.0052, "none": 0.0055})
    pl = Planner(layout, stats, prof, 1)
    t1, t2, mid = pl.tpot_s({"full": 1}), pl.tpot_s({"full": 2}), pl.tpot_s({"full": 1.5})
    assert t2 < mid < t1 and mid == pytest.approx((t1 + t2) / 2)
    # a budget of 2.5 full slots per layer: full tensors only takes all of it
    sb = layout.slot_bytes["full"]
    n = len(layout.decode_layers)
    budget = layout.min_budget(1)
    for _ in range(4):  # the budget whose pools hold 2.5 full slots per layer
        budget += int(2.5 * sb * n) + 64 - layout.pool_bytes(budget, 1)
    per_layer = layout.pool_bytes(budget, 1) // n
    plan = make_plan(layout, budget, stats, prof, workers=1)
    fo = plan["alternatives"]["full only"]
    assert fo["slots"]["full"] == pytest.approx(per_layer / sb, abs=1e-3) and 2 < fo["slots"]["full"] < 3
    assert 0 <= plan["pool_bytes_available"] - sum(plan["pools"].values()) < n * 8  # nothing left but rounding
    assert plan["unused_bytes"] >= 0
    # the whole-slot plan is one of the corners: never better than spending the rest
    assert fo["expected_tpot_s"] < pl.describe({"full": 2})["expected_tpot_s"]


def test_old_profiles_still_plan_with_the_schedule_model():
    from zipmoe.runtime.plan.planner import Planner

    layout, stats = _layout_and_stats()
    prof = _profile({"full": 0.0})  # incomplete: not every state measured
    pl = Planner(layout, stats, prof, 1)
    assert pl.cost_model == "schedule" and pl.tpot_s({"full": 4}) > 0


def test_state_step_costs_from_the_passes():
    from zipmoe.runtime.plan.passes import state_step_costs

    passes = {"resident": {"step_s": 0.010}, "graphs": True,
              "full_host": {"step_s": 0.012, "state_share": 1.0}, "compressed": {"step_s": 0.030, "state_share": 0.95},
              "sm_only": {"step_s": 0.040, "state_share": 0.9}, "e_only": {"step_s": 0.045, "state_share": 0.9},
              "none": {"step_s": 0.050, "state_share": 1.0}}
    sc = state_step_costs(passes, top_k=2, sparse_layers=4)
    assert sc["per_expert_s"]["compressed"] == pytest.approx(0.020 / 8)
    assert sc["per_expert_s"]["full"] == pytest.approx(0.002 / 8)
    assert sc["per_expert_s"]["none"] == pytest.approx(0.040 / 8)
    assert sc["graphs"] is True and sc["resident_step_s"] == 0.010
    cpu = state_step_costs({k: v for k, v in passes.items() if k not in ("full_host", "graphs")}, 2, 4)
    assert cpu["per_expert_s"]["full"] == 0.0 and cpu["graphs"] is False
    assert state_step_costs({"resident": {"step_s": 0.01}}, 2, 4) is None


# ------------------------------------------------------------------------- the default plan
def test_usage_statistics_are_kept_per_container_and_corrupt_files_start_afresh(tmp_path):
    from zipmoe.runtime.plan.default import read_usage, record_usage, stats_path

    assert record_usage(tmp_path, "cid1", {"0": {1: 3, 2: 1}}, calls=4) == stats_path(tmp_path, "cid1")
    record_usage(tmp_path, "cid1", {"0": {1: 1}, "1": {0: 2}}, calls=2)
    counts, calls, warn = read_usage(stats_path(tmp_path, "cid1"), "cid1")
    assert warn is None and calls == 6 and counts == {"0": {"1": 4, "2": 1}, "1": {"0": 2}}
    # another container's file under this name, or garbage: a warning and nothing used
    _c, _n, warn = read_usage(stats_path(tmp_path, "cid1"), "other")
    assert warn and "starting afresh" in warn
    stats_path(tmp_path, "cid1").write_text("{not json")
    counts, calls, warn = read_usage(stats_path(tmp_path, "cid1"), "cid1")
    assert counts == {} and calls == 0 and "unusable" in warn
    record_usage(tmp_path, "cid1", {"0": {5: 1}}, calls=1)  # a corrupt file is replaced, not a crash
    assert read_usage(stats_path(tmp_path, "cid1"), "cid1")[:2] == ({"0": {"5": 1}}, 1)
    assert record_usage(tmp_path, "cid1", {}, calls=0) is None


def test_from_counts_ranks_by_popularity():
    from zipmoe.runtime.plan.stats import from_counts

    st = from_counts({"0": {"3": 30, "1": 10}}, container_id="c", num_experts=4, top_k=1, layers=[0, 1])
    assert st.source == "earlier runs" and st.rank_p[0][0] > st.rank_p[0][1]
    assert np.allclose(st.rank_p[1], st.rank_p[0])  # layers without counts: the mean profile
    assert from_counts({}, container_id="c", num_experts=4, top_k=1, layers=[0]).source == "uniform prior"


@pytest.fixture(scope="module")
def container(tiny_mixtral_container):
    from zipmoe.codecs.reader import ContainerReader
    from zipmoe.runtime.plan.layout import container_layout

    path, cid = tiny_mixtral_container
    with ContainerReader(path) as r:
        return path, cid, container_layout(r, "bfloat16", "cpu")


def test_default_plan_is_full_only_without_a_profile_then_fitted_from_it(container, tmp_path):
    from zipmoe.runtime.plan.default import MIN_CALLS_PER_LAYER, default_plan, record_usage
    from zipmoe.runtime.plan.profile import (PROFILE_FORMAT, PROFILE_REVISION, container_info, default_profile_path,
                                             machine_info, save_profile)

    path, cid, layout = container
    budget = layout.min_budget(1) + layout.total_expert_full // 3
    plan, line = default_plan(path, budget, "cpu", 1, tmp_path)
    assert plan["pools"]["compressed"] == 0 and plan["pools"]["full"] > 0
    assert line.startswith("default plan: full tensors only") and "zipmoe plan" in line
    # every expert fits: the runtime's own split is right
    assert default_plan(path, layout.min_budget(1) + 2 * layout.total_expert_full, "cpu", 1, tmp_path)[0] is None

    prof = {"format": PROFILE_FORMAT, "revision": PROFILE_REVISION, "machine": machine_info("cpu"), "container": container_info(path, cid),
            "dtype": "bfloat16", "disk": {"method": "O_DIRECT", "readers": 4}, "decomp": {"codec": "zstd"},
            "costs": {"disk_bw": 1e9, "disk_latency": 1e-4, "decomp_bw_per_worker": 1e9, "merge_bw": 1e10,
                      "compute_s_per_expert": 1e-4},
            "step_costs": {"resident_step_s": 0.01, "graphs": False,
                           "per_expert_s": {"full": 0.0, "compressed": 0.0002, "sm_only": 0.002, "e_only": 0.003,
                                            "none": 0.010}}}
    save_profile(prof, default_profile_path(cid, "cpu", "bfloat16", cache_dir=tmp_path))
    plan, line = default_plan(path, budget, "cpu", 1, tmp_path, readers=4)
    # a profile but no routing recorded yet: still full tensors only (the uniform prior's plan
    # measured 1.24x slower than full tensors only on the H200, docs/benchmarks.md §22)
    assert "no routing of this file recorded yet" in line and plan["pools"]["compressed"] == plan["pools"]["sm_only"] == 0
    record_usage(tmp_path, cid, {str(l): {0: 500, 1: 400, 2: 3} for l in layout.sparse_layers}, calls=MIN_CALLS_PER_LAYER)
    plan2, line2 = default_plan(path, budget, "cpu", 1, tmp_path, readers=4)
    assert "fitted at load" in line2 and "earlier layer calls" in line2
    # the rank model's mix is not trusted without recorded routing to replay (test below)
    assert "the mix it fitted is not used: 0 recorded decode layer calls" in line2
    assert plan2["pools"]["compressed"] == plan2["pools"]["sm_only"] == plan2["pools"]["e_only"] == 0
    assert "other processes" not in line2
    # a profile measured on a busy machine: the line says so first (runtime/plan/busy.py)
    save_profile({**prof, "load": {"others_cores": 1.5, "cores": 2, "wall_s": 20.0}},
                 default_profile_path(cid, "cpu", "bfloat16", cache_dir=tmp_path))
    busy_line = default_plan(path, budget, "cpu", 1, tmp_path, readers=4)[1]
    assert busy_line.startswith("warning: the profile was measured while other processes kept 1.5 of 2 cores busy")
    assert busy_line.splitlines()[-1].startswith("default plan: fitted at load")
    save_profile(prof, default_profile_path(cid, "cpu", "bfloat16", cache_dir=tmp_path))
    # a profile measured with another queue depth is not this machine's profile any more
    assert default_plan(path, budget, "cpu", 1, tmp_path, readers=2)[1].startswith("default plan: full tensors only")
    # nor one measured before the admission rate was (revision 4): its mixes would not be charged for it
    save_profile({**prof, "revision": 3}, default_profile_path(cid, "cpu", "bfloat16", cache_dir=tmp_path))
    assert "no current profile of this machine and file cached" in default_plan(path, budget, "cpu", 1, tmp_path, readers=4)[1]
    # a current profile without served costs (its passes failed: ``serving_error``): the line says
    # why, and measuring again is what `zipmoe plan --remeasure` does
    save_profile({**{k: v for k, v in prof.items() if k != "step_costs"},
                  "runtime": {**prof.get("runtime", {}), "serving_error": "RuntimeError: boom"}},
                 default_profile_path(cid, "cpu", "bfloat16", cache_dir=tmp_path))
    plan4, line4 = default_plan(path, budget, "cpu", 1, tmp_path, readers=4)
    assert line4.startswith("default plan: full tensors only (the cached profile has no per-state costs: its served "
                            "passes failed (RuntimeError: boom);") and "--remeasure" in line4 \
        and plan4["pools"]["compressed"] == 0, line4
    save_profile(prof, default_profile_path(cid, "cpu", "bfloat16", cache_dir=tmp_path))
    # a corrupt statistics file: a warning line, then the prior
    (tmp_path / "stats" / f"{cid}.json").write_text("]")
    plan3, line3 = default_plan(path, budget, "cpu", 1, tmp_path, readers=4)
    assert "unusable" in line3 and "full tensors only" in line3 and plan3["pools"]["compressed"] == 0


def test_uses_are_counted_per_layer_call_and_logged_on_request():
    from zipmoe.runtime.engine.counters import Counters, delta

    c = Counters()
    c.add_layer(0, 0.001, [3, 1])
    before = c.snapshot()
    c.log_uses(True)
    c.add_layer(0, 0.001, [3])
    c.add_layer(1, 0.001, 2)  # a count: no ids, nothing recorded
    assert c.uses == {"0": {3: 2, 1: 1}} and c.uses_log == [(0, (3,))]
    assert delta(c.snapshot(), before)["uses"] == {"0": {3: 1}}
    assert c.log_uses(False) == [(0, (3,))] and c.uses_log is None
    assert c.layer_calls == 3 and c.expert_calls == 5
    # the most recent calls are kept always, bounded (what the default plan replays)
    assert list(c.recent_calls) == [(0, (3, 1)), (0, (3,))]
    from zipmoe.runtime.engine.counters import RECENT_CALLS

    for i in range(RECENT_CALLS + 5):
        c.add_layer(i % 2, 0.0, [i % 7])
    assert len(c.recent_calls) == RECENT_CALLS and c.recent_calls[-1] == ((RECENT_CALLS + 4) % 2, ((RECENT_CALLS + 4) % 7,))


def test_a_failing_beside_pass_costs_only_beta(container, monkeypatch):
    """The pass of misses beside compressed hits is optional: if it fails, the profile keeps every
    other per-state cost (and says why), and the planner counts those layers as before."""
    from zipmoe.runtime.plan import passes

    real = passes.lone_miss_pass

    def broken(*a, rest=None, **kw):
        if rest == "compressed":
            raise RuntimeError("no compressed pool here")
        return real(*a, rest=rest, **kw)

    monkeypatch.setattr(passes, "lone_miss_pass", broken)
    path, _cid, layout = container
    out = passes.measure_runtime(path, layout, "cpu", workers=1, tokens=4, warmup=3, miss_tokens=3, served_tokens=0)
    assert "serving_error" not in out and out["beside_error"] == "RuntimeError: no compressed pool here"
    sc = out["step_costs"]
    assert set(sc["per_expert_s"]) == set(POOL_ORDER) and "miss_curve_s" in sc
    assert "compressed_beside_misses_s" not in sc


@pytest.fixture(scope="module")
def switch_container(tmp_path_factory):
    """A tiny SwitchTransformers (encoder-decoder, top-1) packed: ``(path, layout)``."""
    synth = pytest.importorskip("zipmoe.runtime.synth.writer")
    from zipmoe.codecs.reader import ContainerReader
    from zipmoe.codecs.writer import pack
    from zipmoe.runtime.plan.layout import container_layout

    d = tmp_path_factory.mktemp("switch")
    synth.write("switch_transformers", d / "ck", preset="tiny", progress=False)
    pack(d / "ck", d / "m.zmoe")
    with ContainerReader(d / "m.zmoe") as r:
        return d / "m.zmoe", container_layout(r, "bfloat16", "cpu")


def test_encoder_decoder_stream_feeds_the_forced_tokens_through_generate(switch_container):
    """An encoder-decoder is served by ``model.generate`` (the encoder once, the decoder per token),
    which the decode loop does not run: the passes' stream drives generate instead, and each timed
    step is fed the token the decode loop's step would be (``forced[i]``), with ``between_steps``
    before each timed step and the routing recorded per step, the first decoder step first."""
    pytest.importorskip("zipmoe.runtime.engine.loader")
    import torch

    from zipmoe.runtime.plan import passes as P

    path, layout = switch_container
    forced = [7, 11, 13, 17]
    with P.runtime_for_passes(path, layout, "cpu", 1) as (model, _tok, _budget, _want):
        rt = model.zipmoe
        fed: list = []
        hook = model.get_decoder().register_forward_pre_hook(
            lambda _m, args, kw: fed.append((kw.get("input_ids") if kw.get("input_ids") is not None else args[0]).tolist()),
            with_kwargs=True)
        calls: list = []
        routing: list = []
        prompt = torch.tensor([[5, 6, 8, 9, 10]])
        try:
            times, d = P._run_stream(model, rt, prompt, forced, between_steps=lambda: calls.append(len(fed)),
                                     routing=routing)
        finally:
            hook.remove()
    assert len(times) == len(forced) and all(t > 0 for t in times)
    # decoder step 1 is fed the start token; timed step i (decoder step i + 2) the forced token i
    assert [f[0][-1] for f in fed] == [model.config.decoder_start_token_id, *forced]
    assert calls == [1, 2, 3, 4]  # before each timed step, after the step before it
    sparse = len(layout.decode_layers)
    assert len(routing) == 1 + len(forced) and all(len(r) == sparse for r in routing[1:])
    assert d["layer_calls"] == sparse * len(forced)  # the counters cover the timed steps alone
    assert P.routing_of(model, rt, prompt, forced) == routing[1:]  # the same stream routes the same


def test_encoder_decoder_batch_passes_serve_rows_through_generate(switch_container):
    """``zipmoe plan --batch N`` on an encoder-decoder: the batch passes feed N rows through
    ``generate`` (each row its own forced stream), every state's pass in its state, with the
    experts a layer call chose across the rows measured."""
    pytest.importorskip("zipmoe.runtime.engine.loader")
    from zipmoe.runtime.plan.batched import measure_batch

    path, layout = switch_container
    out = measure_batch(path, layout, 3, "cpu", workers=1, tokens=3, warmup=2)
    assert out["batch"] == 3 and out["tokens"] == 3 and out["all_experts_resident"]
    p = out["passes"]
    assert p["resident"]["state_share"] == 1.0 and p["resident"]["steps"] == 3
    for s in ("compressed", "sm_only", "e_only", "none"):
        assert p[s]["state_share"] >= 0.9, (s, p[s]["hits"])
    # three rows of top-1: between one and three experts per layer call
    assert 1.0 <= out["experts_per_layer"] <= 3.0 and out["step_costs"]["per_expert_s"]["none"] > 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not __import__("torch").cuda.is_available(), reason="needs CUDA")])])
def test_encoder_decoder_passes_serve_every_state(switch_container, device):
    """SwitchTransformers' profile: every served pass, through ``model.generate`` (before, its
    profile had the resident step alone, and the planner predicted 0.23-0.31x the H100's measured
    steps, docs/benchmarks.md §27c): each state's pass in its state, the per-state costs and the
    misses fitted to a served run; top-1, so no pass of compressed hits beside misses (β)."""
    pytest.importorskip("zipmoe.runtime.engine.loader")
    from zipmoe.runtime.plan.passes import measure_runtime

    from zipmoe.codecs.reader import ContainerReader
    from zipmoe.runtime.plan.layout import container_layout

    path, layout = switch_container
    if device != "cpu":
        with ContainerReader(path) as r:
            layout = container_layout(r, "bfloat16", device)
    out = measure_runtime(path, layout, device, workers=1, tokens=4, warmup=2, miss_tokens=3, served_tokens=16)
    assert "serving_error" not in out, out.get("serving_error")
    assert "generate" in out["workload"] and out["all_experts_resident"] and out["tokens"] == 4
    states = out["states"]
    assert states["resident"]["state_share"] == 1.0, states["resident"]["hits"]
    assert out["dense_s_per_token"] > 0 and out["compute_s_per_expert"] > 0 and out["layer_overhead_s"] >= 0
    for s in ("compressed", "sm_only", "e_only", "none"):
        assert states[s]["experts_per_layer"] == layout.top_k == 1
        assert states[s]["state_share"] >= 0.9, (s, states[s]["hits"])
    assert states["none"]["reads"] > 0 and states["admit"]["fetched"] == states["none"]["fetched"]
    assert states["misses_1"]["miss_share"] == pytest.approx(1.0, abs=0.1)
    assert "compressed_beside_misses" not in states  # top-1
    sc = out["step_costs"]
    assert set(sc["per_expert_s"]) == set(POOL_ORDER) and list(sc["miss_curve_s"]) == ["1"]
    if not sc.get("graphs"):  # (the full pool's served run needs a runtime without graphs)
        assert states["served"]["hits"]["none"] > 0 and "served_fit" in sc
    json.dumps(out)


def test_passes_load_every_expert_whole_where_the_layout_undercounts(container):
    """The passes' budget comes from the runtime's own arithmetic (passes.resident_budget), not the
    layout's estimate alone: on CUDA the runtime counts what the layout does not (the allocator's
    rounding of DeepSeek-V2-Lite's 11 MiB shared experts, 21 of them), so the estimate's pools
    came out short of every expert, the runtime split them 60/40, and the "resident" passes of
    docs/benchmarks.md §27/§27b served compressed hits. A layout that undercounts the dense
    weights by three experts' working bytes stands in for that here."""
    pytest.importorskip("zipmoe.runtime.engine.loader")
    import dataclasses

    from zipmoe.runtime.engine.loader import load
    from zipmoe.runtime.plan import passes as P

    path, _cid, layout = container
    short = dataclasses.replace(layout, dense_bytes=layout.dense_bytes - 3 * layout.expert_working)
    estimate = short.min_budget(1) + short.total_expert_full + 3 * short.expert_working
    model, _tok = load(path, budget=estimate, device="cpu", workers=1, threads=1)
    try:  # the layout's estimate alone: the runtime's pools do not hold every expert
        assert not P.holds_every_expert(model.zipmoe) and model.zipmoe.pools["compressed"] > 0
    finally:
        model.zipmoe.fetcher.close()
    assert P.resident_budget(path, short, "cpu", 1) > estimate
    with P.runtime_for_passes(path, short, "cpu", 1) as (model, _tok, budget, want):
        assert budget >= want and P.holds_every_expert(model.zipmoe), model.zipmoe.pools


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not __import__("torch").cuda.is_available(), reason="needs CUDA")])])
def test_serving_passes_hold_each_state(container, device):
    """measure_runtime's passes through the runtime: each pass's expert uses are (nearly all) in
    its state, and the per-state costs come out of them (on CUDA with the sparse blocks graphed:
    the host-path pass too)."""
    pytest.importorskip("zipmoe.runtime.engine.loader")
    from zipmoe.runtime.plan.passes import measure_runtime

    path, _cid, layout = container
    out = measure_runtime(path, layout, device, workers=1, tokens=4, warmup=3, miss_tokens=3)
    assert "serving_error" not in out, out.get("serving_error")
    states = out["states"]
    if device == "cpu":
        assert "full_host" not in states  # the CPU has no graphs
    else:
        assert states["graphs"] and states["full_host"]["state_share"] >= 0.9
        assert out["step_costs"]["graphs"] is True
    # the resident pass: every expert use a full hit (the base of every per-state cost)
    assert out["all_experts_resident"] and states["resident"]["state_share"] == 1.0, states["resident"]["hits"]
    for s in ("compressed", "sm_only", "e_only", "none"):
        assert states[s]["experts_per_layer"] == layout.top_k
        assert states[s]["state_share"] >= 0.9, (s, states[s]["hits"])
    assert states["none"]["reads"] > 0
    # the admission pass: every fetched tensor kept by a host pool, its copy timed while serving
    adm = states["admit"]
    assert adm["fetched"] == states["none"]["fetched"] > 0  # the same stream, every tensor fetched
    assert adm["admitted_bytes"] > 0 and adm["admit_s"] > 0
    assert adm["admit_bw"] is None or adm["admit_bw"] > 0
    # emptying the pool between the steps freed what the steps admitted (all but the last's), timed
    assert 0 < adm["freed_bytes"] <= adm["admitted_bytes"] and adm["free_s"] >= 0
    if adm["admit_bw"] and adm["admit_and_free_bw"]:
        assert adm["admit_and_free_bw"] <= adm["admit_bw"]
    sc = out["step_costs"]
    assert set(sc["per_expert_s"]) == set(POOL_ORDER)
    assert sc["per_expert_s"]["full"] == 0.0 or device == "cuda"
    # every expert resident: the lone-miss passes, one per count of misses per layer
    assert sorted(int(j) for j in sc["miss_curve_s"]) == list(range(1, layout.top_k + 1))
    for j in range(1, layout.top_k + 1):
        assert states[f"misses_{j}"]["miss_share"] == pytest.approx(j / layout.top_k, abs=0.1)
    # half of them misses, the rest compressed hits: what a compressed hit adds beside misses (β)
    mixed, half = states["compressed_beside_misses"], layout.top_k // 2
    assert mixed["misses_per_layer"] == half and mixed["rest"] == "compressed"
    assert mixed["miss_share"] == pytest.approx(half / layout.top_k, abs=0.1)
    assert mixed["rest_share"] == pytest.approx(1 - half / layout.top_k, abs=0.1)
    assert sc["compressed_beside_misses_at"] == half and sc["compressed_beside_misses_s"] >= 0
    # its pool copies its misses rather than keep their read buffers: they are reused, as the
    # lone-miss passes' are (adopted, 104 of 240 misses had read into fresh mappings on the demo)
    assert mixed["fresh_buffers"] <= states[f"misses_{half}"]["fresh_buffers"] + 2
    # β fitted to a served run of one compressed pool (on CUDA too: such a run has no full hits)
    served_c = states["served_compressed"]
    assert served_c["pool"] == "compressed" and served_c["hits"]["full"] == 0 and served_c["hits"]["compressed"] > 0
    if "beta_fit" in sc:
        assert sc["compressed_beside_misses_s"] == sc["beta_fit"]["beta_s"]
    assert out["workload"].startswith("corpus")
    json.dumps(out)  # the profile stores it


def _spy_fit(monkeypatch, name: str, pool: str) -> dict:
    """Wrap ``passes.<name>`` (a served fit) so the test sees what it was given: the costs before
    the fit, the served run (with its routing) and a view of the run's pool for ``model_run``."""
    from zipmoe.runtime.plan import passes

    seen: dict = {}
    real = getattr(passes, name)

    def spy(sc, served, rt, *more):
        seen.update(sc=sc, served=served, view=passes._PoolsView(rt, served["capacity"], pool))
        return real(sc, served, rt, *more)

    monkeypatch.setattr(passes, name, spy)
    return seen


@pytest.fixture(scope="module")
def served_profile(container):
    """One runtime profile of the container with both served passes (12 tokens), each served fit
    spied (:func:`_spy_fit`): ``(what each fit was given, by pool, the profile)``."""
    pytest.importorskip("zipmoe.runtime.engine.loader")
    from zipmoe.runtime.plan import passes

    path, _cid, layout = container
    with pytest.MonkeyPatch.context() as mp:
        seen = {"full": _spy_fit(mp, "served_miss_scale", "full"),
                "compressed": _spy_fit(mp, "served_beta_fit", "compressed")}
        out = passes.measure_runtime(path, layout, "cpu", workers=1, tokens=4, warmup=3, miss_tokens=3, served_tokens=12)
    assert "serving_error" not in out, out.get("serving_error")
    return seen, out


def test_served_pass_fits_the_miss_cost_so_the_model_charges_the_run_what_it_took(container, served_profile):
    """Without graphs the profile serves the stream at capacity (a quarter of the experts whole, from an
    empty cache) and scales the misses' costs so that the cost model, charged for that run's own
    routing (replayed: the run's hits), gives the run's measured mean step."""
    from zipmoe.runtime.plan.replay import model_run

    (spied, out), (_path, _cid, layout) = served_profile, container
    seen = spied["full"]
    served = out["states"]["served"]
    assert served["steps"] == 12 and "routing" not in served  # the profile keeps no routing
    assert served["capacity"] == int(0.25 * layout.total_expert_full)
    assert served["hits"]["none"] > 0 and served["hits"]["full"] > 0  # at capacity: hits and misses
    sc, fit, before = out["step_costs"], out["step_costs"]["served_fit"], seen["sc"]
    assert len(seen["served"]["routing"]) == 13  # the prefill, then a step per token
    assert fit["passes_miss_s"] == before["per_expert_s"]["none"]
    assert sc["per_expert_s"]["none"] == pytest.approx(before["per_expert_s"]["none"] * fit["scale"])
    for j, v in before["miss_curve_s"].items():
        assert sc["miss_curve_s"][j] == pytest.approx(v * fit["scale"])
    for s in ("full", "compressed", "sm_only", "e_only"):
        assert sc["per_expert_s"][s] == before["per_expert_s"][s]
    charged = model_run(seen["served"]["routing"], seen["view"], {"step_costs": sc}, prefill_steps=1)["model_tpot_s"]
    # the first touch of the memory the run's cache newly held is netted out first (not the misses')
    none = out["states"]["none"]
    assert fit["first_touch_s"] == pytest.approx(passes_first_touch(served, none["merge_s"] / none["fetched"]))
    if 0.5 < fit["scale"] < 3.0:  # not clamped: the fitted model charges the run its measured step, net of that
        assert charged == pytest.approx(fit["measured_step_s"] - fit["first_touch_s"], rel=1e-6)
    else:
        assert (charged - sc["resident_step_s"]) == pytest.approx(
            fit["scale"] * (fit["model_step_s"] - sc["resident_step_s"]), rel=1e-6)
    json.dumps(out)


def passes_first_touch(served, per_fetch, workers=1):
    from zipmoe.runtime.plan.passes import first_touch_s

    return first_touch_s(served, per_fetch, workers)


def test_the_miss_fit_nets_out_the_first_touch_of_fresh_memory(monkeypatch):
    """A served run that starts from an empty cache writes every tensor it admits into memory the
    process never touched: its merges take longer than the all-miss pass's, whose dropped tensors'
    memory is reused at once (on the CPU box 4.7-7.5 ms against 0.3-0.6 per tensor). That time is
    not the misses': fitted into them it scaled SwitchTransformers' misses 3x and the planner chose
    E-only slots that lost 1.14-1.21x (docs/benchmarks.md §27d). The excess over the pass's merge
    per fetched tensor, spread over the decode workers, comes off the measured step first."""
    from types import SimpleNamespace

    from zipmoe.runtime.plan import passes, replay

    served = {"steps": 10, "fetched": 20, "merge_s": 0.100, "mean_step_s": 0.040, "routing": [[]] * 11, "capacity": 1}
    # 20 tensors at the pass's 1 ms each: 80 ms beyond, over 10 steps, one worker
    assert passes.first_touch_s(served, 0.001) == pytest.approx(0.008)
    assert passes.first_touch_s(served, 0.001, workers=4) == pytest.approx(0.002)
    assert passes.first_touch_s(served, 0.010) == 0.0  # merges no slower than the pass's: nothing to net out
    assert passes.first_touch_s(served, None) == 0.0 and passes.first_touch_s({"steps": 0}, 0.001) == 0.0
    # the fit: the model charges the run 25 ms; the run took 40, 8 of them first touches
    monkeypatch.setattr(replay, "model_run", lambda *a, **k: {"model_tpot_s": 0.025, "model_hits": {"none": 0.5}})
    rt = SimpleNamespace(top_k=1, expert_tensors={}, slots=None, cache=None, workers=1)
    sc = {"resident_step_s": 0.020}
    fit = passes.served_miss_scale(sc, served, rt, 0.001)
    assert fit["first_touch_s"] == pytest.approx(0.008)
    assert fit["scale"] == pytest.approx((0.040 - 0.008 - 0.020) / (0.025 - 0.020))  # 2.4, not 3.0 (clamped 4.0)
    assert passes.served_miss_scale(sc, served, rt)["scale"] == 3.0  # without the pass's merge: as before


def test_a_full_pool_served_pass_refuses_a_runtime_with_device_slots():
    """``Runtime._new_cache`` hooks the device slots to the cache it makes, whose admissions would
    then overwrite the tensors the runtime's own cache keeps in them: refused, not corrupted."""
    from types import SimpleNamespace

    from zipmoe.runtime.plan.passes import served_pass

    rt = SimpleNamespace(slots=object(), _new_cache=lambda caps: pytest.fail("a cache was made"))
    with pytest.raises(ValueError, match="without device slots"):
        served_pass(None, rt, [1], [2], 1 << 20)


def test_beta_is_fitted_to_a_served_run_of_one_compressed_pool(container, served_profile):
    """With β measured, the profile serves the stream from an empty cache of one compressed pool at
    capacity (hits and misses mixed, no full hits) and fits β so that the cost model, charged for
    that run's own routing replayed through the same pool, gives its measured mean step (docs/
    benchmarks.md §22q: the β pass measured 4x what serving implied on an H100)."""
    from zipmoe.runtime.plan.replay import model_run

    (spied, out), (_path, _cid, layout) = served_profile, container
    seen = spied["compressed"]
    served = out["states"]["served_compressed"]
    assert served["pool"] == "compressed" and served["steps"] == 12 and "routing" not in served
    every = layout.slot_bytes["compressed"] * layout.num_experts * len(layout.decode_layers)
    assert served["capacity"] == int(0.25 * every)  # a quarter of the experts, compressed
    assert served["hits"]["compressed"] > 0 and served["hits"]["none"] > 0 and served["hits"]["full"] == 0
    assert served["fresh_buffers"] >= 0
    sc, before = out["step_costs"], seen["sc"]
    fit = sc["beta_fit"]
    assert fit["passes_beta_s"] == before["compressed_beside_misses_s"] and fit["beside_per_step"] > 0
    assert sc["compressed_beside_misses_s"] == fit["beta_s"] >= 0
    assert sc["per_expert_s"] == before["per_expert_s"]  # only β moves
    charged = model_run(seen["served"]["routing"], seen["view"], {"step_costs": sc}, prefill_steps=1)["model_tpot_s"]
    assert charged == pytest.approx(fit["model_step_s_fitted"], rel=1e-6)
    if not fit["clamped"]:  # the fitted model charges the run its measured step
        assert charged == pytest.approx(fit["measured_step_s"], rel=1e-6)
    # the runtime serves from its own cache again, graphs as before
    assert seen["view"].pools == {"compressed": served["capacity"]}
    json.dumps(out)


def test_beta_fit_moves_beta_to_what_the_run_took():
    """served_beta_fit on a given run: the model is linear in β, so the fitted β charges the run
    its measured step; a run faster than the model at β=0 gives 0, never below."""
    from types import SimpleNamespace

    from zipmoe.runtime.plan import passes
    from zipmoe.runtime.plan.replay import model_run

    from test_replay import _tensors

    ets = _tensors(8)  # two layers of 8 experts, two tensors each (E 1050 + SM 3072 bytes an expert)
    rt = SimpleNamespace(top_k=2, expert_tensors=ets, slots=None, cache=SimpleNamespace(age_every=0))
    routing = [[(0, [e % 8, (e + 3) % 8])] for e in range(40)]
    sc = {"resident_step_s": 0.01, "graphs": False,
          "per_expert_s": {"full": 0.0, "compressed": 0.002, "sm_only": 0.003, "e_only": 0.004, "none": 0.006},
          "miss_curve_s": {"1": 0.006, "2": 0.009}, "compressed_beside_misses_s": 0.004}
    view = passes._PoolsView(rt, 3 * 4122, "compressed")

    def charged(beta):
        return model_run(routing, view, {"step_costs": dict(sc, compressed_beside_misses_s=beta)}, prefill_steps=1)["model_tpot_s"]

    want = charged(0.001)  # a run that took what β = 1 ms charges
    fit = passes.served_beta_fit(sc, {"mean_step_s": want, "routing": routing, "capacity": 3 * 4122, "steps": 39,
                                      "pool": "compressed"}, rt)
    assert fit["beta_s"] == pytest.approx(0.001) and not fit["clamped"]
    assert fit["model_step_s"] == pytest.approx(charged(0.004))
    fast = passes.served_beta_fit(sc, {"mean_step_s": charged(0.0) * 0.5, "routing": routing, "capacity": 3 * 4122,
                                       "steps": 39, "pool": "compressed"}, rt)
    assert fast["beta_s"] == 0.0 and fast["clamped"]
    assert passes.served_beta_fit(dict(sc, compressed_beside_misses_s=None), {"mean_step_s": 1.0, "routing": routing,
                                                                               "capacity": 1, "steps": 1}, rt) is None


def test_no_served_fit_when_switched_off_or_without_a_run(container):
    pytest.importorskip("zipmoe.runtime.engine.loader")
    from zipmoe.runtime.plan.passes import measure_runtime, served_miss_scale

    path, _cid, layout = container
    out = measure_runtime(path, layout, "cpu", workers=1, tokens=3, warmup=2, miss_tokens=3, served_tokens=0)
    assert "served" not in out["states"] and "served_fit" not in out["step_costs"]
    assert "served_compressed" not in out["states"] and "beta_fit" not in out["step_costs"]
    assert served_miss_scale(out["step_costs"], {"mean_step_s": 0.1, "routing": [], "capacity": 0, "steps": 0}, None) is None


def _default_budget(layout) -> int:
    """A budget whose pools hold 2.5 full tensors a layer (the default plan's tests)."""
    budget = layout.min_budget(1)
    while layout.pool_bytes(budget, 1) < 2.5 * layout.slot_bytes["full"] * len(layout.decode_layers):
        budget += 4096
    return budget


def _cycling_routing(layout, hot: list, keep: int | None = None) -> list:
    """160 decode steps over ``hot`` in turn, ``top_k`` experts a layer call (``keep``: this expert
    in every call, the others in turn)."""
    k = layout.top_k
    if keep is None:
        return [(l, tuple(sorted({hot[(step * k + j) % len(hot)] for j in range(k)})))
                for step in range(160) for l in layout.sparse_layers]
    rest = [e for e in hot if e != keep]
    return [(l, tuple(sorted({keep} | {rest[(step * (k - 1) + j) % len(rest)] for j in range(k - 1)})))
            for step in range(160) for l in layout.sparse_layers]


def _cache_for_default(container, tmp, per: dict, uses: dict, routing: list, admit_bw: float = 1e15,
                       batches: dict | None = None):
    """A cache folder holding what the default plan fits from: a profile of these per-state costs
    (this machine and file, 4 readers; ``batches``: its costs served at N rows) and the
    container's recorded usage and routing."""
    from zipmoe.runtime.plan.default import record_usage
    from zipmoe.runtime.plan.profile import PROFILE_FORMAT, PROFILE_REVISION, container_info, default_profile_path, machine_info, save_profile

    path, cid, _ = container
    prof = {"format": PROFILE_FORMAT, "revision": PROFILE_REVISION, "machine": machine_info("cpu"), "container": container_info(path, cid),
            "dtype": "bfloat16", "disk": {"method": "O_DIRECT", "readers": 4}, "decomp": {"codec": "zstd"},
            "costs": {"disk_bw": 1e9, "disk_latency": 1e-4, "decomp_bw_per_worker": 1e9, "merge_bw": 1e10,
                      "compute_s_per_expert": 1e-4, "admit_bw": admit_bw},
            "step_costs": {"resident_step_s": 0.01, "graphs": False, "per_expert_s": per},
            **({"batches": batches} if batches else {})}
    save_profile(prof, default_profile_path(cid, "cpu", "bfloat16", cache_dir=tmp))
    record_usage(tmp, cid, uses, calls=160, routing=routing)
    return tmp


def test_default_plan_judges_a_fitted_mix_on_recorded_routing_with_admissions_charged(container, tmp_path):
    """The rank model's steady state admits nothing, so a mix the default fits at load is judged
    against full tensors only on the routing earlier runs recorded (``counters.recent_calls``,
    kept by record_usage), replayed through the runtime's cache with the host pools' admission
    copies charged: kept where it wins by the planner's margin, full tensors only where the
    copies eat the gain (as §22k's mix did on the H100). The compressed pool keeps the read
    buffers (engine/adopt.py) and copies nothing, so a compressed mix stays however slow copies
    are; a mix of SM-only slots (cheap SM-only hits here) is charged its copies."""
    from zipmoe.runtime.plan.default import default_plan, read_routing, stats_path

    path, cid, layout = container
    E, k, n = layout.num_experts, layout.top_k, len(layout.decode_layers)
    budget = _default_budget(layout)
    hot = list(range(max(k + 1, (E * 5) // 8)))  # more experts than full tensors hold, fewer than compressed ones
    routing = _cycling_routing(layout, hot)
    uses = {str(l): {e: 10 for e in hot} for l in layout.sparse_layers}

    def fitted(admit_bw, tmp, per=None):
        per = per or {"full": 0.0, "compressed": 0.0002, "sm_only": 0.008, "e_only": 0.009, "none": 0.010}
        return default_plan(path, budget, "cpu", 1, _cache_for_default(container, tmp, per, uses, routing, admit_bw), readers=4)

    assert read_routing(stats_path(tmp_path / "a", cid), cid) == []
    plan, line = fitted(1e15, tmp_path / "a")  # copies for free
    assert read_routing(stats_path(tmp_path / "a", cid), cid) == routing
    assert f"replayed {160 * n} recorded decode layer calls" in line, line
    assert plan["pools"]["compressed"] > 0, line
    plan, line = fitted(1.0, tmp_path / "b")  # a byte a second: the compressed pool copies nothing
    assert plan["pools"]["compressed"] > 0, line
    sm = {"full": 0.0, "compressed": 0.009, "sm_only": 0.0003, "e_only": 0.009, "none": 0.010}
    plan, line = fitted(1e15, tmp_path / "c", sm)  # SM-only hits cheap, copies free: SM-only slots
    assert plan["pools"]["sm_only"] > 0 and "replayed" in line, line
    plan, line = fitted(1.0, tmp_path / "d", sm)  # the same at a byte a second: no mix pays its copies
    assert "full tensors only" in line and plan["pools"]["sm_only"] == plan["pools"]["compressed"] == 0, line


def _judged_planner(times: dict, halves: dict):
    """A Planner whose judgements are given: ``times[name]`` the whole replay's seconds per token,
    ``halves[name]`` each half's; plans are ``{"full": .., ...}`` slot dicts named by their key."""
    from zipmoe.runtime.plan.planner import Planner

    p = Planner.__new__(Planner)
    name = lambda slots: next(k for k, v in PLANS.items() if dict(v) == dict(slots))  # noqa: E731
    p.judged_s = lambda slots: times[name(slots)]
    p.halves = [0, 1]
    p._half_s = lambda h, slots: halves[name(slots)][h]
    return p


PLANS = {"full": {"full": 10.0, "compressed": 0, "sm_only": 0, "e_only": 0},
         "compressed": {"full": 0, "compressed": 15.7, "sm_only": 0, "e_only": 0},
         "mix": {"full": 0, "compressed": 13.7, "sm_only": 0, "e_only": 8.0},
         "e_only": {"full": 0, "compressed": 0, "sm_only": 0, "e_only": 60.0}}


def test_leaving_full_tensors_takes_the_fastest_plan_that_gains_enough_and_the_simplest_of_equals(monkeypatch):
    """The H200's case (docs/benchmarks.md §22p): the fastest mix and compressed only predicted
    ~1.12x faster than full tensors only and ~1.09x on each half. Each half is held to half the
    margin, and compressed only, 0.3% slower than the mix, is chosen for having one pool."""
    from zipmoe.runtime.plan import planner as P

    times = {"full": 0.580, "mix": 0.5178, "compressed": 0.5193, "e_only": 0.622}
    halves = {"full": (0.577, 0.608), "mix": (0.5255, 0.5574), "compressed": (0.526, 0.556), "e_only": (0.62, 0.63)}
    p = _judged_planner(times, halves)
    cands = [PLANS[k] for k in ("mix", "compressed", "e_only", "full")]
    chosen, hv, fastest = p.leave_full(cands, PLANS["full"])
    assert chosen == PLANS["compressed"] and fastest == PLANS["mix"] and len(hv) == 2
    # held to the whole margin on each half (the rule until 7 Dec), the mix fails its 10% on a half;
    # compressed only, copying nothing, passes its 3% on each (until the night of 7 Dec it needed 10% too: nothing
    # left full tensors then)
    monkeypatch.setattr(P, "HALF_SHARE", 1.0)
    assert p.leave_full(cands, PLANS["full"]) == (PLANS["compressed"], [(0.526, 0.577), (0.556, 0.608)], PLANS["mix"])
    monkeypatch.setattr(P, "COPY_FREE_MARGIN", P.PREFER_FULL_MARGIN)
    # (the halves returned are the fastest's, for the explanation)
    assert p.leave_full(cands, PLANS["full"]) == (None, [(0.5255, 0.577), (0.5574, 0.608)], PLANS["mix"])
    monkeypatch.undo()
    # compressed only failing a half: the mix that passes is chosen
    p = _judged_planner(times, {**halves, "compressed": (0.526, 0.60)})
    assert p.leave_full(cands, PLANS["full"])[:2][0] == PLANS["mix"]
    # the mix failing a half and compressed only, next, passing: compressed only, the mix named
    p = _judged_planner(times, {**halves, "mix": (0.5255, 0.59)})
    chosen, _hv, fastest = p.leave_full(cands, PLANS["full"])
    assert chosen == PLANS["compressed"] and fastest == PLANS["mix"]
    # a plan of fewer pools predicted more than 1% slower is not preferred
    p = _judged_planner({**times, "compressed": 0.5250}, halves)
    chosen, _hv, fastest = p.leave_full(cands, PLANS["full"])
    assert chosen == PLANS["mix"] and fastest is None
    # nothing 10% faster on the whole, and compressed only not 3%: full tensors only, the fastest named
    p = _judged_planner({**times, "mix": 0.53, "compressed": 0.566}, halves)
    assert p.leave_full(cands, PLANS["full"]) == (None, [], PLANS["mix"])


def test_a_plan_that_copies_nothing_leaves_full_tensors_at_the_smaller_margin():
    """The H100's case (docs/benchmarks.md §22q): compressed only predicted about 0.91x full
    tensors only (ran 0.88x). A plan of full and compressed slots copies nothing and needs 3%
    (1.5% on each half); a mix with E-only slots predicted faster still needs 10%."""
    from zipmoe.runtime.plan import planner as P

    assert P.copies_nothing(PLANS["compressed"]) and P.copies_nothing(PLANS["full"])
    assert not P.copies_nothing(PLANS["mix"]) and not P.copies_nothing(PLANS["e_only"])
    assert P.margin_for(PLANS["compressed"]) == P.COPY_FREE_MARGIN < P.margin_for(PLANS["mix"]) == P.PREFER_FULL_MARGIN
    cands = [PLANS[k] for k in ("mix", "compressed", "e_only", "full")]
    # the mix 8% faster (not 10%), compressed only 6%: the mix is skipped, compressed only chosen
    times = {"full": 0.580, "mix": 0.5336, "compressed": 0.545, "e_only": 0.622}
    halves = {"full": (0.577, 0.608), "mix": (0.53, 0.56), "compressed": (0.56, 0.59), "e_only": (0.62, 0.63)}
    chosen, hv, fastest = _judged_planner(times, halves).leave_full(cands, PLANS["full"])
    assert chosen == PLANS["compressed"] and fastest == PLANS["mix"] and hv == [(0.56, 0.577), (0.59, 0.608)]
    # compressed only 2% faster: under its margin, full tensors only
    assert _judged_planner({**times, "compressed": 0.5684}, halves).leave_full(cands, PLANS["full"])[0] is None
    # 6% faster on the whole but level on a half (0.605 against 0.608 is 0.5%, not 1.5%): full tensors only
    p = _judged_planner(times, {**halves, "compressed": (0.56, 0.605)})
    assert p.leave_full(cands, PLANS["full"])[0] is None


def test_default_plan_replays_compressed_only_when_the_rank_model_keeps_full_tensors_close_behind(container, tmp_path,
                                                                                                   monkeypatch):
    """The rank model's steady state put compressed only 1.1% ahead of full tensors only on the
    CPU box at 300M (under the 3% margin: full tensors only), the replay of the routing 3.8%, and
    it ran 1.08x faster (docs/benchmarks.md §22r). Where the fit keeps full tensors only with
    compressed only within ``REPLAY_COMPRESSED_WITHIN``, the default replays compressed only on
    the recorded routing, as `zipmoe plan` judges every single-pool plan, under the same margin."""
    from zipmoe.runtime.plan import default as D

    path, cid, layout = container
    E, k, n = layout.num_experts, layout.top_k, len(layout.decode_layers)
    budget = _default_budget(layout)
    hot = list(range(max(k + 1, (E * 5) // 8)))
    routing = _cycling_routing(layout, hot)
    uses = {str(l): {e: 10 for e in hot} for l in layout.sparse_layers}

    def fitted(compressed_s, tmp):
        per = {"full": 0.0, "compressed": compressed_s, "sm_only": 0.009, "e_only": 0.0095, "none": 0.010}
        return D.default_plan(path, budget, "cpu", 1, _cache_for_default(container, tmp, per, uses, routing), readers=4)

    # compressed only about 0.5% ahead in the rank model (full tensors only fitted), 3.7% on the replay: chosen
    plan, line = fitted(0.0033, tmp_path / "a")
    alts = plan["alternatives"]
    assert alts["compressed only"]["expected_tpot_s"] < alts["full only"]["expected_tpot_s"] < 1.03 * alts["compressed only"]["expected_tpot_s"]
    assert plan["pools"]["compressed"] > 0 and plan["pools"]["full"] == 0, line
    assert f"replayed {160 * n} recorded decode layer calls: compressed only" in line and "must be" not in line, line
    # without the replay of compressed only, the fit keeps full tensors only
    monkeypatch.setattr(D, "REPLAY_COMPRESSED_WITHIN", -1.0)
    plan, line = fitted(0.0033, tmp_path / "b")
    assert plan["pools"]["compressed"] == 0 and plan["pools"]["full"] > 0 and "replayed" not in line, line
    monkeypatch.undo()
    # compressed only replayed 2% ahead: under the margin, full tensors only, and the line says why
    plan, line = fitted(0.0036, tmp_path / "c")
    assert plan["pools"]["compressed"] == 0 and plan["pools"]["full"] > 0, line
    assert "compressed only" in line and "(it must be 3% faster): full tensors only" in line, line
    # too few recorded decode calls: no replay
    assert D._compressed_worth_replaying(plan, routing, layout)
    assert not D._compressed_worth_replaying(plan, routing[:10], layout)


@pytest.mark.parametrize("compressed_only, chosen", [(0.905, "compressed only"), (0.95, "the mix")])
def test_default_plan_chooses_among_the_mix_and_the_single_pools_as_zipmoe_plan_does(container, tmp_path, monkeypatch,
                                                                                      compressed_only, chosen):
    """On the CPU box at 500M the default fitted full and compressed slots, replayed 5.5% ahead of
    full tensors only, and ran 6% behind them, where `zipmoe plan` (judging every single pool on the
    replay beside the mix, fewest pools among those within 1%) chose compressed only
    (docs/benchmarks.md §22v). The default now chooses by the same rule: with the replay's verdicts
    given (the mix 0.90x full tensors only, compressed only 0.905x or 0.95x), compressed only
    within 1% of the mix is chosen for its one pool, and 5% behind it is not."""
    from zipmoe.runtime.plan import default as D, planner as P

    path, cid, layout = container
    E, k = layout.num_experts, layout.top_k
    budget = _default_budget(layout)
    hot = list(range(max(k + 1, (E * 5) // 8)))  # expert 0 in every step, the others in turn: full and compressed slots fit
    uses = {str(l): {e: (160 if e == 0 else 20) for e in hot} for l in layout.sparse_layers}
    per = {"full": 0.0, "compressed": 0.0012, "sm_only": 0.008, "e_only": 0.009, "none": 0.010}
    _cache_for_default(container, tmp_path, per, uses, _cycling_routing(layout, hot, keep=0))
    # the replay's verdicts, by the pools a plan has (the rank model's fit, before the replay, is its own)
    share = {("full",): 1.0, ("compressed", "full"): 0.90, ("compressed",): compressed_only}
    judged = P.Planner.judged_s

    def replayed(self, slots):
        if self.replayer is None:
            return judged(self, slots)
        return 0.02 * share.get(tuple(sorted(p for p, v in slots.items() if float(v) > 0)), 2.0)

    monkeypatch.setattr(P.Planner, "judged_s", replayed)
    monkeypatch.setattr(P.Planner, "_half_s", lambda self, h, slots: replayed(self, slots))
    plan, line = D.default_plan(path, budget, "cpu", 1, tmp_path, readers=4)
    if chosen == "compressed only":
        assert plan["pools"]["full"] == 0 and plan["pools"]["compressed"] > 0, line
        assert "compressed only 18.1 ms, the mix 18.0 ms, full tensors only 20.0 ms: compressed only" in line, line
        assert plan["expected_tpot_s"] == pytest.approx(0.0181)
    else:
        assert plan["pools"]["full"] > 0 and plan["pools"]["compressed"] > 0, line
        assert "the mix 18.0 ms, full tensors only 20.0 ms:" in line and "compressed only" not in line, line


def test_default_plan_for_several_rows_is_zipmoe_plan_batchs_choice_or_full_tensors_only(container, tmp_path):
    """``bench --engine zipmoe-default --batch 4`` fits its default for four rows: without costs
    served at four rows in the cached profile, full tensors only and the line names the command
    that measures them (the batch-1 fit lost 4% at four rows on the CPU box, docs/benchmarks.md
    §22r); with them, `zipmoe plan --batch 4`'s choice (the recorded routing replayed as four rows
    call the layers), which follows the four-row costs, not the one-row ones."""
    from zipmoe.runtime.bench.engines import rows_of
    from zipmoe.runtime.plan.default import default_plan

    path, cid, layout = container
    E, k = layout.num_experts, layout.top_k
    budget = _default_budget(layout)
    hot = list(range(max(k + 1, (E * 5) // 8)))
    routing = _cycling_routing(layout, hot)
    uses = {str(l): {e: 10 for e in hot} for l in layout.sparse_layers}
    per = {"full": 0.0, "compressed": 0.0002, "sm_only": 0.008, "e_only": 0.009, "none": 0.010}

    def b4(compressed_s):
        return {"4": {"experts_per_layer": 2.0 * k, "step_costs": {
            "resident_step_s": 0.02, "graphs": False,
            "per_expert_s": {"full": 0.0, "compressed": compressed_s, "sm_only": 0.009, "e_only": 0.0095, "none": 0.010}}}}

    one, line1 = default_plan(path, budget, "cpu", 1, _cache_for_default(container, tmp_path / "a", per, uses, routing), readers=4)
    assert one["pools"]["compressed"] > 0, line1  # one row: compressed hits cheap, a compressed pool
    plan, line = default_plan(path, budget, "cpu", 1, tmp_path / "a", readers=4, batch=4)
    assert plan["pools"]["compressed"] == 0 and plan["pools"]["full"] > 0, line
    assert line.startswith("default plan: full tensors only for 4 rows") and f"zipmoe plan {path.name} --profile-only --batch 4" in line, line
    # a profile given as a file (bench's --profile): the command names it
    from zipmoe.runtime.plan.profile import default_profile_path

    given = default_profile_path(cid, "cpu", "bfloat16", cache_dir=tmp_path / "a")
    _plan, line = default_plan(path, budget, "cpu", 1, tmp_path / "a", readers=4, batch=4, profile_path=given)
    assert f"--profile-only --batch 4 --profile {given}`" in line, line
    # compressed hits as cheap at four rows: the four-row plan keeps a compressed pool
    plan, line = default_plan(path, budget, "cpu", 1, _cache_for_default(container, tmp_path / "b", per, uses, routing,
                                                                        batches=b4(0.0002)), readers=4, batch=4)
    assert plan["batch"] == 4 and plan["pools"]["compressed"] > 0 and plan["source"] == "default", line
    assert f"fitted at load for 4 rows" in line and "replayed as 4 rows" in line and "per step of 4 tokens" in line, line
    # a compressed hit at four rows nearly a miss (the CPU box's cores, §22t): full tensors only
    plan, line = default_plan(path, budget, "cpu", 1, _cache_for_default(container, tmp_path / "c", per, uses, routing,
                                                                        batches=b4(0.0095)), readers=4, batch=4)
    assert plan["batch"] == 4 and plan["pools"] == plan["alternatives"]["full only"]["pools"], line
    # too little routing recorded to replay as four rows: full tensors only, said
    plan, line = default_plan(path, budget, "cpu", 1, _cache_for_default(container, tmp_path / "d", per, uses, routing[:40],
                                                                        batches=b4(0.0002)), readers=4, batch=4)
    assert plan["pools"]["compressed"] == 0 and "recorded decode layer calls to replay as 4 rows" in line, line
    # bench fits for the cases' batch when they share one
    assert rows_of({"cases": [{"batch": 4}, {"batch": 4}]}) == 4
    assert rows_of({"cases": [{"batch": 1}, {"batch": 4}]}) == 1 and rows_of({}) == 1
