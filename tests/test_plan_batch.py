"""Plans for a batch of rows (`zipmoe plan --batch N`, runtime/plan/batched.py): the routing as N rows
call the layers, the states' costs served at N rows, and the planner's choice from them."""

from __future__ import annotations

import json

import pytest

from zipmoe.runtime.plan import replay as R
from zipmoe.runtime.plan.batched import step_costs_at

from test_replay import _cheap_compressed_profile, _cycle, _planner, _tensors


def _prompt(first, steps, layers=(0, 1)):
    """One prompt's calls: its prefill, then ``steps`` decode steps, experts ``first + step``."""
    calls = [R.LayerCall(l, (first, first + 1), False) for l in layers]
    for s in range(steps):
        calls += [R.LayerCall(l, (first + s + l,), True) for l in layers]
    return calls


def test_batched_calls_merge_rows_step_by_step_and_layer_by_layer():
    a, b, c = _prompt(0, 3), _prompt(10, 2), _prompt(20, 1)
    calls = a + b + c
    assert R.batched_calls(calls, 1) == calls
    got = R.batched_calls(calls, 2)
    # rows a and b: one prefill per layer with both rows' experts, then their decode steps together;
    # b ends after two steps, so a's third step is alone; then c alone (a batch of one row)
    assert got[:2] == [R.LayerCall(0, (0, 1, 10, 11), False), R.LayerCall(1, (0, 1, 10, 11), False)]
    assert got[2:4] == [R.LayerCall(0, (0, 10), True), R.LayerCall(1, (1, 11), True)]
    assert got[4:6] == [R.LayerCall(0, (1, 11), True), R.LayerCall(1, (2, 12), True)]
    assert got[6:8] == [R.LayerCall(0, (2,), True), R.LayerCall(1, (3,), True)]
    assert got[8:] == c
    # every row's experts are still called at the same layer, and no decode step is lost or added
    assert sum(x.decode for x in R.batched_calls(calls, 3)) == 2 * 3  # the longest row's steps, 2 layers
    # a shared expert is one call of that expert
    same = _prompt(0, 2) + _prompt(0, 2)
    assert [x.experts for x in R.batched_calls(same, 2)] == [x.experts for x in _prompt(0, 2)]


def test_step_costs_at_a_batch_are_the_batchs_with_the_served_miss_scale_and_no_batch_1_curve():
    base = {"resident_step_s": 0.01, "graphs": False, "miss_curve_s": {"1": 0.003}, "compressed_beside_misses_s": 0.0005,
            "per_expert_s": {"full": 0.0, "compressed": 0.001, "sm_only": 0.002, "e_only": 0.003, "none": 0.004},
            "served_fit": {"scale": 1.5}}
    b4 = {"resident_step_s": 0.03, "graphs": False,
          "per_expert_s": {"full": 0.0, "compressed": 0.0025, "sm_only": 0.003, "e_only": 0.0035, "none": 0.004}}
    prof = {"step_costs": base, "batches": {"4": {"step_costs": b4, "experts_per_layer": 6.5}}}
    assert step_costs_at(prof, 1) is base
    got = step_costs_at(prof, 4)
    assert got["resident_step_s"] == 0.03 and got["batch"] == 4 and got["experts_per_layer"] == 6.5
    assert got["per_expert_s"]["compressed"] == 0.0025
    assert got["per_expert_s"]["none"] == pytest.approx(0.006)  # 0.004, times the served run's 1.5
    assert "miss_curve_s" not in got and "compressed_beside_misses_s" not in got
    assert b4["per_expert_s"]["none"] == 0.004  # the profile is not changed
    assert step_costs_at(prof, 2) is None and step_costs_at({}, 4) is None


def _batch_profile(prof, compressed_b4):
    b4 = {"resident_step_s": 0.02, "graphs": False,
          "per_expert_s": {"full": 0.0, "compressed": compressed_b4, "sm_only": 0.004, "e_only": 0.005, "none": 0.006}}
    return dict(prof, batches={"4": {"step_costs": b4, "experts_per_layer": 6.0}})


def test_a_plan_for_four_rows_is_judged_by_the_costs_served_at_four_rows():
    """Routing over more experts than full tensors hold (a compressed pool holds them all): at
    batch 1 a compressed hit is cheap and the planner leaves full tensors; the same routing at
    four rows, where a compressed hit costs nearly a miss (the rows' compute takes the decode
    workers' cores, as on the CPU box, docs/benchmarks.md §22r), keeps full tensors only."""
    from zipmoe.runtime.plan.planner import make_plan

    layout, stats, _, _ = _planner()
    prof = _cheap_compressed_profile()
    budget = layout.min_budget(1) + 3 * 20000 + 5 * 6144 * 2  # five experts a layer whole, about seven compressed
    calls = _cycle(lambda p: [0, 1, 2, 3, 4, 5, 6], 8)
    one = make_plan(layout, budget, stats, prof, workers=1, replay=(calls, _tensors()))
    assert one["batch"] == 1 and one["pools"]["compressed"] > 0
    cheap = make_plan(layout, budget, stats, _batch_profile(prof, 0.0002), workers=1, replay=(calls, _tensors()), batch=4)
    dear = make_plan(layout, budget, stats, _batch_profile(prof, 0.0058), workers=1, replay=(calls, _tensors()), batch=4)
    assert cheap["batch"] == 4 and cheap["pools"]["compressed"] > 0
    assert dear["pools"] == dear["alternatives"]["full only"]["pools"]
    # four rows' steps: a quarter of the decode calls, each charged at the batch's resident step
    assert cheap["search"]["replayed_decode_calls"] == one["search"]["replayed_decode_calls"] // 4
    assert dear["expected_tpot_s"] >= 0.02
    assert any("of 4 rows" in line for line in dear["explain"])
    with pytest.raises(ValueError, match="replay"):
        make_plan(layout, budget, stats, _batch_profile(prof, 0.0002), workers=1, batch=4)
    with pytest.raises(ValueError, match="batch 2"):
        make_plan(layout, budget, stats, _batch_profile(prof, 0.0002), workers=1, replay=(calls, _tensors()), batch=2)


@pytest.mark.slow
def test_plan_batch_serves_the_states_at_that_batch_once_and_keeps_them_in_the_profile(tiny_mixtral_container, tmp_path,
                                                                                       capsys, monkeypatch):
    pytest.importorskip("zipmoe.runtime.engine.loader")
    from test_planner_cli import _profile, _run

    monkeypatch.setenv("ZIPMOE_CACHE_DIR", str(tmp_path / "cache"))
    path, cid = tiny_mixtral_container
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is the capital of France?\nName three rivers of Europe.\n")
    prof_path = _profile(path, cid, tmp_path)
    out = tmp_path / "plan.json"
    args = ["plan", path, "--budget", "1M", "--calibrate", prompts, "--calibrate-tokens", "4", "--profile", prof_path,
            "--workers", "1", "--batch", "2", "-o", out]
    code, _, err = _run(args, capsys)
    assert code == 0, err
    assert "serving each cache state at batch 2" in err
    plan = json.loads(out.read_text())
    assert plan["batch"] == 2 and plan["profile"]["cost_model"] == "measured states"
    kept = json.loads(prof_path.read_text())["batches"]["2"]
    assert kept["batch"] == 2 and kept["tokens"] > 0
    per = kept["step_costs"]["per_expert_s"]
    assert set(per) == {"full", "compressed", "sm_only", "e_only", "none"} and per["none"] > 0
    # two rows choose at least one row's experts per layer and at most both rows'
    assert 2 <= kept["experts_per_layer"] <= 4
    assert plan["profile"]["step_costs"]["resident_step_s"] == kept["step_costs"]["resident_step_s"]
    for p in plan["trace"]["files"]:
        json.loads(open(p).readline())

    # a second plan at that batch reuses the kept costs: nothing is served again
    from zipmoe.runtime.plan import batched

    def no(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr(batched, "measure_batch", no)
    code, _, err = _run(args, capsys)
    assert code == 0 and "serving each cache state" not in err, err
    # --profile-only shows them (and would measure them there, without a trace)
    code, out, err = _run(["plan", path, "--profile-only", "--profile", prof_path, "--batch", "2"], capsys)
    assert code == 0, err
    assert "batch 2    served at 2 rows: resident step" in out and "none" in out.splitlines()[-1], out


@pytest.mark.parametrize("extra, needle", [(["--batch", "0"], "--batch must be at least 1, got 0"),
                                           (["--batch", "4"], "--batch N replays recorded routing")])
def test_plan_batch_bad_input_is_one_line(tiny_mixtral_container, tmp_path, capsys, extra, needle, monkeypatch):
    from test_planner_cli import _run

    monkeypatch.setenv("ZIPMOE_CACHE_DIR", str(tmp_path / "cache"))
    path, _ = tiny_mixtral_container
    code, out, err = _run(["plan", path, "--budget", "1M", *extra], capsys)
    assert code == 2 and needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_layer_of_misses_beside_host_pool_hits_served_at_two_rows(tiny_mixtral_container):
    """``lone_miss_pass`` at several rows (its routing read from the rows' decode loop) with the
    other chosen experts hits of a host pool: the pass benchmarks/results/2026-12-07-cpu-batch/
    mixed_probe.py set beside the pure passes at four rows (docs/benchmarks.md §22t)."""
    pytest.importorskip("zipmoe.runtime.engine.loader")
    from zipmoe.codecs.reader import ContainerReader
    from zipmoe.runtime.plan import passes as P
    from zipmoe.runtime.plan.batched import batch_stream
    from zipmoe.runtime.plan.layout import container_layout

    path, _cid = tiny_mixtral_container
    with ContainerReader(path) as r:
        layout = container_layout(r, "auto", "cpu")
    with P.runtime_for_passes(path, layout, "cpu", 1) as (model, tok, _budget, _want):
        rt = model.zipmoe
        cfg = model.config.to_dict()
        prompt, forced = batch_stream(tok, cfg, 2, 4)
        own = rt.cache
        steps = P.routing_of(model, rt, prompt, forced)
        assert len(steps) == 4 and all(len(s) == len(layout.sparse_layers) for s in steps)
        assert max(len(ex) for s in steps for _, ex in s) > layout.top_k  # two rows' experts in one call
        for rest in ("sm_only", "e_only"):
            p = P.lone_miss_pass(model, rt, prompt, forced, misses=1, rest=rest)
            assert p["rest"] == rest and p["hits"][rest] > 0 and p["hits"]["none"] > 0 and p["hits"]["full"] == 0, p
        with pytest.raises(ValueError, match="rest"):
            P.lone_miss_pass(model, rt, prompt, forced, misses=1, rest="full")
        assert rt.cache is own and rt.fetcher.cache is own  # the runtime's own cache is back
