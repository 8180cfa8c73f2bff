"""The engine's explicit settings: one object, no environment variable below the command line,
no module flag, no process-wide patch; the fetch pipeline built from declared parts.

References: the logits of each configuration are compared with transformers computing the same
checkpoint with eager experts (test_runtime_fixtures.reference), torch.equal.
"""

from __future__ import annotations

import ast
import json
import threading
from pathlib import Path

import pytest
import torch

import zipmoe
from zipmoe.errors import UsageError
from zipmoe.runtime.engine.loader import params_on_meta, requirements
from zipmoe.runtime.engine.settings import DEFAULT_READERS, EngineSettings

from test_runtime_fixtures import container, inputs, reference

ROOT = Path(__file__).resolve().parents[1]


def test_settings_check_their_fields_in_one_line():
    assert EngineSettings().kernels == "exact" and EngineSettings().readers == DEFAULT_READERS
    for bad, match in ((dict(kernels="quick"), "unknown kernels"), (dict(graphs="maybe"), "graphs must be"),
                       (dict(readers=0), "--readers"), (dict(workers=0), "--workers"), (dict(cache_age=-1), "cache_age"),
                       (dict(attention="fastest"), "attention must be")):
        with pytest.raises(UsageError, match=match) as info:
            EngineSettings(**bad)
        assert "\n" not in str(info.value)
    s = EngineSettings(readers=2)
    assert s.with_(readers=None, prefetch=True) == EngineSettings(readers=2, prefetch=True)
    assert s.resolved("cpu").prefetch is False and s.resolved("cuda").prefetch is True
    assert s.resolved("cpu").slots is False and EngineSettings(slots=True).resolved("cpu").slots is True
    assert set(EngineSettings.names()) == set(s.as_dict())


def test_reproducible_attention_leaves_out_cudnn_and_restores_the_choice():
    """EngineSettings.attention (engine/step.py attention_kernels): ``reproducible`` on CUDA lets
    scaled_dot_product_attention use flash, memory-efficient and math but not cuDNN's kernel
    (its bits changed run to run on the H200, docs/benchmarks.md §23) and gives PyTorch's
    choice back after; ``pytorch``, and the CPU (no cuDNN kernel), leave it alone."""
    from zipmoe.runtime.engine.step import attention_kernels

    cuda = torch.backends.cuda
    before = (cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled())
    assert EngineSettings().attention == "reproducible"
    with attention_kernels("reproducible", "cuda"):
        assert not cuda.cudnn_sdp_enabled()
        assert cuda.flash_sdp_enabled() and cuda.mem_efficient_sdp_enabled() and cuda.math_sdp_enabled()
    assert (cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(),
            cuda.math_sdp_enabled()) == before
    for choice, device in (("pytorch", "cuda"), ("reproducible", "cpu"), ("pytorch", torch.device("cpu"))):
        with attention_kernels(choice, device):
            assert cuda.cudnn_sdp_enabled() == before[0], (choice, device)
    with pytest.raises(UsageError, match="attention must be"):
        attention_kernels("fastest", "cuda")


def test_the_loop_and_the_graphs_take_the_engines_attention(tmp_path_factory, monkeypatch):
    """zipmoe.load(attention=...) reaches the runtime's settings; a DecodeLoop (and the graphs it
    builds) runs every forward with it, or with its own ``attention=``; a plain transformers model
    gets ``reproducible``. Logits stay the reference's (the CPU: both choices are one)."""
    from zipmoe.runtime.engine import loop as loop_mod
    from zipmoe.runtime.engine.loop import DecodeLoop

    src, path = container(tmp_path_factory, "qwen2_moe")
    req = requirements(path, workers=1)
    seen = []
    real = loop_mod.step_forward

    def spy(*args, attention, **kw):
        seen.append(attention)
        return real(*args, attention=attention, **kw)

    monkeypatch.setattr(loop_mod, "step_forward", spy)
    ref = reference(src)
    ids = torch.tensor([[5, 6, 7, 8]])
    want = DecodeLoop(ref, context=16).generate(ids, max_new_tokens=3, do_sample=False, keep_logits=True,
                                                generation_kwargs={"pad_token_id": 0})
    assert seen and set(seen) == {"reproducible"}
    model, _ = zipmoe.load(path, budget=req["budget_for"](1.0), workers=1, attention="pytorch")
    try:
        assert model.zipmoe.settings.attention == "pytorch"
        seen.clear()
        loop = DecodeLoop(model, context=16)
        assert loop.attention == "pytorch"
        got = loop.generate(ids, max_new_tokens=3, do_sample=False, keep_logits=True, generation_kwargs={"pad_token_id": 0})
        assert set(seen) == {"pytorch"}
        assert all(torch.equal(a, b) for a, b in zip(want.logits, got.logits)) and len(got.logits) == 3
        assert DecodeLoop(model, context=16, attention="reproducible").attention == "reproducible"
        with pytest.raises(UsageError, match="attention must be"):
            DecodeLoop(model, context=16, attention="fastest")
    finally:
        model.zipmoe.close()


def _reads_env(path: Path) -> list[str]:
    """``os.environ[...]`` / ``os.environ.get(...)`` / ``os.getenv(...)`` of a ``ZIPMOE_`` name in a file."""
    found = []
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = {n.targets[0].id: n.value.value for n in ast.walk(tree)
             if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)
             and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)}
    for node in ast.walk(tree):
        arg = None
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "environ":
            arg = node.slice
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if (f.attr == "get" and isinstance(f.value, ast.Attribute) and f.value.attr == "environ") or f.attr == "getenv":
                arg = node.args[0] if node.args else None
        if arg is None:
            continue
        value = arg.value if isinstance(arg, ast.Constant) else names.get(getattr(arg, "id", None))
        if isinstance(value, str) and value.startswith("ZIPMOE_"):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {value}")
    return found


# The one environment variable read below the command line: the bench parent names the memory
# cgroup its worker process joins before it imports torch (the worker's own start-up, not a switch).
ALLOWED = {"ZIPMOE_BENCH_CGROUP"}


def test_no_zipmoe_environment_variable_is_read_below_the_command_line():
    found = []
    for folder in ("zipmoe", "codecs", "kernels", "runtime"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            found += [f for f in _reads_env(path) if f.rsplit(": ", 1)[1] not in ALLOWED]
    assert not found, "read these in zipmoe_cli and pass them down as arguments:\n" + "\n".join(found)
    # the check sees what it should
    probe = ROOT / "tests" / "_probe_env.py"
    probe.write_text('import os\nV = "ZIPMOE_X"\na = os.environ.get("ZIPMOE_A")\nb = os.environ[V]\nc = os.getenv("ZIPMOE_C")\n')
    try:
        assert [f.rsplit(": ", 1)[1] for f in _reads_env(probe)] == ["ZIPMOE_A", "ZIPMOE_X", "ZIPMOE_C"]
    finally:
        probe.unlink()


def test_no_module_flag_switches_the_graphs():
    from zipmoe.runtime.engine import graphs

    assert not hasattr(graphs, "BATCHED_SPARSE")
    src = (ROOT / "runtime" / "engine" / "experts_hook.py").read_text()
    assert "_zipmoe_break" not in src and "_zipmoe_break" not in (ROOT / "runtime" / "engine" / "graphs.py").read_text()


def test_the_engine_ignores_the_environment(tmp_path_factory, monkeypatch):
    """ZIPMOE_* variables set in the process change nothing a library caller gets."""
    src, path = container(tmp_path_factory, "mixtral")
    req = requirements(path, workers=2)
    monkeypatch.setenv("ZIPMOE_PREFETCH", "1")
    monkeypatch.setenv("ZIPMOE_READERS", "3")
    model, _ = zipmoe.load(path, budget=req["budget_for"](0.3), workers=2)
    try:
        rt = model.zipmoe
        assert rt.prefetch is False and rt.readers == DEFAULT_READERS
        assert rt.describe()["settings"]["readers"] == DEFAULT_READERS
    finally:
        model.zipmoe.close()
    model, _ = zipmoe.load(path, budget=req["budget_for"](0.3), settings=EngineSettings(workers=2, readers=3, prefetch=True))
    try:
        rt = model.zipmoe
        assert rt.prefetch is True and rt.readers == 3 and len(rt.fetcher.reader) == 3 and rt.workers == 2
    finally:
        model.zipmoe.close()


def test_parameters_go_to_meta_on_the_loading_thread_only():
    made = {}

    def other():
        made["other"] = torch.nn.Linear(4, 4)

    with params_on_meta():
        inside = torch.nn.Linear(4, 4)
        th = threading.Thread(target=other)
        th.start()
        th.join()
        inside.register_buffer("b", torch.ones(2))
    after = torch.nn.Linear(4, 4)
    assert inside.weight.device.type == "meta" and inside.weight.requires_grad
    assert inside.b.device.type == "cpu"  # buffers stay real
    assert made["other"].weight.device.type == "cpu" and after.weight.device.type == "cpu"
    from torch.nn.modules import module as m

    assert not m._global_parameter_registration_hooks  # the hook is gone


def test_the_fetcher_is_built_from_declared_parts(tmp_path_factory):
    """The runtime hands the fetcher its reader, decoder, device side, cache, working set and
    counters; none of them holds the runtime."""
    src, path = container(tmp_path_factory, "olmoe")
    req = requirements(path, workers=2)
    model, _ = zipmoe.load(path, budget=req["budget_for"](0.3), workers=2)
    rt = model.zipmoe
    try:
        f = rt.fetcher
        assert f.cache is rt.cache and f.working is rt.working and f.reader.store is rt.store
        assert f.decoder.workers == rt.workers and f.device.compute_dtype == rt.compute_dtype
        for part in (f, f.reader, f.decoder, f.device, f.working):
            assert all(v is not rt for v in vars(part).values()), type(part).__name__
        ref = reference(src)
        batch = inputs(json.loads((src / "config.json").read_text())["vocab_size"], False, batch=2)
        with torch.no_grad():
            assert torch.equal(model(**batch).logits, ref(**batch).logits)
        assert rt.counters.hits["none"] > 0
        old = rt.swap_cache(rt.cache)
        assert old is rt.cache and rt.fetcher.cache is rt.cache
    finally:
        rt.close()


def test_warm_fills_the_full_pool_through_the_pipeline(tmp_path_factory):
    src, path = container(tmp_path_factory, "qwen2_moe")
    req = requirements(path, workers=2)
    model, _ = zipmoe.load(path, budget=req["budget_for"](0.5), workers=2, warm=True)
    rt = model.zipmoe
    try:
        full = rt.cache.pools["full"]
        assert full.used > 0 and full.capacity - full.used < max(t.compute_bytes for ts in rt.expert_tensors.values() for t in ts)
        assert sum(rt.counters.hits.values()) == 0  # warming is no use of an expert
        ref = reference(src)
        batch = inputs(json.loads((src / "config.json").read_text())["vocab_size"], False, batch=2, seed=3)
        with torch.no_grad():
            assert torch.equal(model(**batch).logits, ref(**batch).logits)
        assert rt._inflight == 0
    finally:
        rt.close()


def test_a_graphed_layer_is_accounted_as_the_host_path_accounts_it(tmp_path_factory):
    """Runtime.layer_computed (what a CUDA-graphed sparse block calls) counts the same uses, hits,
    prediction score and makespan entry as Fetcher.run over resident experts."""
    src, path = container(tmp_path_factory, "qwen2_moe")
    req = requirements(path, workers=1)
    model, _ = zipmoe.load(path, budget=req["budget_for"](1.0), workers=1, warm=True)
    rt = model.zipmoe
    try:
        layer, experts = rt.sparse_layers[0], [0, 2, 3]
        uids = [t.uid for e in experts for t in rt.expert_tensors[(layer, e)]]

        def snapshot():
            return dict(rt.counters.hits), [rt.cache.count.get(u, 0) for u in uids], rt.counters.layer_calls

        rt.fetcher._predicted[layer] = [0, 1]
        h0, c0, l0 = snapshot()
        rt.run_layer(layer, experts, lambda e, w: None)
        h1, c1, l1 = snapshot()
        rt.fetcher._predicted[layer] = [0, 1]
        rt.layer_computed(layer, experts, 0.0)
        h2, c2, l2 = snapshot()
        assert {k: h1[k] - h0[k] for k in h0} == {k: h2[k] - h1[k] for k in h0} and h1["full"] - h0["full"] == len(uids)
        assert [b - a for a, b in zip(c0, c1)] == [b - a for a, b in zip(c1, c2)] == [1] * len(uids)
        assert l1 - l0 == l2 - l1 == 1 and not rt.cache.pinned
        assert rt.counters.prediction_by_layer[str(layer)] == [4, 6, 2]  # two scored predictions, alike
    finally:
        rt.close()
