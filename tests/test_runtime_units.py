"""Runtime parts one at a time: cache policy, store reads, budget limits, errors, traces, Ctrl-C."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

import zipmoe
from zipmoe.errors import BudgetError, ChecksumError, DeviceError, ModelError
from zipmoe.runtime.engine.cache import ExpertCache
from zipmoe.runtime.engine.counters import Counters, delta
from zipmoe.runtime.engine.families import family_for, supported_names
from zipmoe.runtime.engine.loader import requirements, resolve_device
from zipmoe.runtime.engine.reads import ExpertStore
from zipmoe.runtime.engine.trace import read_trace

from test_runtime_fixtures import container, inputs, reference


# ----------------------------------------------------------------------------- cache policy
def test_cache_admits_more_frequent_only_and_keeps_one_state():
    c = ExpertCache({"full": 100, "compressed": 60})
    for uid in (1, 2):
        c.touch(uid)
        assert c.offer(uid, {"full": (50, f"t{uid}")}) == "full"
    c.touch(3)  # same count as the residents: stays out of full, goes to compressed
    assert c.offer(3, {"full": (50, "t3"), "compressed": (30, "c3")}) == "compressed"
    for _ in range(2):
        c.touch(3)
    c.touch(2)  # 1 used once, 2 twice, 3 three times: 3 evicts 1 (least used)
    assert c.offer(3, {"full": (50, "t3")}) == "full"
    assert c.state_of(1) is None and c.state_of(2) == "full" and c.state_of(3) == "full"
    assert c.pools["compressed"].used == 0  # promoted out of compressed: one state per tensor
    assert c.pools["full"].used == 100
    # pinned tensors are never evicted
    for _ in range(5):
        c.touch(4)
    c.pinned = {2, 3}
    assert c.offer(4, {"full": (50, "t4")}) is None
    c.pinned = set()
    assert c.offer(4, {"full": (50, "t4")}) == "full" and c.state_of(2) is None
    assert c.used_bytes() == 100


def test_cache_cascade_moves_a_compressed_victim_down_with_what_it_keeps():
    from zipmoe.runtime.engine.device_side import demote

    def parts(n, v):
        return [np.full(n, v, np.uint8)]

    caps = {"compressed": 100, "sm_only": 0, "e_only": 40}
    for cascade in (False, True):
        c = ExpertCache(caps, demote=demote if cascade else None)
        c.touch(1)
        e1, s1 = parts(20, 1), parts(70, 2)
        assert c.offer(1, {"compressed": (90, (e1, s1))}) == "compressed"
        for _ in range(2):
            c.touch(2)  # hotter: evicts 1 from the compressed pool
        assert c.offer(2, {"compressed": (90, (parts(20, 3), parts(70, 4)))}) == "compressed"
        if not cascade:
            assert c.state_of(1) is None and c.demotions == 0
            continue
        # 1 keeps its E bytes in the E-only pool (the SM-only pool has no room): the same arrays,
        # which own their bytes (views of read buffers would be copied: tests/test_adopt.py)
        assert c.state_of(1) == "e_only" and c.get(1)[0] is e1[0] and c.demotions == 1
        assert c.pools["e_only"].used == 20 and c.pools["compressed"].used == 90
        # a colder victim cannot push a hotter tensor out of the lower pool
        c.touch(3)
        c.offer(3, {"e_only": (10, parts(10, 5))})  # fits beside 1
        for _ in range(5):
            c.touch(4)
        c.touch(1)
        c.touch(1)  # 1 now used twice (once more than 3)
        assert c.offer(4, {"compressed": (90, (parts(25, 6), parts(65, 7)))}) == "compressed"
        # 2 (used twice) was evicted; the E-only pool has 10 bytes free beside 1 (used three
        # times) and 3 (once): 2 pushes 3 out (used less), not 1
        assert c.state_of(2) == "e_only" and c.state_of(1) == "e_only" and c.state_of(3) is None
        assert c.pools["e_only"].used == 40 and c.demotions == 2


def test_cache_ties_go_to_the_least_recent():
    c = ExpertCache({"full": 100})
    for uid in (1, 2):
        c.touch(uid)
        c.offer(uid, {"full": (50, uid)})
    c.touch(2)
    c.touch(1)  # both used twice; 2 less recently
    for _ in range(3):
        c.touch(9)
    assert c.offer(9, {"full": (50, 9)}) == "full"
    assert c.state_of(2) is None and c.state_of(1) == "full"


# ----------------------------------------------------------------------------- store
def test_store_reads_same_bytes_direct_or_not(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 3 * 4096 + 123, dtype=np.uint8)
    p = tmp_path / "f.bin"
    p.write_bytes(data.tobytes())
    for direct in (True, False):
        c = Counters()
        s = ExpertStore(p, c, direct=direct)
        for off, ln in ((0, 10), (4095, 2), (5000, 7000), (3 * 4096, 123)):
            assert np.array_equal(s.read(off, ln), data[off:off + ln])
        assert c.bytes_read == 10 + 2 + 7000 + 123 and c.reads == 4
        assert c.bytes_read_disk >= c.bytes_read
        s.close()


def test_counters_delta():
    c = Counters()
    a = c.snapshot()
    c.add_read(10, 4096, 0.5)
    c.add_hit("full")
    c.add_hit(None)
    c.add_layer(3, 0.25, 2)
    d = delta(c.snapshot(), a)
    assert d["bytes_read"] == 10 and d["hits"]["full"] == 1 and d["hits"]["none"] == 1
    assert d["layer_makespan_s"]["3"][1] == 1 and d["time_s"]["read"] == 0.5
    json.dumps(c.snapshot())


# ----------------------------------------------------------------------------- bad input
def test_unknown_architecture_lists_supported():
    with pytest.raises(ModelError) as e:
        family_for({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    msg = str(e.value)
    assert "LlamaForCausalLM" in msg and all(n in msg for n in supported_names())


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_cuda_without_gpu():
    with pytest.raises(DeviceError):
        resolve_device("cuda")
    assert resolve_device("auto").type == "cpu"


def test_budget_minimum_is_exact(tmp_path_factory):
    _, path = container(tmp_path_factory, "qwen3_moe")
    req = requirements(path, workers=1)
    with pytest.raises(BudgetError) as e:
        zipmoe.load(path, budget=req["min_budget"] - 1, workers=1)
    assert str(req["min_budget"]) in str(e.value) and "at least" in str(e.value)
    model, _ = zipmoe.load(path, budget=req["min_budget"], workers=1)
    assert model.zipmoe.window == 1 and sum(model.zipmoe.pools.values()) == 0
    model.zipmoe.close()


@pytest.mark.parametrize("workers", [1, 2])  # 2: each E chunk is a decode job of its own
def test_corrupted_chunk_names_the_tensor_and_never_computes(tmp_path_factory, tmp_path, workers):
    src, path = container(tmp_path_factory, "qwen3_moe")
    bad = tmp_path / "bad.zmoe"
    shutil.copy(path, bad)
    from zipmoe.codecs.reader import ContainerReader

    with ContainerReader(bad) as r:
        layer0 = min(e.layer for e in r.entries if e.role == "expert")
        chunks = [(e.name, [c for c in e.chunks if c.kind == "exp"][0]) for e in r.entries
                  if e.role == "expert" and e.layer == layer0]
    with open(bad, "r+b") as f:
        for _, c in chunks:
            f.seek(c.offset + c.length // 2)
            b = f.read(1)
            f.seek(c.offset + c.length // 2)
            f.write(bytes([b[0] ^ 0x01]))
    model, _ = zipmoe.load(bad, budget="64M", workers=workers)
    rt = model.zipmoe
    batch = inputs(json.loads((src / "config.json").read_text())["vocab_size"], False, batch=1)
    with pytest.raises(ChecksumError) as e, torch.no_grad():
        model(**batch)
    assert "checksum mismatch" in str(e.value) and str(e.value).split()[1] in {n for n, _ in chunks}
    assert rt._inflight == 0 and not rt.cache.pinned
    assert rt.cache.used_bytes() == 0  # nothing of layer 0 was admitted (its tensors all failed)
    rt.close()


def test_plan_larger_than_budget_is_scaled(tmp_path_factory):
    _, path = container(tmp_path_factory, "olmoe")
    req = requirements(path, workers=1)
    probe, _ = zipmoe.load(path, budget=req["min_budget"], workers=1)
    cid = probe.zipmoe.container_id
    probe.zipmoe.close()
    plan = {"container_id": cid, "pools": {"full": 10 << 30, "compressed": 10 << 30}}
    model, _ = zipmoe.load(path, budget=req["budget_for"](0.5), workers=1, plan=plan)
    rt = model.zipmoe
    assert rt.pools["full"] == rt.pools["compressed"] > 0
    assert rt.held_bytes() + sum(rt.pools.values()) - rt.cache.used_bytes() <= rt.budget
    rt.close()


# ----------------------------------------------------------------------------- trace, Ctrl-C
def test_trace_records_every_step(tmp_path_factory, tmp_path):
    src, path = container(tmp_path_factory, "switch_transformers")
    model, _ = zipmoe.load(path, budget="64M", workers=1)
    rt = model.zipmoe
    out = tmp_path / "t.jsonl"
    rt.start_trace(out)
    batch = inputs(json.loads((src / "config.json").read_text())["vocab_size"], True, batch=2)
    with torch.no_grad():
        model(**batch)
        model(**batch)
    rt.stop_trace()
    header, steps = read_trace(out, container_id=rt.container_id)
    assert header["container_id"] == rt.container_id and header["num_experts"] == 8
    assert len(steps) == 2
    layers = steps[0]
    assert set(layers) == {str(x) for x in header["layers"]}
    enc = str(header["layers"][0])
    assert len(layers[enc]) == batch["input_ids"].numel() and all(len(x) <= 1 for x in layers[enc])
    # each step carries its input's [batch, sequence] (the planner counts decode steps by it)
    _, marked = read_trace(out, with_input=True)
    assert [shape for _, shape in marked] == [list(batch["input_ids"].shape)] * 2
    with pytest.raises(ModelError):
        read_trace(out, container_id="other")
    rt.close()


def test_ctrl_c_stops_the_answer_and_keeps_the_runtime_consistent(tmp_path_factory):
    from zipmoe.runtime.engine.turn import chat_turn

    src, path = container(tmp_path_factory, "mixtral")
    req = requirements(path, workers=1)
    model, _ = zipmoe.load(path, budget=req["min_budget"], workers=1)
    rt = model.zipmoe
    batch = inputs(json.loads((src / "config.json").read_text())["vocab_size"], False, batch=1)
    seen = []

    def on_text(t):
        seen.append(t)
        if len(seen) == 2:
            raise KeyboardInterrupt

    res = chat_turn(model, None, batch, max_new_tokens=8, greedy=True, on_text=on_text)
    assert res.interrupted and len(res.token_ids) == 2
    assert rt._inflight == 0 and not rt.cache.pinned
    ref = reference(src)
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, ref(**batch).logits)
    rt.close()


def test_an_encoder_decoder_turn_is_model_generate(tmp_path_factory):
    """chat_turn on an encoder-decoder model (no decode loop: model.generate, under
    inference_mode) answers transformers' greedy tokens."""
    from zipmoe.runtime.engine.turn import chat_turn

    src, path = container(tmp_path_factory, "switch_transformers")
    req = requirements(path, workers=1)
    model, _ = zipmoe.load(path, budget=req["budget_for"](0.5), workers=1)
    batch = inputs(json.loads((src / "config.json").read_text())["vocab_size"], False, batch=1)
    try:
        res = chat_turn(model, None, batch, max_new_tokens=5, greedy=True)
        with torch.no_grad():
            want = reference(src).generate(**batch, max_new_tokens=5, do_sample=False)[0, 1:].tolist()
        assert res.token_ids == want and res.stats["new_tokens"] == len(want) >= 1
    finally:
        model.zipmoe.close()


@pytest.mark.parametrize("device_merge", [True, False])
def test_device_paths_forced_on_the_cpu(tmp_path_factory, device_merge):
    """The CUDA staging code (E and SM bytes to the device and a kernels.merge there, or a
    host merge and a copy), run on CPU tensors: same logits. The real thing runs with -m gpu."""
    src, path = container(tmp_path_factory, "olmoe")
    req = requirements(path, workers=2)
    model, _ = zipmoe.load(path, budget=req["budget_for"](0.3), workers=2)
    rt = model.zipmoe
    from zipmoe.runtime.engine.staging import StagingRing

    rt.fetcher.device = rt.device_side(StagingRing(rt.window, rt.staging_slot_bytes, pin=False), device_merge=device_merge)
    ref = reference(src)
    for seed in range(3):
        batch = inputs(json.loads((src / "config.json").read_text())["vocab_size"], False, batch=2, seed=seed)
        with torch.no_grad():
            assert torch.equal(model(**batch).logits, ref(**batch).logits)
    assert rt.counters.hits["none"] > 0 and rt._inflight == 0
    rt.close()


def test_inference_mode_then_grad_mode(tmp_path_factory):
    """Experts cached under torch.inference_mode() still serve a later forward with grad on."""
    src, path = container(tmp_path_factory, "mixtral")
    ref = reference(src)
    model, _ = zipmoe.load(path, budget="64M", workers=1)
    batch = inputs(json.loads((src / "config.json").read_text())["vocab_size"], False, batch=2)
    with torch.inference_mode():
        a = model(**batch).logits.clone()
    b = model(**batch).logits.detach()
    want = ref(**batch).logits.detach()
    assert torch.equal(b, want)
    with torch.no_grad():
        assert torch.equal(a, ref(**batch).logits)
    model.zipmoe.close()


# ----------------------------------------------------------------------------- experts hook: host indices
@pytest.mark.parametrize("top_k", [1, 2, 3, 4])
def test_host_indices_are_torch_where_of_the_eager_mask(top_k):
    """routed_indices/switch_indices give, per hit expert, exactly torch.where(expert_mask[e]) (values,
    order and dtype) and the eager hit list, without building the mask: the hook gathers with them."""
    from zipmoe.runtime.engine.experts_hook import per_expert, routed_indices, switch_indices

    g = torch.Generator().manual_seed(top_k)
    num_experts = 5  # few experts, so several tokens share one
    shared = 0
    for batch in range(1, 6):
        for seq in (1, 3):  # decode and prefill shapes
            tokens = batch * seq
            # distinct experts per token; the id num_experts ("no expert") appears now and then
            ids = torch.stack([torch.randperm(num_experts + 1, generator=g)[:top_k] for _ in range(tokens)])
            mask = torch.nn.functional.one_hot(ids, num_classes=num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()[:, 0].tolist()
            experts, index, sizes = routed_indices(ids, num_experts)
            assert experts == [e for e in hit if e != num_experts]
            assert index.dtype == torch.int64 and index.shape[1] == int((ids != num_experts).sum())
            shared += sum(n > 1 for n in sizes)
            parts = per_expert(experts, index, sizes)
            assert list(parts) == experts
            for e in experts:
                top_k_pos, token_idx = torch.where(mask[e])
                assert torch.equal(parts[e][0], top_k_pos) and torch.equal(parts[e][1], token_idx)

            # SwitchTransformers: a [tokens, 1, E] one_hot mask, some tokens dropped (over capacity)
            sel = torch.nn.functional.one_hot(ids[:, :1] % num_experts, num_classes=num_experts)
            sel[torch.rand(tokens, generator=g) < 0.2] = 0
            smask = sel.permute(2, 1, 0)
            experts, index, sizes = switch_indices(sel)
            assert experts == torch.greater(smask.sum(dim=(-1, -2)), 0).nonzero()[:, 0].tolist()
            parts = per_expert(experts, index, sizes)
            for e in experts:
                idx, top_x = torch.where(smask[e])
                assert torch.equal(parts[e][0], idx) and torch.equal(parts[e][1], top_x)
    assert shared >= 5  # experts with several tokens were exercised
    with pytest.raises(ValueError):
        routed_indices(torch.tensor([[num_experts + 1]]), num_experts)
    assert routed_indices(torch.empty((0, top_k), dtype=torch.int64), num_experts)[0] == []


def test_chunk_jobs_and_reused_read_buffers_stay_bit_identical(tmp_path_factory):
    """Tensors of several E chunks (small shards), decoded one job per chunk by 2 workers, read
    into reused buffers: logits equal to eager, buffers reused when the window has room for idle
    ones (not at the smallest budget, whose window is one expert), and the held bytes (idle
    buffers included) never above the budget."""
    from zipmoe.codecs.writer import pack

    src, _ = container(tmp_path_factory, "olmoe")
    path = tmp_path_factory.mktemp("shards") / "small-shards.zmoe"
    pack(src, path, shard_size=512, force=True)
    from zipmoe.codecs.reader import ContainerReader

    with ContainerReader(path) as r:
        per_entry = [sum(1 for c in e.chunks if c.kind == "exp") for e in r.entries if e.role == "expert"]
    assert min(per_entry) >= 2  # every expert tensor really is split into several jobs
    ref = reference(src)
    req = requirements(path, workers=2)
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    for budget, reuse in ((req["min_budget"], False), (req["budget_for"](0.25), True)):
        model, _ = zipmoe.load(path, budget=budget, workers=2)
        rt = model.zipmoe
        for seed in range(3):
            batch = inputs(vocab, False, batch=2, seed=seed)
            with torch.no_grad():
                assert torch.equal(model(**batch).logits, ref(**batch).logits)
        buf = rt.store.buffers
        assert buf.made > 0
        if reuse:
            assert rt.window > 1 and buf.reused > buf.made, (buf.reused, buf.made)
        assert rt.counters.peak_held_bytes <= budget
        assert rt._inflight == 0
        rt.close()


def test_ctrl_c_while_a_cached_expert_computes_waits_for_the_fetches_in_flight(tmp_path_factory):
    """Fully cached experts compute while the others load: a Ctrl-C there must still let the
    fetches in flight finish and release their bytes (it used to skip that and leak them)."""
    src, path = container(tmp_path_factory, "mixtral")
    req = requirements(path, workers=2)
    model, _ = zipmoe.load(path, budget=req["budget_for"](0.5), workers=2)
    rt = model.zipmoe
    sched = rt.fetcher
    run = sched.run
    hit = {"n": 0}

    def run_interrupting(layer, experts, compute, *rest):
        def first_compute_interrupts(e, weights):
            cached = all(rt.cache.state_of(t.uid) == "full" for t in rt.expert_tensors[(layer, e)])
            if cached and rt._inflight > 0 and hit["n"] == 0:  # a cached expert, fetches in flight
                hit["n"] += 1
                raise KeyboardInterrupt
            return compute(e, weights)

        return run(layer, experts, first_compute_interrupts, *rest)

    sched.run = run_interrupting
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    ref = reference(src)
    for seed in range(20):
        batch = inputs(vocab, False, batch=4, seed=seed)
        try:
            with torch.no_grad():
                model(**batch)
        except KeyboardInterrupt:
            break
    assert hit["n"] == 1, "no layer computed a cached expert while a fetch was in flight"
    assert rt._inflight == 0 and not rt.cache.pinned
    sched.run = run
    batch = inputs(vocab, False, batch=4, seed=7)
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, ref(**batch).logits)
    assert rt._inflight == 0
    rt.close()


def test_ctrl_c_while_queueing_a_split_decode_leaves_no_job_running(tmp_path_factory):
    """A compressed hit's decode is one job per E chunk. Queued from the serving thread one by
    one, a Ctrl-C between two of them left the queued ones running unwatched (their tensor
    was never counted as submitted, so the layer's Ctrl-C handler did not wait for them) while
    the layer released their bytes. Now the serving thread queues one job that fans out."""
    import threading
    import time as _time

    src, path = container(tmp_path_factory, "mixtral")
    req = requirements(path, workers=2)
    model, _ = zipmoe.load(path, budget=req["budget_for"](0.9), workers=2)
    rt = model.zipmoe
    sched = rt.fetcher
    total = rt.cache.capacity_bytes()
    rt.cache.pools["full"].capacity, rt.cache.pools["compressed"].capacity = 0, total  # compressed hits only
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    ref = reference(src)
    batch = inputs(vocab, False, batch=4, seed=1)
    with torch.no_grad():
        model(**batch)  # fills the compressed pool
    assert rt.cache.pools["compressed"].used > 0

    running = {"n": 0}
    lock = threading.Lock()
    piece, submit = sched.decoder._piece, sched.decoder.pool.submit

    def slow_piece(*a):
        with lock:
            running["n"] += 1
        try:
            _time.sleep(0.05)
            return piece(*a)
        finally:
            with lock:
                running["n"] -= 1

    calls = {"main": 0}

    def submit_interrupting(rank, fn, *args):
        if threading.current_thread() is threading.main_thread():
            calls["main"] += 1
            if calls["main"] == 2:  # the second job the serving thread queues
                raise KeyboardInterrupt
        return submit(rank, fn, *args)

    sched.decoder._piece = slow_piece
    sched.decoder.pool.submit = submit_interrupting
    with pytest.raises(KeyboardInterrupt):
        with torch.no_grad():
            model(**batch)
    assert calls["main"] == 2
    with lock:
        assert running["n"] == 0, "decode jobs still running after the layer gave their bytes back"
    assert rt._inflight == 0 and not rt.cache.pinned
    sched.decoder._piece, sched.decoder.pool.submit = piece, submit
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, ref(**batch).logits)
    rt.close()


def test_decode_clock_times_the_decode_steps_alone():
    """The streamer of the profile and of planner_check: the counters from the prefill's token on."""
    from zipmoe.runtime.engine.counters import Counters, DecodeClock

    c = Counters()
    between = []
    clock = DecodeClock(c, between_steps=lambda: between.append(1))
    c.add_read(10, 10, 0.1)  # the prefill's read: before the first token, not counted
    for _ in range(4):  # the prompt, then three new tokens
        clock.put(None)
        c.add_read(10, 10, 0.1)
    assert len(clock.steps()) == 2 and all(s >= 0 for s in clock.steps())
    assert clock.delta()["reads"] == 3 and len(between) == 4
