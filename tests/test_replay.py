"""Replaying routing through the runtime's cache (runtime/plan/replay.py): it gives the run's own
hits, and the planner judges its candidates by it."""

from __future__ import annotations


import numpy as np
import pytest

from zipmoe.runtime.engine.states import STATES
from zipmoe.runtime.plan import replay as R


def _serve(path, budget: int, plan, tokens: int = 48, window: int | None = None):
    """Serve the corpus stream under ``plan`` (one reader, one decode worker, prefetch off);
    returns the runtime and its log of layer calls. ``window=1``: one expert in flight, so the
    experts finish, and are admitted, in the order they were issued (with more, the reader takes
    the best-ranked fetch queued when it frees up, and which ones are queued by then is timing)."""
    from zipmoe.runtime.engine.loader import load
    from zipmoe.runtime.plan.passes import _run_stream, forced_stream

    model, tok = load(path, budget=budget, device="cpu", plan=plan, workers=1, readers=1, prefetch=False, threads=1)
    rt = model.zipmoe
    if window is not None:
        rt.working.window = window  # fewer in flight than the load reserved room for
    prompt, forced = forced_stream(tok, model.config.to_dict(), tokens)
    rt.counters.log_uses(True)
    _run_stream(model, rt, prompt, forced)
    log = rt.counters.log_uses(False)
    return rt, log


def _calls(rt, log):
    n = len(rt.sparse_layers)  # the prefill's calls come first, one per sparse layer
    return [R.LayerCall(int(layer), tuple(sorted(experts)), i >= n) for i, (layer, experts) in enumerate(log)]


def _budget(path, fraction: float) -> int:
    from zipmoe.runtime.engine.loader import requirements

    return int(requirements(path, workers=1)["budget_for"](fraction))


@pytest.mark.parametrize("pools", ["full only", "mixed, one in flight", "mixed"])
def test_replaying_a_runs_own_routing_gives_its_hits(tiny_mixtral_container, pools):
    """The runtime's hit counters, state by state, equal the replay of the layer calls it logged,
    with its own pool sizes: the replay admits, evicts and cascades as the fetcher does. Exactly
    with one expert in flight (admission in issue order, the replay's order), with one pool or
    four; with the load's window, the runtime admits a layer's experts in the order they finish
    (a compressed hit, which reads nothing, can finish before a miss issued earlier; the reader
    takes the best-ranked fetch queued when it frees up) and the replay in issue order, so a few
    uses may land in another pool, and a tensor kept in another pool can make a later use a hit
    or a miss: every state within 2% of the uses (CI once saw one use of 408 with one pool and the
    window of three, and once one miss of 408 with four pools)."""
    path, cid = tiny_mixtral_container
    budget = _budget(path, 0.4)
    if pools == "full only":
        rt, log = _serve(path, budget, {"container_id": cid, "pools": {"full": 1 << 40}}, window=1)
    else:
        rt0, _ = _serve(path, budget, None, tokens=1)
        total = sum(rt0.pools.values())
        plan = {"container_id": cid, "pools": {"full": int(0.35 * total), "compressed": int(0.3 * total),
                                              "sm_only": int(0.2 * total), "e_only": int(0.15 * total)}}
        rt, log = _serve(path, budget, plan, window=1 if pools == "mixed, one in flight" else None)
    assert sum(rt.counters.hits.values()) > 0 and rt.counters.hits["none"] > 0
    res = R.replay(_calls(rt, log), rt.expert_tensors, rt.pools, age_every=rt.cache.age_every)
    got = dict(zip(STATES, res.tensor_hits.sum(axis=0).tolist()))
    if pools != "full only":  # the run used the lower pools, so the replay's cascade was exercised
        assert rt.counters.hits["compressed"] + rt.counters.hits["sm_only"] + rt.counters.hits["e_only"] > 0
    if pools != "mixed":
        assert got == dict(rt.counters.hits)
    else:
        uses = sum(rt.counters.hits.values())
        assert sum(got.values()) == uses
        for s in STATES:
            assert abs(got[s] - rt.counters.hits[s]) <= 0.02 * uses, (got, rt.counters.hits)


def test_expert_state_is_the_tensor_that_needs_most_work():
    assert R.expert_state(["full", "full"]) == "full"
    assert R.expert_state(["full", "compressed"]) == "compressed"
    assert R.expert_state(["sm_only", "e_only"]) == "e_only"
    assert R.expert_state(["full", None]) == "none"


def test_calls_from_a_trace_keep_order_and_mark_decode_steps(tmp_path):
    import json

    p = tmp_path / "t.jsonl"
    lines = [{"container_id": "c", "num_layers": 2, "num_experts": 4, "top_k": 2},
             {"layers": {"1": [[0, 1], [1, 3]], "0": [[2, 0], [2, 3]]}, "input": [1, 2]},
             {"layers": {"0": [[3, 1]], "1": [[0, 2]]}, "input": [1, 1]}]
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    calls = R.layer_calls_from_trace([p])
    assert calls == [R.LayerCall(0, (0, 2, 3), False), R.LayerCall(1, (0, 1, 3), False),
                     R.LayerCall(0, (1, 3), True), R.LayerCall(1, (0, 2), True)]
    assert R.layer_calls_from_trace([p], layers=[1]) == [calls[1], calls[3]]


def test_slot_book_keeps_a_kind_within_its_slots_and_evicts_the_least_used_of_that_kind():
    from zipmoe.runtime.engine.cache import ExpertCache

    class T:
        def __init__(self, uid, name):
            self.uid, self.name, self.shape, self.numel = uid, name, (4, 4), 16

    ets = {(0, e): [T(2 * e, "gate_up"), T(2 * e + 1, "down")] for e in range(4)}
    from zipmoe.runtime.engine.slots import slot_counts

    cache = ExpertCache({"full": 10 ** 6})
    counts = slot_counts(ets, 2 * 32 * 2, itemsize=2)
    assert counts == {("gate_up", (4, 4)): 2, ("down", (4, 4)): 2}  # room for two of each kind
    book = R.SlotBook(ets, counts)
    book.attach(cache)
    for uid in (0, 2, 0):  # gate_up of experts 0, 1; expert 0 used twice
        cache.touch(uid)
        cache.offer(uid, {"full": (32, None)})
    cache.touch(4)
    cache.offer(4, {"full": (32, None)})  # a third gate_up: expert 1's (used once) leaves
    assert cache.state_of(0) == "full" and cache.state_of(4) == "full" and cache.state_of(2) is None
    assert book.free[("gate_up", (4, 4))] == 0


def _planner(E=16, skew=1.0):
    from zipmoe.runtime.plan.layout import ContainerLayout
    from zipmoe.runtime.plan.planner import Planner
    from zipmoe.runtime.plan.stats import ActivationStats, rank_distribution

    layers = [0, 1]
    units = [("gate_up", (64, 32), 4096, 700, 2048), ("down", (32, 32), 2048, 350, 1024)]
    layout = ContainerLayout(path="m.zmoe", container_id="abc", file_size=0, num_layers=2, num_experts=E, top_k=2,
                             sparse_layers=layers, dense_bytes=1 << 20, dense_matmul_bytes=1 << 20, units=units,
                             expert_full_bytes=6144, expert_working=20000, max_segment=2048,
                             total_expert_full=len(layers) * E * 6144)
    p = rank_distribution(np.array([(r + 1.0) ** -skew for r in range(E)]) * 1000)
    stats = ActivationStats("abc", E, 2, layers, {l: p for l in layers}, "trace")
    prof = {"costs": {"disk_bw": 1e9, "disk_latency": 1e-4, "decomp_bw_per_worker": 1e9, "merge_bw": 1e10,
                      "compute_s_per_expert": 1e-4},
            "step_costs": {"resident_step_s": 0.01, "graphs": False,
                           "per_expert_s": {"full": 0.0, "compressed": 0.001, "sm_only": 0.002, "e_only": 0.003,
                                            "none": 0.004}}}
    return layout, stats, prof, Planner(layout, stats, prof, workers=1)


class _Tensor:
    def __init__(self, uid, name, nbytes, e, sm):
        self.uid, self.name, self.shape, self.numel = uid, name, (nbytes // 2,), nbytes // 2
        self.full_bytes = self.compute_bytes = nbytes
        self.e_bytes, self.sm_bytes = e, sm

    def kept_bytes(self, state):  # (no file ranges: the compressed pool counts the stored bytes)
        return self.e_bytes + self.sm_bytes


def _tensors(E=16):
    return {(l, e): [_Tensor(100 * l + 2 * e, "gate_up", 4096, 700, 2048), _Tensor(100 * l + 2 * e + 1, "down", 2048, 350, 1024)]
            for l in (0, 1) for e in range(E)}


def test_planner_replay_predicts_from_the_routing_and_chooses_by_it():
    """On routing that cycles through a few experts, every plan whose full pool holds them hits
    every decode step; the replay says so (the rank model cannot: its popularity is skewed, not
    a cycle), and the plan's figures are the replay's."""
    from zipmoe.runtime.plan.planner import make_plan

    layout, stats, prof, _ = _planner()
    calls = []
    for step in range(40):
        for l in (0, 1):
            calls.append(R.LayerCall(l, (step % 3, 3 + step % 2), step > 0))
    budget = layout.min_budget(1) + 3 * 20000 + 12 * 6144 * 2  # the window, and twelve experts a layer whole
    plan = make_plan(layout, budget, stats, prof, workers=1, replay=(calls, _tensors()))
    assert plan["hit_model"] == "replay" and plan["search"]["judged_by"] == "replay"
    assert plan["search"]["replayed_decode_calls"] == 78
    # five experts per layer are ever used: the warm replay hits them all in the full pool
    assert plan["warm"]["expected_hits"]["full"] == pytest.approx(2.0)
    assert plan["expected_hits"]["none"] < 0.2  # cold: only the first uses miss
    assert plan["rank_model"]["expected_hits"]["none"] > plan["expected_hits"]["none"]
    assert plan["expected_tpot_s"] == pytest.approx(0.01 + 2 * 0.004 * plan["expected_hits"]["none"], rel=1e-6)
    # without the routing the rank model decides and says so
    plain = make_plan(layout, budget, stats, prof, workers=1)
    assert plain["hit_model"] == "rank model" and "warm" not in plain


def test_replay_predictor_memoises_and_splits_cold_from_warm():
    _, _, _, planner = _planner()
    calls = [R.LayerCall(l, (e,), True) for e in range(8) for l in (0, 1)]
    planner.use_replay(calls, _tensors())
    r = planner.replayed({"full": 16})  # every expert fits: cold misses each once, warm never
    assert r["cold"]["hits"][STATES.index("none")] == pytest.approx(1.0)
    assert r["warm"]["hits"][STATES.index("full")] == pytest.approx(1.0)
    assert r["warm"]["tpot_s"] == pytest.approx(0.01)
    assert planner.replayed({"full": 16}) is not None and len(planner.replayer._memo) == 1


def test_split_by_prompt_keeps_prompts_whole():
    calls = []
    for p in range(5):
        calls += [R.LayerCall(0, (p,), False), R.LayerCall(0, (p + 1,), True), R.LayerCall(0, (p + 2,), True)]
    a, b = R.split_by_prompt(calls, 2)
    assert a == calls[:6] and b == calls[6:]  # 2 prompts, then 3
    assert R.split_by_prompt(calls[:3], 2) == [calls[:3]]  # one prompt: one part


def _cycle(experts_of_prompt, prompts, steps=30):
    calls = []
    for p in range(prompts):
        ex = experts_of_prompt(p)
        for l in (0, 1):
            calls.append(R.LayerCall(l, tuple(sorted(ex[:2])), False))
        for s in range(steps):
            for l in (0, 1):
                calls.append(R.LayerCall(l, tuple(sorted({ex[s % len(ex)], ex[(s + 1) % len(ex)]})), True))
    return calls


def _cheap_compressed_profile():
    """Costs where a compressed hit costs a thirtieth of a miss (the host pools nearly a miss)."""
    return {"costs": {"disk_bw": 1e9, "disk_latency": 1e-4, "decomp_bw_per_worker": 1e9, "merge_bw": 1e10,
                      "compute_s_per_expert": 1e-4},
            "step_costs": {"resident_step_s": 0.01, "graphs": False,
                           "per_expert_s": {"full": 0.0, "compressed": 0.0002, "sm_only": 0.004, "e_only": 0.005,
                                            "none": 0.006}}}


def test_a_mixed_plan_must_win_on_each_half_of_the_prompts(monkeypatch):
    """Routing whose first prompts cycle over more experts than full tensors hold (a compressed pool
    holds them all) and whose last prompts over a few (both plans hit everything): the mixed plan
    wins on the whole replay, thanks to the first half alone, so full tensors only is chosen; where
    both halves favour it, the mixed plan is."""
    from zipmoe.runtime.plan import planner as P

    monkeypatch.setattr(P, "PREFER_FULL_MARGIN", 0.03)  # the rule of the halves, at a margin these cycles pass
    layout, stats, _, _ = _planner()
    prof = _cheap_compressed_profile()
    budget = layout.min_budget(1) + 3 * 20000 + 5 * 6144 * 2  # five experts a layer whole, about seven compressed
    wide = lambda p: [0, 1, 2, 3, 4, 5, 6]  # noqa: E731 - seven experts: more than full tensors hold
    narrow = lambda p: [8, 9, 10]  # noqa: E731
    uneven = _cycle(wide, 2) + _cycle(narrow, 2)
    plan = P.make_plan(layout, budget, stats, prof, workers=1, replay=(uneven, _tensors()))
    full = plan["alternatives"]["full only"]
    assert plan["pools"] == full["pools"]  # full tensors only ...
    halves = plan["search"]["mixed_against_full_by_half_s"]
    assert len(halves) == 2 and halves[0][0] < 0.97 * halves[0][1] and halves[1][0] > 0.97 * halves[1][1]
    even = _cycle(wide, 4)
    plan = P.make_plan(layout, budget, stats, prof, workers=1, replay=(even, _tensors()))
    assert plan["pools"]["compressed"] > 0 and plan["expected_tpot_s"] < 0.97 * plan["alternatives"]["full only"]["expected_tpot_s"]


def test_compressed_admissions_are_free_and_sm_only_copies_are_charged(monkeypatch):
    """The compressed pool keeps the fetch's read buffers (engine/adopt.py): a mix of full and
    compressed tensors is charged no copy however slow the profile says copies are. What the
    SM-only and E-only pools take is copied into arrays of their own on the serving thread
    (§22k: 219 us per fetched tensor before adoption): a plan with such a pool is charged its
    bytes at the profile's copy rate, and a slow enough copy makes it lose to full tensors only."""
    from zipmoe.runtime.plan import planner as P

    monkeypatch.setattr(P, "PREFER_FULL_MARGIN", 0.03)  # these cycles' mix gains less than the default margin
    layout, stats, _, _ = _planner()
    per = {"full": 0.0, "compressed": 0.0002, "sm_only": 0.004, "e_only": 0.005, "none": 0.006}
    budget = layout.min_budget(1) + 3 * 20000 + 5 * 6144 * 2
    even = _cycle(lambda p: [0, 1, 2, 3, 4, 5, 6], 4)

    def profile(admit_bw):
        return {"costs": {"disk_bw": 1e9, "disk_latency": 1e-4, "decomp_bw_per_worker": 1e9, "merge_bw": 1e10,
                          "compute_s_per_expert": 1e-4, "admit_bw": admit_bw},
                "step_costs": {"resident_step_s": 0.01, "graphs": False, "per_expert_s": per}}

    for admit_bw in (1e12, 1e3):  # copies for free, then copies that take a second per KB
        plan = P.make_plan(layout, budget, stats, profile(admit_bw), workers=1, replay=(even, _tensors()))
        assert plan["pools"]["compressed"] > 0 and plan["pools"]["sm_only"] == plan["pools"]["e_only"] == 0
        assert plan["expected_admit_bytes_per_token"] == 0 == plan["expected_admit_s_per_token"]
        assert not any("host pools admit" in line for line in plan["explain"])  # nothing copied, nothing said
        assert plan["expected_tpot_s"] < 0.97 * plan["alternatives"]["full only"]["expected_tpot_s"]

    # the same planner judging a plan that keeps SM halves: charged what that pool copies
    def judged(admit_bw, slots):
        pl = P.Planner(layout, stats, profile(admit_bw), 1, None, None)
        pl.use_replay(even, _tensors())
        return pl.replayed(slots)["cold"]

    sm = {"full": 5, "compressed": 0, "sm_only": 2, "e_only": 0}
    free, slow = judged(1e12, sm), judged(1e6, sm)
    assert free["admit_bytes_per_step"] > 0 and free["admit_bytes_per_step"] == slow["admit_bytes_per_step"]
    assert slow["admit_s_per_step"] == pytest.approx(slow["admit_bytes_per_step"] / 1e6)
    assert slow["tpot_s"] == pytest.approx(free["tpot_s"] - free["admit_s_per_step"] + slow["admit_s_per_step"])
    full_only = judged(1e6, {"full": 5, "compressed": 0, "sm_only": 0, "e_only": 0})
    assert full_only["admit_bytes_per_step"] == 0


def test_replay_counts_what_the_sm_only_and_e_only_pools_copy_not_what_the_compressed_pool_adopts():
    ets = _tensors(4)
    calls = [R.LayerCall(0, (e,), True) for e in (0, 1, 0, 1, 2, 3)]
    # the compressed pool keeps the read buffers: nothing is copied
    res = R.replay(calls, ets, {"full": 0, "compressed": 10 ** 6, "sm_only": 0, "e_only": 0})
    assert res.admitted.tolist() == [0] * 6
    # an SM-only pool copies the SM half of each first use; its hits read the E half and copy nothing
    res = R.replay(calls, ets, {"full": 0, "compressed": 0, "sm_only": 10 ** 6, "e_only": 0})
    assert res.admitted.tolist() == [2048 + 1024, 2048 + 1024, 0, 0, 2048 + 1024, 2048 + 1024]
    # a compressed pool for one expert over an SM-only pool: the first fetch is adopted; the
    # pool keeps it (as often used as the newcomers), so each later miss lands in the SM-only
    # pool, a copy; 0 comes back as a compressed hit, 1 as an SM-only hit
    one = 700 + 2048 + 350 + 1024
    res = R.replay(calls, ets, {"full": 0, "compressed": one, "sm_only": 10 ** 6, "e_only": 0})
    assert res.admitted.tolist() == [0, 2048 + 1024, 0, 0, 2048 + 1024, 2048 + 1024]
    assert res.counts[:, R.STATES.index("compressed")].tolist() == [0, 0, 1, 0, 0, 0]
    assert res.counts[:, R.STATES.index("sm_only")].tolist() == [0, 0, 0, 1, 0, 0]


def test_the_judge_replays_the_routing_once_and_reads_the_same_cold_figures(monkeypatch):
    """The judge (``Planner.judged_s``, the halves) reads only the cold replay: ``evaluate(warm=False)``
    replays the calls once instead of twice (on the default plan's fit at load, the replays were
    nearly all its time), with the same cold figures as the replay that goes on warm."""
    from zipmoe.runtime.plan.model import StepTable

    calls = _cycle(lambda p: [p % 5, 5 + p % 3, 8, 9, 10], 6)
    table = StepTable.of(2, _cheap_compressed_profile()["step_costs"])
    seen = []
    real = R.replay
    monkeypatch.setattr(R, "replay", lambda c, *a, **k: seen.append(len(c)) or real(c, *a, **k))
    for pools in ({"full": 6 * 6144}, {"compressed": 8 * 4000, "full": 2 * 6144}, {"sm_only": 9 * 3100}):
        seen.clear()
        once = R.ReplayPredictor(calls, _tensors(), table, decode_layers=2).evaluate(pools, warm=False)
        both = R.ReplayPredictor(calls, _tensors(), table, decode_layers=2).evaluate(pools)
        assert seen == [len(calls), 2 * len(calls)] and set(once) == {"cold"}
        assert once["cold"]["layers_s_per_step"] == both["cold"]["layers_s_per_step"]
        assert (once["cold"]["hits"] == both["cold"]["hits"]).all()
        assert once["cold"]["admit_bytes_per_step"] == both["cold"]["admit_bytes_per_step"]
    # a warm evaluation serves a later cold one; a cold one is kept apart from a warm one
    pred = R.ReplayPredictor(calls, _tensors(), table, decode_layers=2)
    seen.clear()
    pred.evaluate({"full": 6 * 6144})
    pred.evaluate({"full": 6 * 6144}, warm=False)
    pred.evaluate({"full": 4 * 6144}, warm=False)
    pred.evaluate({"full": 4 * 6144})
    assert seen == [2 * len(calls), len(calls), 2 * len(calls)]
