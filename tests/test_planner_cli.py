"""`zipmoe plan` end to end on a tiny packed container, its errors, and the hardware profile."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from zipmoe_cli.app import main

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def container(tiny_mixtral_container):
    return tiny_mixtral_container


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    """The profile cache of the command line's runs (it reads ZIPMOE_CACHE_DIR; the library gets
    ``cache_dir=`` from the tests that call it)."""
    monkeypatch.setenv("ZIPMOE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _run(args, capsys):
    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


def _profile(path, cid, tmp_path, **changes):
    """A profile that matches this machine and file, with realistic costs (no measuring)."""
    from zipmoe.runtime.plan.profile import PROFILE_FORMAT, PROFILE_REVISION, container_info, machine_info

    prof = {
        "format": PROFILE_FORMAT,
        "revision": PROFILE_REVISION,
        "machine": machine_info("cpu"),
        "container": container_info(path, cid),
        "disk": {"method": "O_DIRECT"},
        "decomp": {"codec": "zstd"},
        "merge": {"kernel": "numba"},
        "compute": {"s_per_expert": 40e-6, "torch_threads": 1},
        "costs": {"disk_bw": 1.0e9, "disk_latency": 60e-6, "decomp_bw_per_worker": 1.5e9, "merge_bw": 3e9,
                  "compute_s_per_expert": 40e-6},
    }
    for k, v in changes.items():
        prof[k] = {**prof[k], **v}
    p = tmp_path / "profile.json"
    p.write_text(json.dumps(prof))
    return p


def _trace(path, cid, tokens=300, skew=1.5, **header):
    rng = np.random.default_rng(0)
    w = 1 / np.arange(1, 9) ** skew
    with open(path, "w") as f:
        f.write(json.dumps({"container_id": cid, "num_layers": 2, "num_experts": 8, "top_k": 2, "layers": [0, 1], **header}) + "\n")
        for _ in range(tokens):
            f.write(json.dumps({"layers": {str(l): [rng.choice(8, 2, replace=False, p=w / w.sum()).tolist()] for l in (0, 1)}}) + "\n")
    return path


def test_plan_writes_plan_json_and_explains(container, tmp_path, capsys):
    path, cid = container
    prof = _profile(path, cid, tmp_path)
    tr = _trace(tmp_path / "t.jsonl", cid)
    out = tmp_path / "plan.json"
    code, stdout, err = _run(["plan", path, "--budget", "800K", "--trace", tr, "--profile", prof, "-o", out, "--workers", "1"], capsys)
    assert code == 0, err
    plan = json.loads(out.read_text())
    assert plan["format"] == "zipmoe-plan/1" and plan["container_id"] == cid
    assert plan["budget"] == 800 * 1024
    assert set(plan["pools"]) == {"full", "compressed", "sm_only", "e_only"}
    assert sum(plan["pools"].values()) <= plan["pool_bytes_available"]
    assert plan["dense_bytes"] + plan["working_bytes"] + plan["pool_bytes_available"] == plan["budget"]
    assert sum(plan["expected_hits"].values()) == pytest.approx(2)
    assert plan["expected_tpot_s"] > plan["expected_sparse_s_per_token"] > 0
    assert plan["trace"]["source"] == "trace" and plan["trace"]["tokens"] == 300
    assert plan["profile"]["source"] == "file"
    singles = [v["expected_tpot_s"] for v in plan["alternatives"].values()]
    assert plan["expected_tpot_s"] <= min(singles) + 1e-15
    assert "plans compared" in stdout and "chosen" in stdout
    # --json prints the same document
    code, stdout, _ = _run(["plan", path, "--budget", "800K", "--trace", tr, "--profile", prof, "--json", "--workers", "1"], capsys)
    assert code == 0 and json.loads(stdout)["pools"] == plan["pools"]
    # the runtime accepts it
    from zipmoe.runtime.engine.core import read_plan

    assert read_plan(str(out), cid)["pools"] == plan["pools"]


@pytest.mark.parametrize("pool", ["full", "compressed", "sm_only", "e_only"])
def test_plan_only_writes_that_single_pool_plan(container, tmp_path, capsys, pool):
    """--only POOL writes the single-pool plan the table lists for POOL (same slots, pools and
    prediction), names the planner's own choice beside it, and the runtime loads it."""
    path, cid = container
    prof = _profile(path, cid, tmp_path)
    tr = _trace(tmp_path / "t.jsonl", cid)
    chosen, pinned = tmp_path / "plan.json", tmp_path / f"only-{pool}.json"
    base = ["plan", path, "--budget", "800K", "--trace", tr, "--profile", prof, "--workers", "1"]
    assert _run(base + ["-o", chosen], capsys)[0] == 0
    code, stdout, err = _run(base + ["--only", pool, "-o", pinned], capsys)
    assert code == 0, err
    plan, single = json.loads(chosen.read_text()), json.loads(pinned.read_text())
    alt = plan["alternatives"][f"{pool} only"]
    assert single["only"] == pool
    assert single["slots"]["per_layer"] == alt["slots"] and single["pools"] == alt["pools"]
    assert single["expected_tpot_s"] == alt["expected_tpot_s"]
    assert all(v == 0 for p, v in single["pools"].items() if p != pool) and single["pools"][pool] > 0
    assert single["planner_choice"]["pools"] == plan["pools"]
    assert single["planner_choice"]["expected_tpot_s"] == plan["expected_tpot_s"]
    assert single["explain"] and single["explain"][0].startswith(f"{pool} only, as asked")
    flat = " ".join(stdout.split())
    assert "written plan" in flat and f"{pool} only, as asked" in flat
    from zipmoe.runtime.engine.core import read_plan

    assert read_plan(str(pinned), cid)["pools"] == single["pools"]


@pytest.mark.parametrize("extra,needle", [(["--only", "hot"], "--only: one of full, compressed, sm_only, e_only"),
                                          (["--only", "full", "--profile-only"], "does not go with --profile-only")])
def test_plan_only_bad_input_is_one_line(container, tmp_path, capsys, extra, needle):
    path, cid = container
    code, _, err = _run(["plan", path, "--budget", "800K", "--profile", _profile(path, cid, tmp_path)] + extra, capsys)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1


def test_plan_without_trace_says_uniform_prior(container, tmp_path, capsys):
    path, cid = container
    code, stdout, _ = _run(["plan", path, "--budget", "2M", "--profile", _profile(path, cid, tmp_path), "--workers", "1"], capsys)
    assert code == 0
    assert "uniform prior" in " ".join(stdout.split())


@pytest.mark.parametrize("budget,needle,exit_code", [("100K", "below the minimum", 1), ("12 parsecs", "cannot read size", 2)])
def test_bad_budget(container, tmp_path, capsys, budget, needle, exit_code):
    path, cid = container
    code, _, err = _run(["plan", path, "--budget", budget, "--profile", _profile(path, cid, tmp_path)], capsys)
    assert code == exit_code and needle in err and len(err.strip().splitlines()) == 1


def test_missing_budget(container, capsys):
    code, _, err = _run(["plan", container[0]], capsys)
    assert code == 2 and "--budget" in err


def test_trace_from_another_model(container, tmp_path, capsys):
    path, cid = container
    tr = _trace(tmp_path / "t.jsonl", "0" * 32)
    code, _, err = _run(["plan", path, "--budget", "1M", "--trace", tr, "--profile", _profile(path, cid, tmp_path)], capsys)
    assert code == 1 and "another model" in err


def test_stale_profile(container, tmp_path, capsys):
    path, cid = container
    prof = _profile(path, cid, tmp_path, machine={"hostname": "elsewhere"})
    code, _, err = _run(["plan", path, "--budget", "1M", "--profile", prof], capsys)
    assert code == 2 and "stale" in err and "another machine" in err
    prof = _profile(path, cid, tmp_path, container={"mtime_ns": 1})
    code, _, err = _run(["plan", path, "--budget", "1M", "--profile", prof], capsys)
    assert code == 2 and "stale" in err and "changed" in err


def test_not_a_container(tmp_path, capsys):
    bad = tmp_path / "x.zmoe"
    bad.write_bytes(b"nope" * 100)
    code, _, err = _run(["plan", bad, "--budget", "1G"], capsys)
    assert code == 1 and err.startswith("zipmoe: error:")


def test_profile_is_measured_cached_and_remeasured_when_the_file_changes(container, tmp_path, _cache):
    from zipmoe.runtime.plan.profile import costs_of, default_profile_path, get_profile

    path, cid = container
    cache = tmp_path / "lib-cache"
    prof, src = get_profile(path, cid, "cpu", workers=1, quick=True, cache_dir=cache)
    assert src == "measured" and default_profile_path(cid, cache_dir=cache).exists()
    assert prof["disk"]["method"] in ("O_DIRECT", "pread+fadvise(DONTNEED)")
    c = costs_of(prof)
    assert c.disk_bw > 0 and c.decomp_bw_per_worker > 0 and c.merge_bw > 0 and c.compute_s_per_expert > 0
    # the other processes' CPU use meanwhile (runtime/plan/busy.py)
    assert prof["load"]["others_cores"] >= 0 and prof["load"]["wall_s"] > 0 and prof["load"]["cores"] >= 1
    assert get_profile(path, cid, "cpu", workers=1, quick=True, cache_dir=cache)[1] == "cached"
    assert not _cache.exists()  # the library reads no ZIPMOE_CACHE_DIR
    assert get_profile(path, cid, "cpu", workers=1, quick=True)[1] == "measured"  # no cache_dir: no cache
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert get_profile(path, cid, "cpu", workers=1, quick=True, cache_dir=cache)[1] == "measured"


def test_profile_measures_the_disk_at_the_runtimes_queue_depth(container, tmp_path):
    """disk.bw_readers: the expert extents read as serving reads them (reader threads sharing
    pieces); the model's channel takes the faster rate and the latency shared by the readers. A
    cached profile of another queue depth (or from before it was measured) is measured again."""
    from zipmoe.codecs.reader import ContainerReader
    from zipmoe.runtime.plan.micro import measure_disk_readers
    from zipmoe.runtime.plan.profile import default_profile_path, get_profile, save_profile
    from zipmoe.runtime.engine.settings import DEFAULT_READERS, EngineSettings

    path, cid = container
    with ContainerReader(path) as r:
        extents = [tuple(e.extent) for e in r.entries if e.role == "expert"]
    got = measure_disk_readers(path, extents, 3, seconds=0.05)
    assert got["readers"] == 3 and got["bytes"] > 0 and got["bw"] > 0
    assert EngineSettings().readers == DEFAULT_READERS
    cache = {"cache_dir": tmp_path / "lib-cache"}
    prof, src = get_profile(path, cid, "cpu", workers=1, quick=True, **cache)
    d, c = prof["disk"], prof["costs"]
    assert src == "measured" and d["readers"] == DEFAULT_READERS and d["bw_readers"] > 0
    assert c["disk_bw"] == max(d["bw"], d["bw_readers"]) and c["disk_latency"] == d["latency_s"] / DEFAULT_READERS
    assert get_profile(path, cid, "cpu", workers=1, quick=True, **cache)[1] == "cached"
    assert get_profile(path, cid, "cpu", workers=1, quick=True, readers=2, **cache)[0]["disk"]["readers"] == 2  # measured again
    del prof["disk"]["readers"]  # a profile cached before queue depth was measured
    save_profile(prof, default_profile_path(cid, **cache))
    assert get_profile(path, cid, "cpu", workers=1, quick=True, **cache)[1] == "measured"


def test_plan_reads_readers_and_the_cache_folder_from_the_environment(container, tmp_path, capsys, monkeypatch, _cache):
    """`zipmoe plan` reads ZIPMOE_READERS (the queue depth the profile is measured at) and
    ZIPMOE_CACHE_DIR (where cached profiles are) and passes them down: a cached profile of queue
    depth 2 is reused under ZIPMOE_READERS=2. A wrong value is one line."""
    from zipmoe.runtime.plan.profile import default_profile_path, save_profile

    path, cid = container
    prof = json.loads(_profile(path, cid, tmp_path).read_text())
    prof["disk"]["readers"] = 2
    prof["marker"] = "cached at queue depth 2"
    save_profile(prof, default_profile_path(cid, "cpu", cache_dir=_cache))
    monkeypatch.setenv("ZIPMOE_READERS", "2")
    code, out, err = _run(["plan", path, "--profile-only", "--json", "--device", "cpu", "--workers", "1"], capsys)
    assert code == 0, err
    assert json.loads(out)["marker"] == "cached at queue depth 2"
    for var, value, needle in [("ZIPMOE_READERS", "x", "ZIPMOE_READERS='x': expected a whole number of at least 1"),
                               ("ZIPMOE_PREFETCH", "yes", "ZIPMOE_PREFETCH='yes': expected 0 or 1")]:
        monkeypatch.setenv(var, value)
        code, _, err = _run(["plan", path, "--profile-only", "--json", "--device", "cpu"], capsys)
        assert code == 2 and err.startswith("zipmoe: error: ") and needle in err and len(err.strip().splitlines()) == 1, err
        monkeypatch.delenv(var)


def test_profile_serving_passes_fetch_every_expert_then_hit_every_one_compressed(container):
    """The profile's serving passes: every chosen expert fetched from the disk, then every one a
    compressed hit (the split of what serving adds, runtime.profile.serving_overheads)."""
    pytest.importorskip("zipmoe.runtime.engine.loader")
    from zipmoe.codecs.reader import ContainerReader
    from zipmoe.runtime.plan.layout import container_layout
    from zipmoe.runtime.plan.passes import measure_runtime

    path, _ = container
    with ContainerReader(path) as r:
        layout = container_layout(r, "bfloat16", "cpu")
    out = measure_runtime(path, layout, "cpu", workers=1, tokens=3, warmup=2, miss_tokens=3)
    assert "serving_error" not in out, out.get("serving_error")
    miss, comp = out["serving"], out["serving_compressed"]
    assert miss["experts_per_layer"] == comp["experts_per_layer"] == layout.top_k
    assert miss["reads"] > 0 and comp["compressed_share"] >= 0.9
    assert comp["layer_makespan_s"] > 0


def test_not_a_trace_and_missing_prompts_fail_before_measuring(container, tmp_path, capsys):
    path, _ = container
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"a": 1}\n')
    code, _, err = _run(["plan", path, "--budget", "1M", "--trace", bad], capsys)
    assert code == 2 and "not a zipmoe trace" in err
    code, _, err = _run(["plan", path, "--budget", "1M", "--calibrate", tmp_path / "none.txt"], capsys)
    assert code == 2 and "cannot read prompts" in err
    assert not (tmp_path / "cache").exists()  # nothing was measured


def test_profile_only_shows_the_profile(container, tmp_path, capsys):
    path, cid = container
    prof = _profile(path, cid, tmp_path)
    code, stdout, _ = _run(["plan", path, "--profile-only", "--profile", prof, "--json"], capsys)
    assert code == 0 and json.loads(stdout)["costs"]["disk_bw"] == 1.0e9
    code, stdout, stderr = _run(["plan", path, "--profile-only", "--profile", prof], capsys)
    assert code == 0 and "O_DIRECT" in stdout and "decompress" in stdout and "other processes" not in stderr
    # measured while other processes kept most of the machine busy: one warning line, still exit 0
    data = json.loads(prof.read_text())
    prof.write_text(json.dumps({**data, "load": {"others_cores": 1.6, "cores": 2, "wall_s": 30.0}}))
    code, stdout, stderr = _run(["plan", path, "--profile-only", "--profile", prof], capsys)
    assert code == 0 and "other processes kept 1.6 of 2 cores busy" in " ".join(stderr.split())


def test_calibrate_runs_the_model_through_the_runtime(container, tmp_path, capsys, _cache):
    pytest.importorskip("zipmoe.runtime.engine.loader")
    path, cid = container
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is the capital of France?\n")
    out = tmp_path / "plan.json"
    code, _, err = _run(["plan", path, "--budget", "1M", "--calibrate", prompts, "--calibrate-tokens", "4",
                         "--profile", _profile(path, cid, tmp_path), "--workers", "1", "-o", out], capsys)
    assert code == 0, err
    plan = json.loads(out.read_text())
    assert plan["trace"]["source"] == "trace" and plan["trace"]["steps"] == 4  # prefill + 3 decode steps
    # the calibration's prefetch figures beside its trace: prefetch is off on the CPU, so no
    # recall and no prefetch credit in the plan
    from zipmoe.runtime.plan.calibrate import prediction_path

    side = prediction_path(plan["trace"]["files"][0])
    assert json.loads(side.read_text())["prefetch"] is False
    assert plan["profile"]["prefetch_recall"] is None and plan["expected_prefetch_credit_s_per_token"] == 0.0
    # the calibration's routing is kept in the cache folder for the default plan (4 calls per layer)
    from zipmoe.runtime.plan.default import read_usage, stats_path

    counts, calls, warn = read_usage(stats_path(_cache, cid), cid)
    assert warn is None and calls == 4 and counts
    os.unlink(side)
    os.unlink(plan["trace"]["files"][0])


def test_layout_budget_accounting_matches_the_runtime(container):
    """planner_layout mirrors runtime.core's accounting: same minimum, working set and dense bytes."""
    loader = pytest.importorskip("zipmoe.runtime.engine.loader")
    if not hasattr(loader, "requirements"):
        pytest.skip("runtime.loader.requirements not available")
    from zipmoe.codecs.reader import ContainerReader
    from zipmoe.runtime.plan.layout import container_layout

    import inspect

    path, _ = container
    cases = [(1, "bfloat16"), (3, "bfloat16")]
    if "dtype" in inspect.signature(loader.requirements).parameters:
        cases.append((2, "float32"))
    for workers, dtype in cases:
        kw = {} if dtype == "bfloat16" else {"dtype": dtype}
        req = loader.requirements(path, workers=workers, device="cpu", **kw)
        with ContainerReader(path) as r:
            lay = container_layout(r, dtype)
        assert lay.dense_bytes == req["dense_bytes"]
        assert lay.min_budget(workers) == req["min_budget"]
        assert lay.scratch_bytes(workers) + (workers + 2) * lay.expert_working == req["working_bytes"]
        assert lay.total_expert_full == req["expert_bytes_full"]


def test_layout_budget_accounting_matches_the_runtime_on_cuda(container):
    """The same on CUDA, by the runtime's own arithmetic for that device (the loader's dry pass
    with a CUDA device runs on the CPU: it allocates nothing): the allocator's rounding of the dense
    tensors, each expert's device buffer and staging slot, the device merge buffer. The layout
    once missed these, and the profile's passes, sized by it, held DeepSeek's experts only 60/40
    split between two pools (docs/planner.md, "The passes' budget")."""
    loader = pytest.importorskip("zipmoe.runtime.engine.loader")
    import torch

    from zipmoe.codecs.reader import ContainerReader
    from zipmoe.runtime.engine.settings import EngineSettings
    from zipmoe.runtime.plan.layout import container_layout

    path, _ = container
    for workers in (1, 3):
        with ContainerReader(path) as r:
            req = loader._load(r, path, 1 << 62, torch.device("cuda"), None, EngineSettings(workers=workers), False, None,
                               "bfloat16", dry=True)
            cpu = loader._load(r, path, 1 << 62, torch.device("cpu"), None, EngineSettings(workers=workers), False, None,
                               "bfloat16", dry=True)
            lay = container_layout(r, "bfloat16", "cuda")
        assert req["working_bytes"] > cpu["working_bytes"]  # (what the CPU's accounting lacks)
        assert lay.dense_bytes == req["dense_bytes"]
        assert lay.min_budget(workers) == req["min_budget"]
        assert lay.scratch_bytes(workers) + (workers + 2) * lay.expert_working == req["working_bytes"]
        assert lay.total_expert_full == req["expert_bytes_full"]


def test_planner_check_measures_every_plan_and_keeps_partial_json(container, tmp_path, capsys):
    """The predicted-vs-measured tool behind docs/benchmarks.md §7: one row per plan, hits that
    add up to the experts each token uses, the JSON rewritten after every plan."""
    pytest.importorskip("zipmoe.runtime.engine.loader")
    from zipmoe.runtime.plan import check as planner_check

    path, cid = container
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is the capital of France?\ndef fibonacci(n):\n")
    plan_path = tmp_path / "plan.json"
    code, _, err = _run(["plan", path, "--budget", "1M", "--trace", _trace(tmp_path / "t.jsonl", cid),
                         "--profile", _profile(path, cid, tmp_path), "--workers", "1", "-o", plan_path], capsys)
    assert code == 0, err
    out = tmp_path / "check.json"
    assert planner_check.main([str(path), "--plan", str(plan_path), "--prompts", str(prompts), "--tokens", "4",
                               "--alternatives", "--workers", "1", "--json-out", str(out)]) == 0
    printed = capsys.readouterr().out
    doc = json.loads(out.read_text())
    plan = json.loads(plan_path.read_text())
    names = [r["plan"] for r in doc["rows"]]
    assert names[0] == "chosen" and len(names) == 1 + sum(1 for n in plan["alternatives"] if n != "no cache")
    for r in doc["rows"]:
        assert r["measured_tpot_s"] > 0 and r["ratio"] == pytest.approx(r["measured_tpot_s"] / r["predicted_tpot_s"])
        assert sum(r["measured_hits"].values()) == pytest.approx(2.0)  # top-2 of 8 experts per layer
        assert r["steps"] == 2 * (4 - 1)  # per prompt: the gaps between its 4 tokens (the prefill excluded)
        assert f"{r['plan']:16s} TPOT predicted" in printed
        assert r["cascade"] is True and "(no cascade)" not in printed
    # the ablation: the same plan with the cache's cascade off, marked as such
    assert planner_check.main([str(path), "--plan", str(plan_path), "--prompts", str(prompts), "--tokens", "4",
                               "--workers", "1", "--no-cascade", "--json-out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["cascade"] for r in doc["rows"]] == [False] and "(no cascade)" in capsys.readouterr().out


def test_planner_check_bad_input_is_one_line(container, tmp_path, capsys):
    from zipmoe.runtime.plan import check as planner_check

    path, _ = container
    bad = tmp_path / "bad.json"
    for content, needle in (("nope", "is not JSON"), ("{}", "is not a plan.json")):
        bad.write_text(content)
        assert planner_check.main([str(path), "--plan", str(bad)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("zipmoe.runtime.plan.check: error: ") and needle in err[0]
    assert planner_check.main([str(path), "--plan", str(tmp_path / "none.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "No such file" in err[0]


def test_a_plan_for_another_dtype_is_named_at_load(container):
    """plan.json records the dtype it was made for; a runtime computing in another one says so in
    one line (chat's and serve's start), and a plan that does not say (hand-written) is taken as is.
    `zipmoe plan --dtype` defaults to what chat computes in (auto), so the two agree by default."""
    import inspect

    import zipmoe
    from zipmoe.runtime.engine.core import plan_dtype_note
    from zipmoe_cli.chat import chat
    from zipmoe_cli.plan import plan as plan_cmd

    path, cid = container
    pools = {"full": 1 << 20, "compressed": 0, "sm_only": 0, "e_only": 0}
    model, _ = zipmoe.load(path, budget="64M", device="cpu", workers=1, dtype="float32",
                           plan={"container_id": cid, "dtype": "bfloat16", "pools": pools})
    try:
        note = model.zipmoe.describe()["plan_note"]
        assert "made for bfloat16 experts" in note and "computes in float32" in note and "--dtype float32" in note
    finally:
        model.zipmoe.close()
    assert plan_dtype_note({"dtype": "float32"}, "torch.float32") is None
    assert plan_dtype_note({"pools": pools}, "torch.float32") is None

    def default(fn, name):
        return inspect.signature(fn).parameters[name].default.default

    assert default(plan_cmd, "dtype") == default(chat, "dtype") == "auto"


def test_profile_measures_the_copy_a_host_pool_admission_makes(container):
    """costs.admit_bw: the serving thread's copy of a fetched tensor's E and SM parts out of a
    read buffer (device_side.own_parts, the function admissions run), bytes per second; the
    copies are exact and of their own (not views the next read overwrites)."""
    from zipmoe.codecs.reader import ContainerReader
    from zipmoe.runtime.engine.device_side import own_parts
    from zipmoe.runtime.plan.layout import expert_tensors
    from zipmoe.runtime.plan.micro import measure_admit
    from zipmoe.runtime.plan.profile import measure

    path, _ = container
    with ContainerReader(path) as r:
        tensors = [t for ts in expert_tensors(r).values() for t in ts][:4]
        got = measure_admit(r, tensors, seconds=0.02)
    per = sum(t.e_bytes + t.sm_bytes for t in tensors) / len(tensors)
    assert got["jobs"] >= len(tensors) and got["bw"] > 0 and got["bytes_per_job"] == pytest.approx(per, rel=0.5)
    buf = np.arange(64, dtype=np.uint8)
    copies = own_parts([buf[8:24], buf[30:31]])
    assert [c.tolist() for c in copies] == [list(range(8, 24)), [30]] and all(c.base is None for c in copies)
    assert measure(path, "cpu", workers=1, quick=True)["costs"]["admit_bw"] > 0
