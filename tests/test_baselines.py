"""The bench's baselines without running their engines: missing packages name the extra,
DeepSpeed's config follows the budget, the paper's tables say why a cell is empty, llama.cpp's
tokens are a figure (its GGUF conversion: tests/test_llamacpp_convert.py)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from zipmoe.errors import BudgetError, UsageError
from zipmoe.runtime.bench import deepspeed_engine, engines, moe_infinity_engine, report, tables


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    from zipmoe.runtime import synth

    root = tmp_path_factory.mktemp("baselines")
    synth.write("mixtral", root / "mx", preset="tiny", seed=0, force=True, progress=False)
    synth.write("mixtral", root / "mxf", preset="tiny", seed=0, layout="fused", force=True, progress=False)
    return root


# ----------------------------------------------------------------------------- missing packages


@pytest.mark.parametrize("name,module", [("deepspeed", "deepspeed"), ("llama.cpp", "llama_cpp")])
def test_missing_baseline_names_the_extra(monkeypatch, name, module):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == module else real(n, *a))
    why = engines.missing_extra(name)
    assert why and "zipmoe[baselines]" in why and name in why and "\n" not in why


def test_baselines_are_selectable_and_in_the_extra():
    for name in ("deepspeed", "llama.cpp", "moe-infinity"):
        assert name in engines.BASELINES and engines.engine(name).budgeted
    import tomllib
    from pathlib import Path

    extra = tomllib.loads(Path(__file__).parents[1].joinpath("pyproject.toml").read_text())["project"]["optional-dependencies"]["baselines"]
    assert any(x.startswith("deepspeed") for x in extra) and any(x.startswith("llama-cpp-python") for x in extra)
    assert not any(x.startswith("moe-infinity") for x in extra)  # its PyPI package is an empty placeholder


# llama.cpp's GGUF conversion: tests/test_llamacpp_convert.py


# ----------------------------------------------------------------------------- DeepSpeed config


def test_deepspeed_config_follows_the_budget(mixtral):
    src = mixtral / "mx"
    largest, total, _ = deepspeed_engine._param_numels(src)
    assert largest == 8 * 2 * 128 * 64  # one layer's gate and up experts, fused by transformers into one parameter
    budget = 4 << 20
    cfg = deepspeed_engine.ds_config(budget, "nvme", "/x", src)
    z = cfg["zero_optimization"]
    assert z["stage"] == 3 and z["offload_param"]["device"] == "nvme" and z["offload_param"]["max_in_cpu"] == 0
    buf = z["offload_param"]["buffer_size"] * 2 * z["offload_param"]["buffer_count"]
    assert z["offload_param"]["buffer_count"] == 8 and buf <= budget // 2 + z["offload_param"]["buffer_size"] * 2
    small = deepspeed_engine.ds_config(5 * 2 * largest, "nvme", "/x", src)["zero_optimization"]
    assert small["offload_param"]["buffer_count"] == deepspeed_engine.MIN_BUFFERS == 5
    with pytest.raises(BudgetError, match="needs 5 swap buffers"):
        deepspeed_engine.ds_config(5 * 2 * largest - 1, "nvme", "/x", src)
    cpu = deepspeed_engine.ds_config(budget, "cpu", None, src)["zero_optimization"]
    assert cpu["offload_param"] == {"device": "cpu", "pin_memory": False}


def test_deepspeed_single_process_env(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_PORT", "DS_ACCELERATOR", "LOCAL_RANK", "MASTER_ADDR"):
        monkeypatch.delenv(k, raising=False)
    env = deepspeed_engine.single_process_env("cpu")
    assert env["RANK"] == "0" and env["WORLD_SIZE"] == "1" and env["DS_ACCELERATOR"] == "cpu" and int(env["MASTER_PORT"]) > 0


def test_deepspeed_offload_override_is_checked(monkeypatch):
    """The worker spec's ``deepspeed_offload`` decides (the environment does not: `zipmoe bench`
    reads ZIPMOE_BENCH_DEEPSPEED_OFFLOAD and puts it in the spec)."""
    with pytest.raises(UsageError, match="'disk': use nvme or cpu"):
        deepspeed_engine.before_load({"device": "cpu", "deepspeed_offload": "disk"})
    with pytest.raises(UsageError, match="'disk': use nvme or cpu"):
        deepspeed_engine.check_offload("disk")
    assert [deepspeed_engine.check_offload(v) for v in (None, "", "auto", "nvme", "cpu")] == [None, None, None, "nvme", "cpu"]
    if importlib.util.find_spec("deepspeed") is None:
        with pytest.raises(UsageError, match=r"zipmoe\[baselines\]"):
            deepspeed_engine.before_load({"device": "cpu"})
        return
    monkeypatch.setenv("ZIPMOE_BENCH_DEEPSPEED_OFFLOAD", "disk")  # read nowhere below the command line
    info = deepspeed_engine.before_load({"device": "cpu", "deepspeed_offload": "cpu"})
    assert info["offload_param"] == "cpu" and "outside the budget" in info["budget_broken"]
    assert "--deepspeed-offload cpu" in info["budget_broken"]
    assert deepspeed_engine.build_ops("cpu", "cpu") == []  # nothing to build for the cpu offload


def test_deepspeed_load_in_budget_comes_from_the_spec(monkeypatch):
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")
    monkeypatch.setattr(deepspeed_engine, "aio_available", lambda: (True, ""))
    assert deepspeed_engine.before_load({"device": "cpu"})["cgroup_after_load"] == deepspeed_engine.LOAD_NOTE
    monkeypatch.setenv("ZIPMOE_BENCH_DEEPSPEED_LOAD_IN_BUDGET", "1")  # read nowhere below the command line
    assert "cgroup_after_load" in deepspeed_engine.before_load({"device": "cpu"})
    assert "cgroup_after_load" not in deepspeed_engine.before_load({"device": "cpu", "deepspeed_load_in_budget": True})


def test_bench_reads_the_deepspeed_environment_and_options(tmp_path, monkeypatch, capsys):
    """`zipmoe bench` turns ZIPMOE_BENCH_DEEPSPEED_* (and its options, which win) into the
    BenchConfig the engines' workers get; a wrong value is one line, before anything runs."""
    from test_cli_pack import assert_one_line_error, run
    from zipmoe.runtime.bench import run as bench_run

    seen = []

    def fake_run_bench(cfg, log=None, progress_factory=None):
        seen.append(cfg)
        return {"summary": []}, []

    monkeypatch.setattr(bench_run, "run_bench", fake_run_bench)
    monkeypatch.setattr("zipmoe_cli.bench._print_report", lambda *a, **k: None)
    z = tmp_path / "x.zmoe"
    z.write_bytes(b"")
    args = ["bench", z, "--engine", "deepspeed", "--budget", "1G"]
    monkeypatch.setenv("ZIPMOE_BENCH_DEEPSPEED_OFFLOAD", "cpu")
    monkeypatch.setenv("ZIPMOE_BENCH_DEEPSPEED_BUILD_TIMEOUT", "60")
    monkeypatch.setenv("ZIPMOE_BENCH_DEEPSPEED_LOAD_IN_BUDGET", "1")
    monkeypatch.setenv("ZIPMOE_READERS", "3")
    monkeypatch.setenv("ZIPMOE_PREFETCH", "0")
    monkeypatch.setenv("ZIPMOE_CACHE_DIR", str(tmp_path / "cache"))
    code, _, err = run(capsys, *args)
    assert code == 0, err
    c = seen.pop()
    assert (c.deepspeed_offload, c.deepspeed_build_timeout_s, c.deepspeed_load_in_budget) == ("cpu", 60.0, True)
    assert (c.readers, c.prefetch, c.cache_dir) == (3, False, tmp_path / "cache")
    code, _, err = run(capsys, *args, "--deepspeed-offload", "nvme", "--deepspeed-build-timeout", "5",
                       "--deepspeed-load-unbudgeted")
    assert code == 0, err
    c = seen.pop()
    assert (c.deepspeed_offload, c.deepspeed_build_timeout_s, c.deepspeed_load_in_budget) == ("nvme", 5.0, False)
    for k in ("ZIPMOE_BENCH_DEEPSPEED_OFFLOAD", "ZIPMOE_BENCH_DEEPSPEED_BUILD_TIMEOUT", "ZIPMOE_BENCH_DEEPSPEED_LOAD_IN_BUDGET",
              "ZIPMOE_READERS", "ZIPMOE_PREFETCH"):
        monkeypatch.delenv(k)
    code, _, err = run(capsys, *args)
    assert code == 0, err
    c = seen.pop()
    assert (c.deepspeed_offload, c.deepspeed_build_timeout_s, c.deepspeed_load_in_budget, c.readers, c.prefetch) == \
        (None, None, False, None, None)
    for extra, env, needle in [
        ((), ("ZIPMOE_BENCH_DEEPSPEED_OFFLOAD", "disk"), "ZIPMOE_BENCH_DEEPSPEED_OFFLOAD='disk': use nvme or cpu"),
        (("--deepspeed-offload", "disk"), None, "--deepspeed-offload 'disk': use nvme or cpu"),
        ((), ("ZIPMOE_BENCH_DEEPSPEED_BUILD_TIMEOUT", "soon"), "ZIPMOE_BENCH_DEEPSPEED_BUILD_TIMEOUT='soon': expected seconds"),
        (("--deepspeed-build-timeout", "0"), None, "--deepspeed-build-timeout must be a number of seconds above 0"),
        ((), ("ZIPMOE_BENCH_DEEPSPEED_LOAD_IN_BUDGET", "yes"), "ZIPMOE_BENCH_DEEPSPEED_LOAD_IN_BUDGET='yes': expected 0 or 1"),
        ((), ("ZIPMOE_READERS", "x"), "ZIPMOE_READERS='x': expected a whole number of at least 1"),
    ]:
        if env:
            monkeypatch.setenv(*env)
        code, _, err = run(capsys, *args, *extra)
        assert_one_line_error(code, err, needle)
        if env:
            monkeypatch.delenv(env[0])
    assert not seen


# ----------------------------------------------------------------------------- tables and tokens


def _run(engine, budget, tpot, batch=1, n=4, tokens=None, e2e=None):
    return {"engine": engine, "budget": budget, "batch": batch, "new_tokens": n, "generated": n, "case": f"b{batch}-n{n}",
            "tpot_s": tpot, "ttft_s": 2 * tpot, "e2e_s": e2e or tpot * (n + 1), "tokens_per_s": batch * n / (e2e or tpot * (n + 1)),
            "tokens": tokens or [[1, 2, 3, 4][:n]] * batch}


def _doc():
    M = 400 << 20
    runs = [_run("zipmoe", M, 0.1), _run("zipmoe-basic", M, 0.4), _run("zipmoe-pools", M, 0.2),
            _run("zipmoe", M, 0.1, batch=4), _run("zipmoe", M, 0.1, n=8, tokens=[[1, 2, 3, 4, 5, 6, 7, 8]]),
            _run("deepspeed", M, 0.8), _run("llama.cpp", M, 0.05, tokens=[[1, 2, 9, 9]]), _run("resident", None, 0.02)]
    results = [{"engine": e, "budget": b, "ok": True, "runs": [r for r in runs if r["engine"] == e]}
               for e, b in (("zipmoe", M), ("zipmoe-basic", M), ("zipmoe-pools", M), ("llama.cpp", M), ("resident", None))]
    results.append({"engine": "deepspeed", "budget": M, "ok": True, "runs": [runs[5]], "budget_broken": "kept every parameter in CPU memory"})
    results.append({"engine": "accelerate", "budget": M, "ok": False, "runs": [], "error": "engine accelerate cannot run in budget 400 MiB: killed"})
    doc = {"results": results, "errors": [{"engine": "moe-infinity", "error": moe_infinity_engine.EXTRA_LINE}],
           "configs": [{"engines": ["zipmoe", "zipmoe-basic", "zipmoe-pools", "accelerate", "deepspeed", "llama.cpp", "moe-infinity", "resident"], "budgets": [M]}]}
    doc["summary"] = report.summarize(runs, None)
    return doc, M


def test_paper_tables_cells_say_why(tmp_path):
    doc, M = _doc()
    t = tables.build(doc)["tables"]
    lat = {(r["engine"], r["budget"]): r for r in t["latency"]["rows"]}
    # the length most engines and budgets ran (4; zipmoe also ran 8), each cell at it
    assert t["latency"]["batch"] == 1 and t["latency"]["new_tokens"] == 4
    assert lat[("zipmoe", M)]["tpot_s"]["value"] == pytest.approx(0.1) and "new_tokens" not in lat[("zipmoe", M)]["tpot_s"]
    assert lat[("resident", None)]["tpot_s"]["value"] == pytest.approx(0.02)
    assert lat[("accelerate", M)]["tpot_s"]["text"] == "cannot run" and "killed" in lat[("accelerate", M)]["tpot_s"]["why"]
    assert lat[("moe-infinity", M)]["tpot_s"]["text"] == "cannot run" and "source" in lat[("moe-infinity", M)]["tpot_s"]["why"]
    thr = {(r["engine"], r["budget"]): r for r in t["throughput"]["rows"]}
    assert t["throughput"]["batches"] == [1, 4]
    assert thr[("zipmoe", M)]["by_batch"]["4"]["value"] is not None and thr[("deepspeed", M)]["by_batch"]["4"]["text"] == "not measured"
    assert thr[("deepspeed", M)]["by_batch"]["1"]["flag"] == "†"
    # each engine's own longest generation at a batch: deepspeed ran 4 tokens, zipmoe 8
    assert thr[("deepspeed", M)]["by_batch"]["1"]["value"] is not None
    assert t["e2e"]["new_tokens"] == [4, 8]
    abl = {r["variant"]: r for r in t["ablation"]["rows"]}
    assert t["ablation"]["rows"][0]["variant"] == "basic"
    # at zipmoe-basic's longest batch-1 generation (4 tokens), not the latency table's 8
    assert "4 new tokens" in t["ablation"]["title"]
    assert abl["+prefetch"]["tpot_s"]["value"] == pytest.approx(0.1) and abl["+pools"]["tpot_s"]["value"] == pytest.approx(0.2)
    assert abl["+planning"]["tpot_s"]["text"] == "not measured"  # zipmoe-noprefetch was not run
    agr = {r["engine"]: r for r in t["agreement"]["rows"]}
    assert agr["llama.cpp"]["agreement"] == pytest.approx(0.5) and agr["llama.cpp"]["first_difference_at"] == 2
    assert agr["deepspeed"]["agreement"] == 1.0
    full = tables.build(doc)
    assert any(n.startswith("† deepspeed") for n in full["notes"]) and any("moe-infinity cannot run" in n for n in full["notes"])
    from rich.console import Console

    con = Console(record=True, width=400)
    tables.emit(doc, show=True, json_path=tmp_path / "t.json", console=con)
    text = con.export_text()
    assert "cannot run" in text and "so zipmoe[baselines] cannot install it" in text  # the engine's line, verbatim (no markup eaten)
    assert json.loads((tmp_path / "t.json").read_text())["schema"] == tables.SCHEMA


def test_paper_ablation_speedup():
    doc, M = _doc()
    doc["summary"] = report.summarize([_run("zipmoe", M, 0.1, n=8), _run("zipmoe-basic", M, 0.4, n=8), _run("zipmoe-pools", M, 0.2, n=8),
                                       _run("zipmoe-noprefetch", M, 0.16, n=8)], None)
    rows = tables.build(doc)["tables"]["ablation"]["rows"]
    assert [r["variant"] for r in rows] == ["basic", "+pools", "+planning", "+prefetch"]
    abl = {r["variant"]: r for r in rows}
    assert abl["basic"]["speedup_over_basic"] == pytest.approx(1.0)
    assert abl["+pools"]["speedup_over_basic"] == pytest.approx(2.0)
    assert abl["+planning"]["speedup_over_basic"] == pytest.approx(2.5)
    assert abl["+prefetch"]["speedup_over_basic"] == pytest.approx(4.0)


def test_ablation_without_prefetch_calls_zipmoe_planning():
    """Prefetch off in zipmoe's runs (the CPU default): no +prefetch row, zipmoe is +planning."""
    doc, M = _doc()
    doc["summary"] = report.summarize([_run("zipmoe", M, 0.1, n=8), _run("zipmoe-basic", M, 0.4, n=8), _run("zipmoe-pools", M, 0.2, n=8)], None)
    for d in doc["results"]:
        if d["engine"] == "zipmoe":
            d["load_info"] = {"runtime": {"prefetch": False}}
    t = tables.build(doc)["tables"]["ablation"]
    assert [r["variant"] for r in t["rows"]] == ["basic", "+pools", "+planning"] and "+prefetch" not in t["title"]
    assert t["rows"][2]["engine"] == "zipmoe" and t["rows"][2]["speedup_over_basic"] == pytest.approx(4.0)


def test_llamacpp_tokens_are_a_figure_not_a_check():
    runs = [_run("zipmoe", 1, 0.1), _run("llama.cpp", 1, 0.1, tokens=[[1, 2, 9, 9]])]
    tc = report.token_check(runs)
    assert tc["compared"] == 0 and not tc["mismatches"]
    runs.append(_run("deepspeed", 1, 0.1, tokens=[[1, 9, 9, 9]]))
    assert not report.token_check(runs)["same"]  # deepspeed computes with transformers: checked


def test_paper_tables_a_merged_rerun_replaces_the_failure():
    doc, M = _doc()
    doc["errors"].append({"engine": "deepspeed", "budget": M, "error": "engine deepspeed cannot run in budget 400 MiB: killed"})
    t = tables.build(doc)
    cell = next(r for r in t["tables"]["e2e"]["rows"] if r["engine"] == "deepspeed")["by_new_tokens"]["4"]
    assert cell["value"] is not None and not any("deepspeed @" in n and "cannot run" in n for n in t["notes"])


def test_llamacpp_evicts_its_gguf_before_mapping_it(tmp_path, monkeypatch):
    """Cold: the GGUF leaves the page cache before llama.cpp maps it (pages written by the
    conversion are charged to bench's process and a mapped page cannot be evicted later), so its
    reads are charged to its own cgroup. Warm: left alone."""
    import types

    from zipmoe.runtime.bench import cold, llamacpp_engine

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"\0" * 4096)
    order = []

    class FakeLlama:
        def __init__(self, **kw):
            order.append("map")

        def n_vocab(self):
            return 8

    monkeypatch.setattr(llamacpp_engine, "import_llama_cpp", lambda: types.SimpleNamespace(Llama=FakeLlama))
    monkeypatch.setattr(cold, "fadvise_dontneed", lambda paths: order.append(("evict", [str(p) for p in paths])) or 1)
    spec = {"gguf": str(gguf), "cases": [{"input_ids": [[1, 2]], "new_tokens": 2}], "device": "cpu", "cold": True}
    info = {}
    llamacpp_engine.LlamaCppModel(spec, info)
    assert order == [("evict", [str(gguf)]), "map"] and info["evicted_before_load"]
    order.clear()
    llamacpp_engine.LlamaCppModel({**spec, "cold": False}, {})
    assert order == ["map"]
