"""Prefetch across layers: predictions only move bytes.

Served logits are ``torch.equal`` to transformers' eager reference (the tiny synth checkpoints
of tests/test_runtime_fixtures.py, CPU) with prefetch on, off, and with a predictor that
returns random experts (wrong most of the time); a corrupted chunk met only by a prefetch never
fails a step, and is named when a layer needs it.
"""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

import zipmoe
from zipmoe.errors import ChecksumError
from zipmoe.runtime.engine.counters import prediction_quality
from zipmoe.runtime.engine.loader import requirements
from zipmoe.runtime.engine.prefetch import RouterPredictor

from test_runtime_fixtures import FAMILIES, container, inputs, is_seq2seq, reference


def _vocab(src) -> int:
    return json.loads((src / "config.json").read_text())["vocab_size"]


class _RandomPredictor:
    """Names random experts of the next layer: a predictor that is wrong most of the time."""

    def __init__(self, real: RouterPredictor, num_experts: int, seed: int = 0) -> None:
        self.real = real
        self.rng = random.Random(seed)
        self.n = num_experts

    def predict(self, layer, hidden):
        nxt = self.real.next_layer(layer)
        if nxt is None:
            return None, []
        return nxt, sorted(self.rng.sample(range(self.n), self.rng.randint(1, self.n)))


def _serve(path, budget, mode, batch, workers=2):
    model, _ = zipmoe.load(path, budget=budget, workers=workers, prefetch=mode != "off")
    rt = model.zipmoe
    if mode == "random":
        assert rt.predictor is not None
        rt.predictor = _RandomPredictor(rt.predictor, rt.num_experts)
    try:
        with torch.no_grad():
            outs = [model(**batch).logits for _ in range(2)]  # cold, then with a warm cache
        assert rt._inflight == 0 and not rt.cache.pinned
        assert rt.counters.peak_held_bytes <= rt.budget
        return outs, rt.counters.snapshot()
    finally:
        rt.close()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("batch_size", [1, 4])
def test_prefetch_on_off_and_wrong_predictions_are_bit_identical(tmp_path_factory, family, batch_size):
    src, path = container(tmp_path_factory, family)
    ref = reference(src)
    batch = inputs(_vocab(src), is_seq2seq(family), batch=batch_size, seed=3)
    with torch.no_grad():
        want = ref(**batch).logits
    req = requirements(path, workers=2)
    issued = 0
    # a third of the experts cached; and a window of about two experts with no pools at all
    for budget in (req["budget_for"](0.4), 2 * req["min_budget"] - req["dense_bytes"]):
        for mode in ("off", "on", "random"):
            outs, snap = _serve(path, budget, mode, batch)
            for out in outs:
                assert torch.equal(out, want), (family, budget, mode)
            if mode == "off":
                assert snap["prefetch"]["issued"] == 0 and not snap["prediction_by_layer"]
            else:
                issued += snap["prefetch"]["issued"]
                p = snap["prefetch"]
                assert p["used"] + p["dropped"] <= p["issued"]
                if mode == "on":
                    q = prediction_quality(snap)
                    assert "all" in q and 0.0 <= q["all"]["recall"] <= 1.0
    assert issued > 0, "no prefetch was issued: the test exercises nothing"


def _chosen_per_layer(path, batch, budget):
    """The experts each sparse layer's router chooses for ``batch`` (from a run without prefetch)."""
    model, _ = zipmoe.load(path, budget=budget, workers=2, prefetch=False)
    rt = model.zipmoe
    chosen = {}
    run = rt.fetcher.run

    def spy(layer, experts, compute, *rest):
        chosen.setdefault(layer, set()).update(experts)
        return run(layer, experts, compute, *rest)

    rt.fetcher.run = spy
    try:
        with torch.no_grad():
            model(**batch)
        return chosen, rt.sparse_layers, rt.num_experts
    finally:
        rt.close()


def _corrupt(src_path, dst, layer, expert):
    from zipmoe.codecs.reader import ContainerReader

    shutil.copy(src_path, dst)
    names = []
    with ContainerReader(dst) as r:
        hits = [e for e in r.entries if e.role == "expert" and e.layer == layer
                and (e.expert if e.expert is not None else e.fused_index) == expert]
        chunks = [(e.name, [c for c in e.chunks if c.kind == "exp"][0]) for e in hits]
    with open(dst, "r+b") as f:
        for name, c in chunks:
            f.seek(c.offset + c.length // 2)
            b = f.read(1)
            f.seek(c.offset + c.length // 2)
            f.write(bytes([b[0] ^ 0x01]))
            names.append(name)
    return names


class _Fixed:
    def __init__(self, real, guesses: dict) -> None:
        self.real, self.guesses = real, guesses

    def predict(self, layer, hidden):
        nxt = self.real.next_layer(layer)
        return (nxt, sorted(self.guesses.get(nxt, []))) if nxt is not None else (None, [])


def test_a_corrupted_chunk_met_by_a_prefetch_fails_only_when_needed(tmp_path_factory, tmp_path):
    src, path = container(tmp_path_factory, "qwen3_moe")
    batch = inputs(_vocab(src), False, batch=1, seq=2, seed=5)  # 2 tokens: at most 4 of 8 experts a layer
    req = requirements(path, workers=2)
    budget = req["budget_for"](0.3)
    chosen, layers, n = _chosen_per_layer(path, batch, budget)
    second = layers[1]
    unused = [e for e in range(n) if e not in chosen[second]]
    assert unused, "every expert chosen: pick another seed"
    bad_expert = unused[0]
    bad = tmp_path / "bad.zmoe"
    names = _corrupt(path, bad, second, bad_expert)
    ref = reference(src)
    with torch.no_grad():
        want = ref(**batch).logits

    model, _ = zipmoe.load(bad, budget=budget, workers=2, prefetch=True)
    rt = model.zipmoe
    try:
        # the prefetch reads the corrupted expert (predicted, not chosen): the step is good
        rt.predictor = _Fixed(rt.predictor, {second: [bad_expert] + sorted(chosen[second])})
        with torch.no_grad():
            assert torch.equal(model(**batch).logits, want)
        snap = rt.counters.snapshot()
        assert snap["prefetch"]["failed"] >= 1 and snap["checksum_failures"] == 0
        assert rt._inflight == 0
        assert all(rt.cache.state_of(t.uid) is None for t in rt.expert_tensors[(second, bad_expert)])
        # a step that needs it names it (whether or not it was prefetched), and computes nothing with it
        other = None
        for seed in range(200):
            b = inputs(_vocab(src), False, batch=4, seed=seed)
            c, _, _ = _chosen_per_layer(path, b, budget)
            if bad_expert in c[second]:
                other = b
                break
        assert other is not None
        for guesses in ({second: [bad_expert]}, {}):
            rt.predictor = _Fixed(rt.predictor.real if isinstance(rt.predictor, _Fixed) else rt.predictor, guesses)
            with pytest.raises(ChecksumError) as e, torch.no_grad():
                model(**other)
            assert str(e.value).split()[1] in names and "checksum mismatch" in str(e.value)
            assert rt._inflight == 0 and not rt.cache.pinned
        # and the good step still serves
        with torch.no_grad():
            assert torch.equal(model(**batch).logits, want)
    finally:
        rt.close()


def test_precision_and_recall_are_counted_per_layer(tmp_path_factory):
    src, path = container(tmp_path_factory, "olmoe")
    req = requirements(path, workers=2)
    model, _ = zipmoe.load(path, budget=req["budget_for"](0.3), workers=2, prefetch=True)
    rt = model.zipmoe
    try:
        batch = inputs(_vocab(src), False, batch=1, seed=2)
        with torch.no_grad():
            model(**batch)
        snap = rt.counters.snapshot()
        layers = rt.sparse_layers
        # every sparse layer but the first is predicted (from the one before)
        assert sorted(snap["prediction_by_layer"]) == sorted(str(x) for x in layers[1:])
        for layer, (p, c, both) in snap["prediction_by_layer"].items():
            assert 0 <= both <= min(p, c) and c > 0
        assert rt.describe()["prefetch"] is True
    finally:
        rt.close()


def test_host_counter_leaves_out_compute_waits_and_the_predictor(tmp_path_factory, monkeypatch):
    """``time_s["host"]`` is each layer's wall time in ``Fetcher.run`` less its compute, its waits
    (the layer's fetches and the dropped prefetches drained at the end of a step) and the
    predictor's forward, which has a stage of its own (``predict``)."""
    import time

    from zipmoe.runtime.engine.fetcher import Fetcher

    src, path = container(tmp_path_factory, "olmoe")
    req = requirements(path, workers=2)
    model, _ = zipmoe.load(path, budget=req["budget_for"](0.3), workers=2, prefetch=True)
    rt = model.zipmoe
    wall = [0.0]
    orig = Fetcher.run

    def run(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return orig(self, *a, **k)
        finally:
            wall[0] += time.perf_counter() - t0

    monkeypatch.setattr(Fetcher, "run", run)
    try:
        with torch.no_grad():
            model(**inputs(_vocab(src), False, batch=1, seed=4))
        ts = rt.counters.snapshot()["time_s"]
        assert ts["predict"] > 0 and ts["wait"] > 0
        rest = wall[0] - ts["compute"] - ts["wait"] - ts["predict"]
        assert 0 < ts["host"] <= rest + 1e-6 and ts["host"] >= rest - 0.05 * wall[0]
    finally:
        rt.close()


def test_host_parts_take_the_host_counter_apart(tmp_path_factory):
    """``host_parts`` (lookup, issue, report, to_device, release) and ``admit`` are measured inside
    ``time_s["host"]``: each part a layer with fetches has is counted, and together with ``admit``
    they never exceed ``host``; the snapshot's delta keeps them; the warm start at load counts
    none of them."""
    from zipmoe.runtime.engine.counters import HOST_PARTS, delta

    src, path = container(tmp_path_factory, "olmoe")
    req = requirements(path, workers=2)
    model, _ = zipmoe.load(path, budget=req["budget_for"](0.3), workers=2, prefetch=True, warm=True)
    rt = model.zipmoe
    try:
        before = rt.counters.snapshot()
        # the warm start fetched through the pipeline, but it is not serving: nothing counted as host
        assert before["time_s"]["host"] == 0 and set(before["host_parts"].values()) == {0.0}
        assert before["bytes_read"] > 0
        with torch.no_grad():
            model(**inputs(_vocab(src), False, batch=1, seed=4))
        d = delta(rt.counters.snapshot(), before)
        parts, ts = d["host_parts"], d["time_s"]
        assert set(parts) == set(HOST_PARTS)
        assert d["prefetch"]["issued"] > 0 and sum(v for k, v in d["hits"].items() if k != "full") > 0
        for k in ("lookup", "issue", "report", "release"):
            assert parts[k] > 0, k
        assert parts["to_device"] >= 0
        assert sum(parts.values()) + ts["admit"] <= ts["host"] + 1e-6
    finally:
        rt.close()


def test_prefetch_is_off_by_default_on_the_cpu(tmp_path_factory):
    src, path = container(tmp_path_factory, "mixtral")
    req = requirements(path, workers=2)
    model, _ = zipmoe.load(path, budget=req["budget_for"](0.3), workers=2)
    try:
        assert model.zipmoe.prefetch is False and model.zipmoe.describe()["prefetch"] is False
    finally:
        model.zipmoe.close()


def test_no_predictor_when_every_expert_is_resident(tmp_path_factory):
    src, path = container(tmp_path_factory, "mixtral")
    req = requirements(path, workers=2)
    model, _ = zipmoe.load(path, budget=req["budget_for"](1.0), workers=2, prefetch=True)
    try:
        assert model.zipmoe.predictor is None and model.zipmoe.describe()["prefetch"] is False
    finally:
        model.zipmoe.close()


def test_environment_chooses_prefetch_and_readers(tmp_path_factory, monkeypatch):
    """The command line reads ZIPMOE_PREFETCH and ZIPMOE_READERS (zipmoe_cli/env.py) and passes
    them to load; load itself reads neither."""
    from zipmoe.errors import UsageError
    from zipmoe_cli.env import engine_env

    src, path = container(tmp_path_factory, "mixtral")
    req = requirements(path, workers=2)
    env = engine_env({"ZIPMOE_PREFETCH": "1", "ZIPMOE_READERS": "3"})
    assert env == {"prefetch": True, "readers": 3}
    model, _ = zipmoe.load(path, budget=req["budget_for"](0.3), workers=2, **env)
    try:
        assert model.zipmoe.prefetch is True and model.zipmoe.readers == 3
    finally:
        model.zipmoe.close()
    monkeypatch.setenv("ZIPMOE_PREFETCH", "1")
    monkeypatch.setenv("ZIPMOE_READERS", "3")
    model, _ = zipmoe.load(path, budget=req["budget_for"](0.3), workers=2)
    try:  # the environment alone changes nothing: the CPU default, no prefetch, default readers
        assert model.zipmoe.prefetch is False and model.zipmoe.readers != 3
    finally:
        model.zipmoe.close()
    with pytest.raises(UsageError, match="ZIPMOE_PREFETCH='yes': expected 0 or 1"):
        engine_env({"ZIPMOE_PREFETCH": "yes"})
