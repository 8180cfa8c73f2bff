"""The compressed pool keeps a fetch's read buffers instead of a copy (runtime/engine/adopt.py).

Reference for the bit checks: transformers' own model on the source checkpoint (the fixtures'
``reference``), fed the same tokens, on the CPU."""

from __future__ import annotations

import json
import mmap

import numpy as np
import torch

import zipmoe
from zipmoe.runtime.engine.adopt import Adopter
from zipmoe.runtime.engine.cache import ExpertCache
from zipmoe.runtime.engine.device_side import demote
from zipmoe.runtime.engine.loader import requirements

from test_runtime_fixtures import container, inputs, reference


def _shares(part, bufs) -> bool:
    return any(np.shares_memory(part, np.frombuffer(b, dtype=np.uint8)) for b in bufs)


def test_with_adoption_off_the_pool_copies_and_the_logits_stay_bit_identical(tmp_path_factory):
    """``Adopter.enabled`` off (the profile's β pass): the compressed pool keeps exact-size copies,
    no buffer is adopted, and the logits are the reference's."""
    src, path = container(tmp_path_factory, "qwen3_moe")
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    ref = reference(src)
    model, _ = zipmoe.load(path, budget="64M", workers=2)
    rt = model.zipmoe
    cid = rt.container_id
    rt.close()
    model, _ = zipmoe.load(path, budget="64M", workers=2, plan={"container_id": cid, "pools": {"compressed": 10 << 30}})
    rt = model.zipmoe
    ad = rt.fetcher.adopter
    ad.enabled = False
    try:
        with torch.no_grad():
            for seed in (1, 2, 1):
                batch = inputs(vocab, False, batch=2, seed=seed)
                assert torch.equal(model(**batch).logits, ref(**batch).logits)
        assert rt.counters.snapshot()["hits"]["compressed"] > 0
        assert ad.adopted == 0 and not ad._bufs
        for uid in rt.cache.pools["compressed"].items:
            e_parts, sm_parts = rt.cache.get(uid)
            assert all(p.base is None and p.flags.owndata for p in list(e_parts) + list(sm_parts))  # copies
    finally:
        rt.close()


def test_the_compressed_pool_keeps_the_read_buffers_and_the_logits_stay_bit_identical(tmp_path_factory):
    src, path = container(tmp_path_factory, "qwen3_moe")
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    ref = reference(src)
    probe, _ = zipmoe.load(path, budget=requirements(path, workers=1)["min_budget"], workers=1)
    rt = probe.zipmoe
    cid = rt.container_id
    kept = {t.uid: t.kept_bytes(None) for ts in rt.expert_tensors.values() for t in ts}
    rt.close()
    # a compressed pool for about a third of the tensors: hits, evictions and reuse of the buffers
    plan = {"container_id": cid, "pools": {"full": 0, "compressed": sum(kept.values()) // 3}}
    model, _ = zipmoe.load(path, budget="64M", workers=2, plan=plan)
    rt = model.zipmoe
    ad = rt.fetcher.adopter
    try:
        with torch.no_grad():
            for seed in (1, 2, 1, 3):
                batch = inputs(vocab, False, batch=2, seed=seed)
                assert torch.equal(model(**batch).logits, ref(**batch).logits)
        snap = rt.counters.snapshot()
        assert snap["hits"]["compressed"] > 0 and ad.adopted > 0 and ad.returned > 0
        pool = rt.cache.pools["compressed"]
        assert pool.items and set(ad._bufs) == set(pool.items)  # exactly the pool's tensors hold buffers
        for uid in pool.items:
            e_parts, sm_parts = rt.cache.get(uid)
            bufs = ad._bufs[uid]
            assert all(_shares(p, bufs) for p in list(e_parts) + list(sm_parts))  # views, not copies
        # each entry counts the aligned ranges its miss read, as the planner's replay does
        assert all(pool.items[uid][0] == kept[uid] for uid in pool.items)
        assert not ad._borrowed and not ad._orphans  # every compressed hit's group was released
    finally:
        rt.close()


class _Working:
    def __init__(self):
        self.back = []

    def recycle(self, bufs):
        self.back.extend(bufs)


class _Store:
    def buffer_size(self, off, ln):
        return 4096


def _fetch(uid, nbufs=2):
    from types import SimpleNamespace

    bufs = [mmap.mmap(-1, 3 * 4096) for _ in range(nbufs)]
    t = SimpleNamespace(uid=uid, kept_bytes=lambda state: 4096 * nbufs)
    e = [np.frombuffer(bufs[0], dtype=np.uint8)[:100]]
    sm = [np.frombuffer(bufs[-1], dtype=np.uint8)[4000:4096]]
    return SimpleNamespace(tensor=t, state=None, bufs=bufs, ranges=[(0, 4096)] * nbufs, e_parts=e, sm_parts=sm)


def test_buffers_go_back_when_the_pool_lets_go_but_not_while_a_fetch_reads_them():
    w = _Working()
    ad = Adopter(_Store(), w)
    cache = ExpertCache({"compressed": 2 * 4096 * 2}, demote=demote)
    ad.attach(cache)
    f1, f2, f3 = _fetch(1), _fetch(2), _fetch(3)
    b1 = list(f1.bufs)
    for f in (f1, f2):
        with ad:
            cache.offer(f.tensor.uid, {"compressed": ad.form(f)})
    assert f1.bufs == [] and ad.adopted == 2 and cache.state_of(1) == "compressed"
    ad.borrow(1)  # a compressed hit of 1 is decoding
    cache.touch(2), cache.touch(2), cache.touch(3), cache.touch(3), cache.touch(3)
    with ad:
        cache.offer(3, {"compressed": ad.form(f3)})
    assert cache.state_of(1) is None, "3, more used, takes 1's place"
    assert w.back == [] and ad.waited == 2  # 1's buffers wait for the borrower
    ad.give_back(1)
    assert w.back == b1 and ad.returned == 2


def test_what_a_lower_pool_keeps_of_an_adopted_tensor_is_copied():
    buf = mmap.mmap(-1, 4096)
    whole = np.frombuffer(buf, dtype=np.uint8)
    e, sm = [whole[:10]], [whole[100:200]]
    lower = demote("compressed", (e, sm))
    for pool, part in (("sm_only", sm[0]), ("e_only", e[0])):
        nbytes, data = lower[pool]
        kept = data()
        assert nbytes == part.nbytes and np.array_equal(kept[0], part)
        assert not np.shares_memory(kept[0], whole)  # half a buffer never pins the whole
