"""CUDA-graph decode steps (engine/graphs.py) and the full pool's device slots (engine/slots.py).

The reference is transformers computing the same checkpoint with eager experts over a
``StaticCache``, step by step (:func:`decode`): prefill eagerly, then decode steps of one token
each as the decode loop makes them (engine/step.py: position ids, the mask of the cache's length). GPU tests (``-m gpu``): every fused
family, batch 1 and 4, budgets where every expert is resident (warm: the sparse blocks are
graphs) and where experts miss (the host path takes the layer mid-sequence), logits
``torch.equal`` at every step. CPU tests: the slot map's bookkeeping against the cache, and
serving through slots on the CPU (no graphs there) bit-identical too.
"""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
import torch

import zipmoe
from zipmoe.runtime.engine.cache import ExpertCache
from zipmoe.runtime.engine.graphs import GraphedStep, supported, why_not
from zipmoe.runtime.engine.hf_compat import cache_kw
from zipmoe.runtime.engine.step import forward as step_forward
from zipmoe.runtime.engine.loader import requirements
from zipmoe.runtime.engine.slots import SlotMap

from test_runtime_fixtures import container, reference

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
FUSED = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2"]
STEPS = 6
CONTEXT = 32


def _vocab(src) -> int:
    return json.loads((src / "config.json").read_text())["vocab_size"]


def decode(model, prompt, steps: int = STEPS, context: int = CONTEXT, graphs: bool = False, batched_sparse=None):
    """Greedy decode over a StaticCache; returns (logits of every step, the step object)."""
    from transformers import StaticCache

    b, n = prompt.shape
    cache = StaticCache(config=model.config, max_cache_len=context)
    mask = torch.zeros((b, context), dtype=torch.int64, device=prompt.device)
    mask[:, :n] = 1
    with torch.no_grad():
        logits = model(input_ids=prompt, attention_mask=mask, **{cache_kw(model): cache}, use_cache=True).logits[:, -1:]
    out = [logits]
    step = GraphedStep(model, cache, b, batched_sparse=batched_sparse) if graphs else None
    for i in range(steps):
        nxt = out[-1][:, -1].argmax(-1, keepdim=True)
        pos = n + i
        mask[:, pos] = 1
        pos_ids = torch.full((b, 1), pos, dtype=torch.long, device=prompt.device)
        with torch.no_grad():
            if step is None:
                logits = step_forward(model, cache, nxt, pos_ids, mask)
            else:
                logits = step(nxt, pos_ids, mask)
        out.append(logits.clone()[:, None])
    return out, step


def _prompt(vocab, batch, device, seed=0, n=7):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, n), generator=g).to(device)


# ---------------------------------------------------------------------------------- GPU
@pytest.fixture(scope="module")
def gpu_refs():
    return {}


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("batched", [False, True], ids=["host-sparse", "batched-sparse"])
@pytest.mark.parametrize("family", FUSED)
def test_graphed_decode_is_bit_identical(tmp_path_factory, gpu_refs, family, batched):
    """batched: batch 4's sparse blocks from graphs too (the default, EngineSettings.batched_sparse); not
    batched: batch 1 (its sparse blocks are always graphs) and batch 4 with its sparse blocks on the host path."""
    src, path = container(tmp_path_factory, family)
    ref = reference(src, "cuda")
    req = requirements(path, workers=1, device="cuda")
    for batch in ((1, 4) if not batched else (4,)):
        prompt = _prompt(_vocab(src), batch, "cuda", seed=batch)
        want, _ = decode(ref, prompt)
        for which, fraction, warm in (("resident", 1.0, True), ("resident-cold", 1.0, False), ("half", 0.5, False),
                                      ("quarter", 0.25, False)):
            model, _ = zipmoe.load(path, budget=req["budget_for"](fraction), device="cuda", workers=1, warm=warm)
            rt = model.zipmoe
            try:
                assert supported(model, batch), why_not(model, batch)
                got, step = decode(model, prompt, graphs=True, batched_sparse=batched)
                for i, (a, b) in enumerate(zip(want, got)):
                    assert torch.equal(a, b), f"{family} batch {batch} {which}: logits differ at step {i}"
                assert len(step.pieces) == len(step.sparse) + 1 and step.sparse
                rt.slots.check()
                assert rt.counters.peak_held_bytes <= rt.budget
                sparse_graphs = batch == 1 or step.graph_grouped
                if which == "resident" and sparse_graphs:
                    assert step.stats["graphed_layers"] > 0 and step.stats["host_layers"] == 0, step.stats
                if which in ("half", "quarter") or not sparse_graphs:
                    assert step.stats["host_layers"] > 0, step.stats  # misses took the host path mid-sequence
                if batched and all(a.slots for a in rt.slots.arenas.values()):
                    assert step._grouped  # the batch's sparse graphs were captured
            finally:
                rt.close()


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("batch", [1, 4])
def test_graphed_layers_count_what_the_eager_step_counts(tmp_path_factory, batch):
    """A layer served from graphs is accounted after the next piece is launched (GraphedStep._account):
    at the step's end the hits, expert uses per layer and layer calls equal the eager step's."""
    src, path = container(tmp_path_factory, "qwen2_moe")
    req = requirements(path, workers=1, device="cuda")
    prompt = _prompt(_vocab(src), batch, "cuda", seed=20 + batch)
    seen = []
    for graphs in (False, True):
        model, _ = zipmoe.load(path, budget=req["budget_for"](1.0), device="cuda", workers=1, warm=True)
        rt = model.zipmoe
        try:
            _, step = decode(model, prompt, graphs=graphs)
            if graphs:
                assert step.stats["graphed_layers"] > 0 and step.stats["host_layers"] == 0, step.stats
            c = rt.counters
            seen.append((dict(c.hits), json.dumps(c.uses, sort_keys=True), c.layer_calls, c.expert_calls))
        finally:
            rt.close()
    assert seen[0] == seen[1]


@pytest.mark.gpu
@CUDA
def test_graphs_refuse_what_they_cannot_serve(tmp_path_factory):
    src, path = container(tmp_path_factory, "switch_transformers")
    model, _ = zipmoe.load(path, budget="64M", device="cuda", workers=1)
    assert not supported(model, 1) and "switch_transformers" in why_not(model, 1)
    model.zipmoe.close()
    src, path = container(tmp_path_factory, "qwen2_moe")
    req = requirements(path, workers=1, device="cuda")
    model, _ = zipmoe.load(path, budget=req["budget_for"](1.0), device="cuda", workers=1)
    assert supported(model, 4) and supported(model, 16) and not supported(model, 5)
    assert "batch 5 is not one of" in why_not(model, 5)
    model.zipmoe.close()


# ---------------------------------------------------------------------------------- CPU
def _fake_tensors(layers=2, experts=4, gu=(6, 4), down=(4, 3)):
    out, uid = {}, 0
    for layer in range(layers):
        for e in range(experts):
            ts = []
            for name, shape in (("gate_up", gu), ("down", down)):
                ts.append(types.SimpleNamespace(uid=uid, name=name, shape=shape, numel=shape[0] * shape[1]))
                uid += 1
            out[(layer, e)] = ts
    return out


def test_slot_map_follows_the_cache():
    tensors = _fake_tensors()
    nbytes = {t.uid: t.numel * 2 for ts in tensors.values() for t in ts}
    pair = nbytes[0] + nbytes[1]
    slots = SlotMap(tensors, capacity=3 * pair + 5, dtype=torch.bfloat16, device="cpu", num_experts=4)
    assert {k[0]: a.slots for k, a in slots.arenas.items()} == {"gate_up": 3, "down": 3}
    cache = ExpertCache({"full": slots.nbytes})
    slots.attach(cache)
    uid = {(layer, e, t.name): t.uid for (layer, e), ts in tensors.items() for t in ts}

    def put(layer, e, uses=1):
        for name in ("gate_up", "down"):
            u = uid[(layer, e, name)]
            for _ in range(uses):
                cache.touch(u)
            t = tensors[(layer, e)][0 if name == "gate_up" else 1]
            cache.offer(u, {"full": (nbytes[u], torch.full(t.shape, float(u), dtype=torch.bfloat16))})

    put(0, 0, 3)
    put(0, 2, 2)
    put(1, 1, 2)
    # admissions write the host maps only; the device maps follow at the next flush (one copy
    # per map, before anything reads them: check() and the graphed sparse block flush first)
    assert (slots.maps["gate_up"] == -1).all() and (slots.host["gate_up"] >= 0).sum() == 3
    slots.flush()
    assert np.array_equal(slots.maps["gate_up"].numpy(), slots.host["gate_up"]) and not slots._dirty
    slots.check()
    assert slots.all_slotted(0, [0, 2]) and slots.all_slotted(1, [1]) and not slots.all_slotted(0, [1])
    # the data the cache hands out is the slot itself
    u = uid[(0, 2, "gate_up")]
    assert cache.get(u).data_ptr() == slots.arenas[("gate_up", (6, 4))].data[slots.slot_of[u]].data_ptr()
    assert torch.equal(cache.get(u), torch.full((6, 4), float(u), dtype=torch.bfloat16))
    # a hotter expert evicts the least used one; its slots are reused, the maps follow
    put(1, 3, 5)
    slots.check()
    assert cache.state_of(uid[(0, 2, "gate_up")]) is None or cache.state_of(uid[(1, 1, "gate_up")]) is None
    assert slots.all_slotted(1, [3]) and slots.all_slotted(0, [0])
    assert torch.equal(cache.get(uid[(1, 3, "down")]), torch.full((4, 3), float(uid[(1, 3, "down")]), dtype=torch.bfloat16))
    # pinned tensors are never the victim
    cache.pinned = {uid[(0, 0, "gate_up")], uid[(0, 0, "down")]}
    put(0, 1, 9)
    slots.check()
    assert slots.all_slotted(0, [0, 1])
    cache.pinned.clear()
    cache.clear()
    slots.check()
    assert all(len(a.free) == a.slots for a in slots.arenas.values())
    assert all((h == -1).all() for h in slots.host.values())


def test_slot_map_split_when_the_pool_is_small():
    tensors = _fake_tensors(layers=3, experts=4)
    pair = 2 * (24 + 12)
    slots = SlotMap(tensors, capacity=5 * pair, dtype=torch.float32, device="cpu", num_experts=4)
    # float32 slots: 96 and 48 bytes; each kind gets its share (2/3, 1/3) of the 360 bytes
    assert {k[0]: a.slots for k, a in slots.arenas.items()} == {"gate_up": 2, "down": 2}
    assert slots.nbytes <= 5 * pair
    every = SlotMap(tensors, capacity=10**9, dtype=torch.bfloat16, device="cpu", num_experts=4)
    assert all(a.slots == 12 for a in every.arenas.values())
    assert every.nbytes == sum(t.numel * 2 for ts in tensors.values() for t in ts)


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v2"])
def test_serving_through_slots_on_the_cpu_is_bit_identical(tmp_path_factory, family):
    src, path = container(tmp_path_factory, family)
    ref = reference(src)
    req = requirements(path, workers=1)
    prompt = _prompt(_vocab(src), 4, "cpu")
    want, _ = decode(ref, prompt, steps=3)
    for fraction in (1.0, 0.4):
        budget = req["budget_for"](fraction)
        model, _ = zipmoe.load(path, budget=budget, device="cpu", workers=1, slots=True)
        rt = model.zipmoe
        try:
            assert rt.slots is not None and not supported(model, 4)
            got, _ = decode(model, prompt, steps=3)
            assert all(torch.equal(a, b) for a, b in zip(want, got))
            rt.slots.check()
            assert rt.counters.peak_held_bytes <= budget
            if fraction < 1:
                assert rt.counters.hits["none"] > 0
        finally:
            rt.close()


def test_graphs_need_cuda(tmp_path_factory):
    src, path = container(tmp_path_factory, "olmoe")
    model, _ = zipmoe.load(path, budget="64M", device="cpu", workers=1)
    assert not supported(model, 1) and "CUDA" in why_not(model, 1)
    with pytest.raises(ValueError, match="CUDA"):
        GraphedStep(model, None, 1)
    model.zipmoe.close()


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_sparse_graph_bodies_compute_the_eager_experts(tmp_path_factory, monkeypatch, family):
    """What the sparse graphs capture, run eagerly on the CPU: equal to the runtime's experts function.

    Batch 1: the device-side sort, the gather through the slot map, the eager loop's ops.
    Batch 3, 4 and 16: the per-layer gathers, the per-(group, count) weight gathers and the
    per-(rank, token count) bodies fed from the host's index buffer and the runs of one-token
    ranks (replay_plan), replayed in ascending expert order (16 rows route to more experts than one weight group holds). (On CUDA the
    same bodies are captured and replayed: tests above.)
    """
    from zipmoe.runtime.engine import graphs
    from zipmoe.runtime.engine.experts_hook import routed_indices, zipmoe_experts_forward

    monkeypatch.setattr(graphs._Grouped, "_graph", staticmethod(lambda step, fn: types.SimpleNamespace(replay=fn)))
    src, path = container(tmp_path_factory, family)
    req = requirements(path, workers=1)
    model, _ = zipmoe.load(path, budget=req["budget_for"](1.0), device="cpu", workers=1, warm=True, slots=True)
    rt = model.zipmoe
    mod = next(m for m in model.modules() if hasattr(m, "_zipmoe_layer"))
    hidden_size = mod.gate_up_proj.shape[-1]
    g = torch.Generator().manual_seed(3)
    step = object.__new__(graphs.GraphedStep)  # no CUDA here: only what the bodies read
    step.slots, step.rt, step.pool, step._w = rt.slots, rt, None, {}
    ops = set()
    try:
        for batch in (1, 4, 4, 16, 3, 2):
            hidden = torch.randn((batch, hidden_size), generator=g).to(torch.bfloat16)
            ids = torch.stack([torch.randperm(rt.num_experts, generator=g)[:rt.top_k] for _ in range(batch)])
            weights = torch.rand((batch, rt.top_k), generator=g).to(torch.bfloat16)
            with torch.no_grad():
                want = zipmoe_experts_forward(mod, hidden, ids, weights)
                sp = graphs._Sparse(mod, hidden, ids, weights, torch.zeros_like(hidden))
                if batch == 1:
                    rt.slots.flush()  # as _sparse_step does before every replay of this body
                    step._sparse_graph_body(sp)
                else:
                    grouped = graphs._Grouped(step, sp)
                    if batch == 16:  # the layer's prologue as its graph would replay it
                        sp.prologue = grouped.prologue_graph(sp)
                    experts, index, sizes = routed_indices(ids, rt.num_experts)
                    grouped.run(sp, experts, index, sizes, rt.slots)
                    ops.update(op for op, _, _ in graphs.replay_plan(sizes, grouped.G))
            assert torch.equal(sp.out, want), f"batch {batch}"
        assert ops == {"gather", "one", "run"}  # runs of one-token experts and lone ranks both ran
    finally:
        rt.close()


# ------------------------------------------------------------------- --kernels fast
def _grouped_mm_reference(src, device):
    import warnings

    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16, experts_implementation="grouped_mm")
    return m.to(device).eval()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, CUDA])])
@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_fast_kernels_match_transformers_grouped_mm(tmp_path_factory, family, device):
    """kernels="fast": bit-identical to transformers with experts_implementation="grouped_mm"
    (eager steps on the CPU, the graphed step on CUDA: one graph for the whole step)."""
    src, path = container(tmp_path_factory, family)
    ref = _grouped_mm_reference(src, device)
    req = requirements(path, workers=1, device=device)
    for batch in (1, 4):
        prompt = _prompt(_vocab(src), batch, device, seed=10 + batch)
        want, _ = decode(ref, prompt)
        model, _ = zipmoe.load(path, budget=req["budget_for"](1.0), device=device, workers=1, kernels="fast")
        try:
            graphs = supported(model, batch)
            assert graphs == (device == "cuda")
            read = model.zipmoe.counters.bytes_read
            got, step = decode(model, prompt, graphs=graphs)
            for i, (a, b) in enumerate(zip(want, got)):
                assert torch.equal(a, b), f"{family} batch {batch}: logits differ at step {i}"
            if graphs:
                assert len(step.pieces) == 1 and not step.sparse  # nothing breaks the graph
            assert model.zipmoe.counters.bytes_read == read  # every expert was loaded at once
        finally:
            model.zipmoe.close()


def test_fast_kernels_refuse_what_they_cannot_serve(tmp_path_factory):
    from zipmoe.errors import UsageError

    src, path = container(tmp_path_factory, "olmoe")
    req = requirements(path, workers=1)
    with pytest.raises(UsageError, match="every expert resident"):
        zipmoe.load(path, budget=req["budget_for"](0.5), workers=1, kernels="fast")
    with pytest.raises(UsageError, match="unknown kernels"):
        zipmoe.load(path, budget=req["budget_for"](1.0), workers=1, kernels="quick")
    src, path = container(tmp_path_factory, "switch_transformers")
    with pytest.raises(UsageError, match="fused families"):
        zipmoe.load(path, budget="64M", workers=1, kernels="fast")


def test_static_mask_computes_what_the_loops_mask_computes(tmp_path_factory):
    """The decode loop's hook passes None (no padding) or the [batch, seen] mask; the graphs take
    [batch, context]: static_mask's mask gives the same logits (CPU, eager; batch 1 without and
    batch 3 with left padding)."""
    from transformers import StaticCache

    from zipmoe.runtime.engine.step import static_mask

    src, path = container(tmp_path_factory, "qwen2_moe")
    ref = reference(src)
    ctx = 24
    for batch, padded in ((1, False), (3, True)):
        prompt = _prompt(_vocab(src), batch, "cpu", seed=5)
        mask = torch.ones_like(prompt)
        if padded:
            mask[1, :3] = 0
            mask[2, :1] = 0
        outs = []
        for convert in (False, True):
            cache = StaticCache(config=ref.config, max_cache_len=ctx)
            pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
            m = mask if padded else None
            with torch.no_grad():
                logits = ref(input_ids=prompt, attention_mask=m, position_ids=pos, **{cache_kw(ref): cache}).logits[:, -1]
                got = []
                for _ in range(4):
                    nxt = logits.argmax(-1, keepdim=True)
                    pos = pos[:, -1:] + 1
                    if m is not None:
                        m = torch.cat([m, m.new_ones((batch, 1))], dim=-1)
                    use = static_mask(m, pos, ctx) if convert else m
                    logits = ref(input_ids=nxt, attention_mask=use, position_ids=pos, **{cache_kw(ref): cache},
                                 logits_to_keep=1).logits[:, -1]
                    got.append(logits)
            outs.append(got)
        assert all(torch.equal(a, b) for a, b in zip(*outs)), f"batch {batch}"
    assert torch.equal(static_mask(None, torch.tensor([[2], [2]]), 4), torch.tensor([[1, 1, 1, 0]] * 2))


def _loop_style(model, prompt, mask, ctx, steps, graphed):
    """What engine/loop.py's DecodeLoop feeds its hook: position ids, the mask so far or None."""
    from transformers import StaticCache

    batch = prompt.shape[0]
    cache = StaticCache(config=model.config, max_cache_len=ctx)
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    m = None if bool((mask == 1).all()) else mask
    step = GraphedStep(model, cache, batch=batch) if graphed else None
    out = []
    with torch.no_grad():
        logits = model(input_ids=prompt, attention_mask=m, position_ids=pos, **{cache_kw(model): cache}).logits[:, -1]
        for _ in range(steps):
            nxt = logits.argmax(-1, keepdim=True)
            pos = pos[:, -1:] + 1
            if m is not None:
                m = torch.cat([m, m.new_ones((batch, 1))], dim=-1)
            if step is None:
                logits = model(input_ids=nxt, attention_mask=m, position_ids=pos, **{cache_kw(model): cache},
                               use_cache=True, logits_to_keep=1).logits[:, -1]
            else:
                logits = step(nxt, pos, m)
            out.append(logits.clone())
    return out


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("family", ["qwen2_moe", "olmoe"])
def test_graphed_step_in_the_decode_loops_form(tmp_path_factory, family):
    """GraphedStep as the decode loop calls it: position ids, the mask so far
    (None without padding), [batch, vocab] logits equal to the loop's eager forward."""
    src, path = container(tmp_path_factory, family)
    ref = reference(src, "cuda")
    req = requirements(path, workers=1, device="cuda")
    model, _ = zipmoe.load(path, budget=req["budget_for"](1.0), device="cuda", workers=1, warm=True)
    try:
        for batch, padded in ((1, False), (4, True)):
            prompt = _prompt(_vocab(src), batch, "cuda", seed=7)
            mask = torch.ones_like(prompt)
            if padded:
                mask[1, :3] = 0
            want = _loop_style(ref, prompt, mask, CONTEXT, STEPS, graphed=False)
            got = _loop_style(model, prompt, mask, CONTEXT, STEPS, graphed=True)
            for i, (a, b) in enumerate(zip(want, got)):
                assert torch.equal(a, b), f"{family} batch {batch}: logits differ at step {i}"
    finally:
        model.zipmoe.close()


def test_replay_plan_covers_every_rank_once_in_order():
    """_Grouped's replays: every hit rank once, ascending; runs only of one-token ranks inside one
    weight group; each group's gather before its ranks (the kernels of one graph per rank)."""
    from zipmoe.runtime.engine.graphs import replay_plan

    assert replay_plan([1, 1, 2, 1, 1, 1, 3], 4) == [
        ("gather", 0, 4), ("run", 0, 2), ("one", 2, 2), ("one", 3, 1),
        ("gather", 1, 3), ("run", 4, 2), ("one", 6, 3)]
    assert replay_plan([2, 2], 4) == [("gather", 0, 2), ("one", 0, 2), ("one", 1, 2)]
    assert replay_plan([1] * 9, 4) == [("gather", 0, 4), ("run", 0, 4), ("gather", 1, 4), ("run", 4, 4),
                                       ("gather", 2, 1), ("one", 8, 1)]
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        sizes = torch.randint(1, 4, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
        group = int(torch.randint(1, 6, (1,), generator=g))
        ranks, gathered = [], -1
        for op, a, b in replay_plan(sizes, group):
            if op == "gather":
                assert a == gathered + 1 and b == min(group, len(sizes) - a * group)
                gathered = a
                continue
            r = list(range(a, a + b)) if op == "run" else [a]
            assert all(j // group == gathered for j in r)
            if op == "run":
                assert b >= 2 and all(sizes[j] == 1 for j in r)
            else:
                assert b == sizes[a]
            ranks += r
        assert ranks == list(range(len(sizes)))
