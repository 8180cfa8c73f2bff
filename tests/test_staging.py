"""The device side of a fetch (runtime/engine/staging.py): the pinned staging ring, the copy
stream, the allocator rounding the budget counts; and the forced CUDA paths on the CPU, with a
ring smaller than the work so that its slots are reused. The reference of the logits checks is
transformers computing the same checkpoint with eager experts (test_runtime_fixtures.reference)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import zipmoe
from zipmoe.runtime.engine.loader import requirements
from zipmoe.runtime.engine.staging import PAGE, CopyStream, StagingRing, cuda_block_bytes, own_device

from test_runtime_fixtures import container, inputs, reference


def test_cuda_block_bytes_rounds_as_the_caching_allocator():
    assert cuda_block_bytes(1) == 512
    assert cuda_block_bytes(512) == 512
    assert cuda_block_bytes(513) == 1024
    assert cuda_block_bytes(10 << 20) == 10 << 20  # split from a shared segment: 512-byte rounding
    assert cuda_block_bytes((10 << 20) + 1) == 12 << 20  # a block of its own: 2 MiB rounding
    assert cuda_block_bytes(17_301_504) == 18 << 20  # a qwen1.5-moe expert's bf16 bytes


class _Event:
    def __init__(self, done: bool) -> None:
        self.done = done
        self.synced = 0

    def query(self) -> bool:
        self.queries = getattr(self, "queries", 0) + 1
        return self.done

    def synchronize(self) -> None:
        self.synced += 1
        self.done = True


def test_ring_reuses_its_slots_and_waits_only_for_a_copy_not_yet_run():
    ring = StagingRing(2, 1000, pin=False)
    assert ring.slot_bytes == 1024 and ring.nbytes == -(-2048 // PAGE) * PAGE
    a, b = ring.acquire(), ring.acquire()
    assert {a, b} == {0, 1} and not ring.free
    ring.view(a, 10)[:] = 7
    assert int(ring.view(a, 10).sum()) == 70 and ring.view(b, 1024).numel() == 1024
    ran, pending = _Event(True), _Event(False)
    ring.release(a, ran)
    ring.release(b, pending)
    assert ring.acquire() == a and ring.waits == 0 and ran.synced == 0  # its copy already ran
    assert ring.acquire() == b and ring.waits == 1 and pending.synced == 1  # waited for its copy
    ring.release(a)
    ring.release(b)
    assert len(ring.free) == 2


def test_reap_forgets_copies_that_ran_so_acquire_asks_the_device_nothing():
    """The stager reaps after each release: slots whose copies ran lose their events, oldest
    first, up to the first copy still running; the serving thread's acquire then asks nothing
    of them, and still waits for a copy that had not run."""
    ring = StagingRing(3, 1000, pin=False)
    a, b, c = ring.acquire(), ring.acquire(), ring.acquire()
    ran, running, later = _Event(True), _Event(False), _Event(True)
    ring.release(a, ran)
    ring.release(b, running)
    ring.release(c, later)
    ring.reap()
    assert ring.events[a] is None and ring.events[b] is running and ring.events[c] is later  # stopped at b
    assert ring.acquire() == a and ran.queries == 1  # the reap's query, none by acquire
    assert ring.acquire() == b and ring.waits == 1 and running.synced == 1
    ring.reap()  # b's entry: its slot was taken meanwhile and its event cleared; c's copy ran
    assert ring.events[c] is None and not ring._unreaped
    ring.release(a, _Event(False))
    ring.release(b)
    assert list(ring._unreaped) == [a] and ring.events[b] is None


def test_copy_stream_merges_a_whole_expert_in_one_go_on_the_cpu():
    from zipmoe.kernels import split

    class T:
        def __init__(self, numel):
            self.numel = numel

    ts = [T(100), T(37), T(64)]
    offs, n = CopyStream.layout(ts)
    assert offs == [0, 128, 192] and n == 256  # each part 64-element aligned
    ring = StagingRing(1, 2 * n, pin=False)
    g = torch.Generator().manual_seed(0)
    want = [torch.randn(t.numel, generator=g).to(torch.bfloat16) for t in ts]
    for device_merge in (True, False):
        cs = CopyStream("cpu", ring, device_merge)
        slot = ring.acquire()
        host = ring.view(slot, 2 * n)
        for w, o in zip(want, offs):
            if device_merge:
                e = np.empty(w.numel(), np.uint8)
                s = np.empty(w.numel(), np.uint8)
                split(w.view(torch.int16).numpy().view(np.uint16), e, s)
                host[o : o + w.numel()] = torch.from_numpy(e)
                host[n + o : n + o + w.numel()] = torch.from_numpy(s)
            else:
                host[2 * o : 2 * (o + w.numel())].view(torch.bfloat16)[:] = w
        out = cs.alloc_out(n)
        assert cs.stage(slot, n, out) is None  # synchronous on the CPU
        ring.release(slot)
        for w, o in zip(want, offs):
            assert torch.equal(out[o : o + w.numel()].view(torch.int16), w.view(torch.int16))


def test_a_view_of_a_group_buffer_is_copied_before_a_pool_keeps_it():
    buf = torch.arange(10, dtype=torch.float32)
    v = buf[2:5]
    kept = own_device(v)
    assert torch.equal(kept, v) and kept.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr()
    whole = torch.arange(4, dtype=torch.float32)
    assert own_device(whole) is whole


@pytest.mark.parametrize("device_merge", [True, False])
def test_forced_device_paths_with_a_small_ring_are_bit_identical(tmp_path_factory, device_merge):
    """Budget at the minimum: a window of one expert, so every fetch reuses the one staging
    slot; prefetch on, so prefetched groups are staged (and dropped) too."""
    src, path = container(tmp_path_factory, "qwen2_moe")
    req = requirements(path, workers=2)
    model, _ = zipmoe.load(path, budget=req["min_budget"] + 4096, workers=2, prefetch=True)
    rt = model.zipmoe
    assert rt.window == 1
    from zipmoe.runtime.engine.staging import StagingRing

    rt.fetcher.device = rt.device_side(StagingRing(rt.window, rt.staging_slot_bytes, pin=False), device_merge=device_merge)
    ref = reference(src)
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    for seed in range(2):
        batch = inputs(vocab, False, batch=2, seed=seed)
        with torch.no_grad():
            assert torch.equal(model(**batch).logits, ref(**batch).logits)
    ring = rt.fetcher.device.copies.ring
    assert ring.slots == 1 and len(ring.free) == 1  # every slot back in the ring
    assert rt.counters.hits["none"] > 0 and rt._inflight == 0
    rt.close()


def test_groups_are_staged_by_the_stager_thread(tmp_path_factory, monkeypatch):
    """The copy (and merge) of a finished group is queued by the one stager thread, handed the
    group by the reader or decode thread that finished its last fetch: not by the serving thread
    (whose host work it was), nor by the many reader and decode threads (which contended for the
    driver); a stage that fails reaches the serving thread as that layer's error, and the
    pipeline stays usable."""
    import threading

    from zipmoe.errors import ServingError
    from zipmoe.runtime.engine.device_side import DeviceSide
    from zipmoe.runtime.engine.staging import StagingRing

    src, path = container(tmp_path_factory, "qwen2_moe")
    req = requirements(path, workers=2)
    model, _ = zipmoe.load(path, budget=req["min_budget"] + 4096, workers=2, prefetch=True)
    rt = model.zipmoe
    rt.fetcher.device = rt.device_side(StagingRing(rt.window, rt.staging_slot_bytes, pin=False), device_merge=True)
    serving = threading.current_thread()
    where = []
    orig = DeviceSide.stage

    def stage(self, g):
        if g.slot is not None:
            where.append(threading.current_thread().name)
        return orig(self, g)

    monkeypatch.setattr(DeviceSide, "stage", stage)
    ref = reference(src)
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    batch = inputs(vocab, False, batch=2, seed=5)
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, ref(**batch).logits)
    assert where and set(where) == {"zipmoe-stage-0"}, where
    assert serving.name not in where
    assert rt.counters.time_s["stage"] > 0

    def broken(self, g):
        raise RuntimeError("copy engine on fire")

    monkeypatch.setattr(DeviceSide, "stage", broken)
    rt.cache.clear()
    with torch.no_grad(), pytest.raises(ServingError, match="copy engine on fire"):
        model(**batch)
    monkeypatch.setattr(DeviceSide, "stage", orig)
    rt.cache.clear()
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, ref(**batch).logits)
    ring = rt.fetcher.device.copies.ring
    assert len(ring.free) == ring.slots and rt._inflight == 0
    stager = rt.fetcher._stager._threads
    rt.close()
    assert not any(th.is_alive() for th in stager)  # close stops the stager with the other threads


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_staging_ring_is_pinned_and_counted(tmp_path_factory):
    src, path = container(tmp_path_factory, "qwen2_moe")
    req = requirements(path, workers=2, device="cuda")
    budget = req["budget_for"](0.3)
    model, _ = zipmoe.load(path, budget=budget, device="cuda", workers=2)
    rt = model.zipmoe
    ring = rt.staging
    assert ring is not None and ring.pinned, ring.pin_error
    assert ring.slots == rt.window and ring.nbytes % PAGE == 0
    ref = reference(src, "cuda")
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    for seed in range(3):
        batch = inputs(vocab, False, "cuda", batch=4, seed=seed)
        with torch.no_grad():
            assert torch.equal(model(**batch).logits, ref(**batch).logits)
    mem = rt.memory()
    assert mem["counted_bytes"] <= budget and mem["peak_counted_bytes"] <= budget
    assert mem["device_allocated"] > 0 and mem["staging_ring_bytes"] == ring.nbytes and mem["staging_pinned"]
    assert len(ring.free) == ring.slots and rt._inflight == 0
    assert rt.describe()["staging"]["pinned"]
    rt.close()


@pytest.mark.parametrize("staged", [False, True])
def test_a_finished_fetch_needs_no_cyclic_collector(tmp_path_factory, staged):
    """A released group drops its fetches' back-reference and their views into read buffers and
    the staging slot: nothing of a fetch waits for Python's cyclic collector, whose oldest
    generation runs rarely, and which on the GPU box held dropped read buffers mapped for
    hundreds of tokens beyond what the budget counted (docs/benchmarks.md §22l)."""
    import gc

    from zipmoe.runtime.engine.fetch import _Fetch, _Group
    from zipmoe.runtime.engine.staging import StagingRing

    src, path = container(tmp_path_factory, "qwen2_moe")
    req = requirements(path, workers=2)
    model, _ = zipmoe.load(path, budget=req["min_budget"] + (1 << 20), workers=2, prefetch=True)
    rt = model.zipmoe
    if staged:
        rt.fetcher.device = rt.device_side(StagingRing(rt.window, rt.staging_slot_bytes, pin=False), device_merge=True)
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        with torch.no_grad():
            for seed in range(2):
                model(**inputs(vocab, False, batch=2, seed=seed))
        fetched = rt.counters.hits["none"]
        gc.collect()
        kept = [o for o in gc.garbage if type(o) in (_Group, _Fetch)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert fetched > 0
    assert not kept, f"{len(kept)} groups and fetches were freed only by the cyclic collector"
    rt.close()


def _as_on_cuda(rt) -> None:
    """The CUDA layout on the CPU, the working set included: a fetch counts no bf16 output (the
    group's device buffer does) and the ring's slots come out of the window's room, so idle
    read buffers have the little room they have on CUDA."""
    rt.fetcher.device = rt.device_side(StagingRing(rt.window, rt.staging_slot_bytes, pin=False), device_merge=True)
    w = rt.working
    w.staged, w.ring_bytes = True, rt.window * rt.staging_slot_bytes
    w.expert_working = rt.expert_working + rt.staging_slot_bytes
    w._bytes.clear()


def test_reads_of_every_size_reuse_the_read_buffers_with_host_pools(tmp_path_factory):
    """A mixed plan reads tensors whole (misses), their SM half (E-only hits) and their E half
    (SM-only hits). Each fetch counts the read buffers it took, and may take an idle buffer up to
    a miss's size: on the CUDA layout the reads then reuse the buffers instead of mapping a fresh
    one for most of them (docs/runtime.md, "Read buffers"; before: a fresh mapping for about half
    of the fetched tensors, and as many unmapped). Bit identity and the window's room hold."""
    from zipmoe.codecs.reader import ContainerReader
    from zipmoe.codecs.writer import pack
    from zipmoe.runtime import synth

    # the qwen2_moe "small" preset's shapes (2 of its layers): reads of a whole tensor, of its SM
    # half and of its E half differ by more than a buffer's slack (the tiny fixture's do not)
    work = tmp_path_factory.mktemp("mixreads")
    src, path = work / "src", work / "small.zmoe"
    synth.write("qwen2_moe", src, preset="small", layers=2, layout="fused", progress=False)
    pack(src, path)  # (3.6 s here)
    req = requirements(path, workers=2)
    with ContainerReader(path) as r:
        cid = r.container_id
    probe, _ = zipmoe.load(path, budget=req["budget_for"](1.0), workers=2, prefetch=False)
    full = probe.zipmoe.expert_bytes_full
    probe.zipmoe.close()
    plan = {"container_id": cid, "pools": {"full": full // 10, "compressed": 0, "sm_only": full // 10, "e_only": 2 * full // 5}}
    model, _ = zipmoe.load(path, budget=req["budget_for"](1.0), workers=2, prefetch=True, plan=plan)
    rt = model.zipmoe
    _as_on_cuda(rt)
    ref = reference(src)
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    with torch.no_grad():
        for seed in range(8):
            batch = inputs(vocab, False, batch=1, seq=2, seed=seed)
            assert torch.equal(model(**batch).logits, ref(**batch).logits)
    c = rt.counters
    fetched = sum(n for s, n in c.hits.items() if s != "full")
    assert c.hits["e_only"] > 0 and c.hits["sm_only"] > 0 and c.hits["none"] > 0
    # (the buffers of the first window's fetches, and a few more: 13 of 224 fetched tensors here;
    # before, 136)
    assert c.fresh_buffers <= 2 * rt.window * 2 + fetched // 20, (c.fresh_buffers, fetched)
    w = rt.working
    assert w.inflight == 0
    assert rt.store.buffers.idle_bytes <= w.window * w.expert_working - w.ring_bytes
    rt.close()


def test_compute_stream_is_asked_once_and_kept_while_it_is_the_same(monkeypatch):
    """``DeviceSide.compute_stream`` keeps the stream object while the serving thread's current
    stream is the same one (the stager marks buffers with it, to_device compares by identity),
    and takes the new one when it changes. A torch Stream compares unequal to None as False:
    the first version kept None on CUDA (found by ``pytest -m gpu``)."""
    from zipmoe.runtime.engine.device_side import DeviceSide

    class _Stream:  # as torch.cuda.Stream: == by id, and `!= None` False
        def __init__(self, sid):
            self.sid = sid

        def __eq__(self, other):
            return isinstance(other, _Stream) and other.sid == self.sid

        def __ne__(self, other):
            return isinstance(other, _Stream) and other.sid != self.sid

        __hash__ = object.__hash__

    now = [_Stream(1)]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream(now[0].sid))
    ds = DeviceSide("cpu", torch.bfloat16, ring=StagingRing(1, 1024, pin=False))
    ds.cuda = True  # the CUDA branch, on the CPU
    first = ds.compute_stream()
    assert first is not None and first.sid == 1
    assert ds.compute_stream() is first  # the same stream: the same object
    now[0] = _Stream(2)
    second = ds.compute_stream()
    assert second is not first and second.sid == 2
