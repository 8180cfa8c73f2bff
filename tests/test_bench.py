"""`zipmoe bench` without running engines: report math, cgroup detection, cold modes, CLI errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from zipmoe.errors import UsageError
from zipmoe.runtime.bench import cgroup as bench_cgroup
from zipmoe.runtime.bench import cold as bench_cold
from zipmoe.runtime.bench import engines as bench_engines
from zipmoe.runtime.bench import inputs as bench_inputs
from zipmoe.runtime.bench import report as bench_report
from zipmoe.runtime.bench import run as bench_run


# ----------------------------------------------------------------------------- report math


def _run(engine, budget, tpot, ttft=0.5, batch=1, n=5, gen=None, eng_bytes=None, io_bytes=None, tokens=None, case="b1-n5"):
    gen = n if gen is None else gen
    return {"engine": engine, "budget": budget, "batch": batch, "new_tokens": n, "generated": gen, "case": case,
            "tpot_s": tpot, "ttft_s": ttft, "e2e_s": ttft + tpot * (gen - 1), "tokens_per_s": batch * gen / (ttft + tpot * (gen - 1)),
            "decode_bytes_read_engine": eng_bytes, "decode_bytes_read_io": io_bytes, "peak_rss_run_bytes": 100,
            "tokens": tokens if tokens is not None else [[1, 2, 3, 4, 5][:gen]] * batch}


def test_stats_median_min_max():
    s = bench_report.stats([3.0, 1.0, 2.0, None])
    assert s == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert bench_report.stats([None]) is None


def test_floor_uses_engine_counters_then_proc_io():
    # 4 decode tokens after the first; the runtime says 400 MB were fetched while decoding
    r = _run("zipmoe", 1 << 30, 0.125, eng_bytes=400_000_000, io_bytes=999)
    assert bench_report.bytes_per_token(r) == 100_000_000
    assert bench_report.io_floor_tpot(100_000_000, 1e9) == pytest.approx(0.1)
    e = bench_report.enrich(r, 1e9)
    assert e["floor_tpot_s"] == pytest.approx(0.1)
    assert e["tpot_over_floor"] == pytest.approx(1.25)
    # no runtime counters (a Hugging Face engine): /proc/self/io
    r2 = _run("accelerate", 1 << 30, 1.0, io_bytes=4_000)
    assert bench_report.bytes_per_token(r2) == 1_000
    # no bandwidth known, or one token only: no floor
    assert bench_report.io_floor_tpot(1.0, None) is None
    assert bench_report.bytes_per_token(_run("zipmoe", 1, 0.1, gen=1, eng_bytes=5)) is None


def test_summary_and_ratios_against_each_baseline():
    G = 1 << 30
    runs = [
        _run("zipmoe", G, 0.10), _run("zipmoe", G, 0.12), _run("zipmoe", G, 0.30),
        _run("accelerate", G, 2.0), _run("accelerate", G, 1.0),
        _run("uncompressed", G, 0.15),
        _run("resident", None, 0.05),
        _run("zipmoe", 2 * G, 0.08),
    ]
    rows = bench_report.summarize(runs, disk_bw=None)
    z = next(r for r in rows if r["engine"] == "zipmoe" and r["budget"] == G)
    assert z["runs"] == 3 and z["tpot_s"]["median"] == pytest.approx(0.12)
    assert z["tpot_s"]["min"] == pytest.approx(0.10) and z["tpot_s"]["max"] == pytest.approx(0.30)
    rats = {(x["engine"], x["baseline"], x["budget"]): x for x in bench_report.ratios(rows)}
    assert rats[("zipmoe", "accelerate", G)]["tpot_x"] == pytest.approx(1.5 / 0.12)
    assert rats[("zipmoe", "uncompressed", G)]["tpot_x"] == pytest.approx(0.15 / 0.12)
    # resident has no budget: compared at every budget
    assert rats[("zipmoe", "resident", G)]["tpot_x"] == pytest.approx(0.05 / 0.12)
    assert rats[("zipmoe", "resident", 2 * G)]["tpot_x"] == pytest.approx(0.05 / 0.08)
    assert ("zipmoe", "accelerate", 2 * G) not in rats  # no accelerate run at 2G
    assert all(x["engine"] in bench_report.ZIPMOE_ENGINES for x in rats.values())


def test_paired_ratios_are_taken_round_by_round():
    """--rounds: each engine's TPOT over the first engine's in the same round, then the median
    and range of those ratios. A drift between rounds (round 2 twice as slow for everyone)
    leaves the per-round ratios alone, where pooled medians would mix it in."""
    G = 1 << 30

    def r(engine, tpot, rnd, budget=G):
        x = _run(engine, budget, tpot)
        if rnd is not None:
            x["round"] = rnd
        return x

    runs = [r("zipmoe", 0.100, 0), r("zipmoe-basic", 0.110, 0), r("zipmoe-pools", 0.090, 0),
            r("zipmoe", 0.200, 1), r("zipmoe-basic", 0.180, 1), r("zipmoe-pools", 0.200, 1),
            r("zipmoe", 0.150, 2), r("zipmoe-basic", 0.150, 2),  # zipmoe-pools missed round 3
            r("zipmoe-basic", 0.500, None),  # an untagged run (an earlier --merge): not paired
            r("zipmoe", 0.1, 0, budget=2 * G), r("zipmoe-basic", 0.1, 0, budget=2 * G)]  # one round: no row
    rows = {(x["engine"], x["budget"]): x for x in bench_report.paired(runs, ["zipmoe", "zipmoe-basic", "zipmoe-pools"])}
    b = rows[("zipmoe-basic", G)]
    assert b["against"] == "zipmoe" and b["rounds"] == 3
    assert b["per_round"] == pytest.approx([1.1, 0.9, 1.0]) and b["tpot_x"] == pytest.approx(1.0)
    assert (b["min"], b["max"]) == (pytest.approx(0.9), pytest.approx(1.1))
    p = rows[("zipmoe-pools", G)]
    assert p["rounds"] == 2 and p["per_round"] == pytest.approx([0.9, 1.0])
    assert ("zipmoe-basic", 2 * G) not in rows and ("zipmoe", G) not in rows
    assert bench_report.paired([x for x in runs if x.get("round") == 0], None) == []  # one round: nothing
    assert bench_report.render_paired([], None) is None and bench_report.render_paired(list(rows.values()), None) is not None


def test_rounds_alternate_the_order_of_the_engines():
    pairs = [("zipmoe", 1), ("zipmoe-basic", 1), ("zipmoe", 2)]
    assert bench_run.round_schedule(pairs, 1) == [(0, "zipmoe", 1), (0, "zipmoe-basic", 1), (0, "zipmoe", 2)]
    assert [x[1:] for x in bench_run.round_schedule(pairs, 3)] == pairs + pairs[::-1] + pairs
    assert [x[0] for x in bench_run.round_schedule(pairs, 2)] == [0, 0, 0, 1, 1, 1]


def test_summary_shows_the_counted_peak_beside_the_gpu_peak():
    G = 1 << 30
    a, b = _run("zipmoe", G, 0.1), _run("zipmoe", G, 0.1)
    a["memory"] = {"peak_counted_bytes": 900 << 20, "counted_bytes": 800 << 20}
    b["memory"] = {"peak_counted_bytes": 950 << 20, "counted_bytes": 800 << 20}
    a["cuda_peak_bytes"], b["cuda_peak_bytes"] = 700 << 20, 1000 << 20
    row = bench_report.summarize([a, b, _run("accelerate", G, 1.0)], disk_bw=None)
    z = next(r for r in row if r["engine"] == "zipmoe")
    assert z["peak_counted_bytes"] == 950 << 20 and z["cuda_peak_bytes"] == 1000 << 20
    assert bench_report._fmt_held(z) == "950 M · 1000 M"
    assert bench_report._fmt_held(next(r for r in row if r["engine"] == "accelerate")) == "–"


def test_summary_shows_the_serving_threads_work_per_fetched_tensor():
    from rich.console import Console

    G = 1 << 30
    a, b = _run("zipmoe", G, 0.1), _run("zipmoe", G, 0.1)
    # 300 fetched tensors (full hits are not fetched) in each run; 60 ms of host work over both
    a["counters"] = {"hits": {"full": 700, "none": 200, "e_only": 100},
                     "time_s": {"host": 0.024, "admit": 0.006, "predict": 0.003, "wait": 0.3, "decode": 1.2},
                     "host_parts": {"lookup": 0.002, "issue": 0.008, "report": 0.001, "to_device": 0.001, "release": 0.002}}
    b["counters"] = {"hits": {"full": 700, "none": 300}, "time_s": {"host": 0.036, "admit": 0.006, "predict": 0.003, "wait": 0.3},
                     "host_parts": {"lookup": 0.004, "issue": 0.012, "report": 0.002, "to_device": 0.001, "release": 0.004}}
    rows = bench_report.summarize([a, b, _run("accelerate", G, 1.0)], disk_bw=None)
    h = next(r for r in rows if r["engine"] == "zipmoe")["host_work"]
    assert h["fetched"] == 300 and h["host"] == pytest.approx(100.0) and h["admit"] == pytest.approx(20.0)
    assert h["decode"] == pytest.approx(2000.0)  # the workers' 1.2 s over both runs' 600 fetched tensors
    assert h["parts"]["issue"] == pytest.approx(100 / 3) and h["parts"]["other"] == pytest.approx(100.0 - 20.0 - 37e3 / 600)
    assert next(r for r in rows if r["engine"] == "accelerate")["host_work"] is None  # no runtime counters
    con = Console(width=250, record=True)
    assert bench_report.render_host_work(rows, console=con) is not None
    line = next(x for x in con.export_text().splitlines() if x.startswith("│zipmoe"))
    assert line.split("│")[6].strip() == "100" and line.split("│")[7].strip() == "20"  # host, admit
    assert line.split("│")[-2].strip() == "2000"  # the decode workers' time beside it
    # a run from before the split: host and admit, the parts left blank
    del a["counters"]["host_parts"], b["counters"]["host_parts"]
    assert "parts" not in bench_report.summarize([a, b], disk_bw=None)[0]["host_work"]
    assert bench_report.render_host_work(bench_report.summarize([_run("accelerate", G, 1.0)], None)) is None


def test_token_check_common_prefix_and_mismatch():
    same = [_run("resident", None, 0.1, tokens=[[1, 2, 3, 4, 5]]), _run("accelerate", 1, 1.0, gen=2, tokens=[[1, 2]]),
            _run("zipmoe", 1, 0.1, tokens=[[1, 2, 3, 4, 5]])]
    tc = bench_report.token_check(same)
    assert tc["same"] and tc["compared"] == 2
    bad = same + [_run("uncompressed", 1, 0.1, tokens=[[1, 2, 9, 4, 5]])]
    tc = bench_report.token_check(bad)
    assert not tc["same"]
    assert tc["mismatches"][0]["first_difference_at"] == 2 and tc["mismatches"][0]["reference"].startswith("resident")
    assert "DIFFER" in tc["message"]
    assert bench_report.token_check([_run("zipmoe", 1, 0.1)])["compared"] == 0


def test_render_table_and_plot_message(monkeypatch):
    from rich.console import Console

    runs = [_run("zipmoe", 1 << 30, 0.1, eng_bytes=10 << 20), _run("accelerate", 1 << 30, 1.0)]
    rows = bench_report.summarize(runs, 1e9)
    con = Console(width=250, record=True)
    bench_report.render_table(rows, bench_report.ratios(rows), console=con)
    text = con.export_text()
    assert "vs accelerate" in text and "10.00x" in text
    import builtins

    real_import = builtins.__import__

    def no_mpl(name, *a, **k):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    with pytest.raises(UsageError, match=r"zipmoe\[bench\]"):
        bench_report.plot(rows, "x.png")


# ----------------------------------------------------------------------------- inputs


def test_cases_left_padded_and_prompts(tmp_path):
    cases = bench_inputs.make_cases([[5, 6, 7], [8]], pad=0, batches=[1, 3], new_tokens=[4, 8])
    assert [c["id"] for c in cases] == ["b1-n4", "b1-n8", "b3-n4", "b3-n8"]
    c = cases[2]
    assert c["input_ids"] == [[5, 6, 7], [0, 0, 8], [5, 6, 7]]
    assert c["attention_mask"] == [[1, 1, 1], [0, 0, 1], [1, 1, 1]]
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "a b"}\n\n"plain"\n')
    assert bench_inputs.read_prompts(p) == ["a b", "plain"]
    with pytest.raises(UsageError, match="no such file"):
        bench_inputs.read_prompts(tmp_path / "missing.txt")
    ids, pad, origin = bench_inputs.tokenize(["x", "yy"], None, {"vocab_size": 50, "pad_token_id": 3}, 64, 0)
    assert pad == 3 and "synthetic" in origin and all(0 <= t < 50 for row in ids for t in row)
    assert bench_inputs.tokenize(["x", "yy"], None, {"vocab_size": 50}, 64, 0)[0] == ids  # deterministic


def test_parse_lists_and_engines():
    assert bench_run.parse_int_list("1,4, 16", "--batch") == [1, 4, 16]
    for bad in ("", "a", "0", "1,-2"):
        with pytest.raises(UsageError):
            bench_run.parse_int_list(bad, "--batch")
    with pytest.raises(UsageError, match="unknown engine"):
        bench_engines.engine("vllm")
    cfg = bench_run.BenchConfig(container=None, engines=["zipmoe", "resident", "accelerate"], budgets=[1, 2])
    assert bench_run.plan_work(cfg) == [("zipmoe", 1), ("zipmoe", 2), ("resident", None), ("accelerate", 1), ("accelerate", 2)]
    assert bench_engines.hf_max_memory(100, "cuda") == {0: 100, "cpu": 0}
    assert bench_engines.hf_max_memory(100, "cpu") == {"cpu": 100}
    p = bench_engines.engine_plan("zipmoe-basic", None, "abc")
    assert p["container_id"] == "abc" and p["pools"]["compressed"] == 0 and p["pools"]["full"] > 0
    assert bench_engines.engine_plan("zipmoe-pools", "plan.json") is None
    assert bench_engines.engine_plan("zipmoe", "plan.json") == "plan.json"
    assert bench_engines.engine_plan("zipmoe-noprefetch", "plan.json") == "plan.json"


def test_noprefetch_engine_loads_the_plan_without_prefetch(monkeypatch):
    """The +prefetch ablation's baseline: the same plan, prefetch=False; zipmoe leaves the default."""
    from zipmoe.runtime.engine import loader

    seen = []

    def fake_load(path, budget, device, plan=None, **kw):
        seen.append((plan, kw.get("prefetch", "default")))
        return object(), None

    monkeypatch.setattr(loader, "load", fake_load)
    for name in ("zipmoe-noprefetch", "zipmoe"):
        bench_engines.load_engine({"engine": name, "device": "cpu", "budget": 1 << 30, "container": "m.zmoe", "plan": "p.json"})
    assert seen == [("p.json", False), ("p.json", "default")]


def test_every_engine_computes_the_checkpoints_dtype(monkeypatch, tmp_path):
    """The zipmoe engines load with dtype="auto", as chat does and as the Hugging Face engines
    load, and their KV allowance is counted in that dtype (float32: 4 bytes a value)."""
    import json

    from zipmoe.runtime.bench import worker
    from zipmoe.runtime.engine import loader

    seen = []

    def fake_load(path, budget, device, plan=None, **kw):
        seen.append(kw.get("dtype"))
        return object(), None

    monkeypatch.setattr(loader, "load", fake_load)
    bench_engines.load_engine({"engine": "zipmoe", "device": "cpu", "budget": 1 << 30, "container": "m.zmoe"})
    assert seen == ["auto"] == [bench_engines.BENCH_DTYPE]

    class Reader:
        def __init__(self, path):
            self.config = json.loads(path.read_text())

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    import zipmoe.codecs.reader as reader_mod

    monkeypatch.setattr(reader_mod, "ContainerReader", Reader)
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64,
           "max_position_embeddings": 512}
    spec = {"engine": "zipmoe", "device": "cpu", "context": 100, "cases": [{"input_ids": [[1, 2]]}]}
    sizes = {}
    for dtype in ("float32", "bfloat16"):
        f = tmp_path / f"{dtype}.json"
        f.write_text(json.dumps(dict(cfg, torch_dtype=dtype)))
        sizes[dtype] = worker.kv_allowance(dict(spec, container=f))
    assert sizes["float32"] == 2 * sizes["bfloat16"] == 2 * (2 * 2 * 100 * (16 + 16) * 2)


def test_missing_accelerate_names_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "accelerate" else real(name, *a))
    msg = bench_engines.missing_extra("accelerate")
    assert "pip install 'zipmoe[bench]'" in msg
    assert bench_engines.missing_extra("resident") is None


# ----------------------------------------------------------------------------- cgroups


V1_MOUNTS = """31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
35 31 0:32 / {v1} rw,relatime - cgroup cgroup rw,memory
41 31 0:38 / {v2} rw,relatime - cgroup2 cgroup2 rw
"""
V2_ONLY = "41 31 0:38 / {v2} rw,relatime - cgroup2 cgroup2 rw\n"


def test_detect_v1_memory_controller(tmp_path):
    v1 = tmp_path / "memory"
    (v1 / "sessions" / "me").mkdir(parents=True)
    v2 = tmp_path / "unified"
    v2.mkdir()
    (v2 / "cgroup.controllers").write_text("hugetlb\n")
    s = bench_cgroup.detect(V1_MOUNTS.format(v1=v1, v2=v2), "4:memory:/sessions/me\n0::/\n", probe=False)
    assert s.usable and s.version == 1 and s.parent == str(v1 / "sessions" / "me")
    assert any("no memory controller" in n for n in s.notes)


def test_detect_v2_and_its_failures(tmp_path):
    v2 = tmp_path / "cg2"
    me = v2 / "user" / "me"
    me.mkdir(parents=True)
    (me / "cgroup.controllers").write_text("cpu memory pids\n")
    (me / "cgroup.subtree_control").write_text("memory\n")
    s = bench_cgroup.detect(V2_ONLY.format(v2=v2), "0::/user/me\n", probe=False)
    assert s.usable and s.version == 2 and s.parent == str(me)
    (me / "cgroup.controllers").write_text("cpu pids\n")
    s = bench_cgroup.detect(V2_ONLY.format(v2=v2), "0::/user/me\n", probe=False)
    assert not s.usable and "no memory" in s.reason
    s = bench_cgroup.detect("", "0::/\n", probe=False)
    assert not s.usable and "no memory cgroup" in s.reason
    s = bench_cgroup.detect(V2_ONLY.format(v2=v2), "0::/not/there\n", probe=False)
    assert not s.usable


def _busy_v2_tree(tmp_path, monkeypatch, pids, fork_on=None, fail_on=None, errno_first=None):
    """A fake cgroup v2 own folder holding ``pids``, with the kernel's rules for the two writes.

    ``+memory`` into subtree_control fails with EBUSY while the own cgroup.procs lists a pid
    (or with ``errno_first`` the first time); writing a pid into a cgroup.procs moves it out of
    the own folder. ``fork_on``: {pid: new pid} appears in the own folder when pid is moved (a
    fork during the move); ``fail_on``: {pid: errno} the move of that pid fails with.
    """
    import errno

    v2 = tmp_path / "cg2"
    me = v2 / "process_api" / "abc"
    me.mkdir(parents=True)
    (me / "cgroup.controllers").write_text("cpu memory pids\n")
    (me / "cgroup.subtree_control").write_text("")
    (me / "cgroup.procs").write_text("".join(f"{p}\n" for p in pids))
    calls = {"enable": 0, "moves": []}

    def own_pids():
        return [int(x) for x in (me / "cgroup.procs").read_text().split()]

    def enable(folder):
        assert folder == me
        calls["enable"] += 1
        if errno_first is not None and calls["enable"] == 1:
            raise OSError(errno_first, os.strerror(errno_first))
        if own_pids():
            raise OSError(errno.EBUSY, "Device or resource busy")
        (folder / "cgroup.subtree_control").write_text("memory\n")

    def move(procs_file, pid):
        calls["moves"].append((procs_file, pid))
        if fail_on and pid in fail_on:
            if fail_on[pid] == errno.ESRCH:  # the process has exited: it is gone from cgroup.procs too
                (me / "cgroup.procs").write_text("".join(f"{p}\n" for p in own_pids() if p != pid))
            raise OSError(fail_on[pid], os.strerror(fail_on[pid]))
        left = [p for p in own_pids() if p != pid]
        if fork_on and pid in fork_on:
            left.append(fork_on[pid])
        (me / "cgroup.procs").write_text("".join(f"{p}\n" for p in left))
        with open(procs_file, "a") as f:
            f.write(f"{pid}\n")

    monkeypatch.setattr(bench_cgroup, "_enable_memory_for_children", enable)
    monkeypatch.setattr(bench_cgroup, "_move_pid", move)
    return V2_ONLY.format(v2=v2), "0::/process_api/abc\n", me, calls


def test_detect_v2_busy_moves_nothing_without_the_option(tmp_path, monkeypatch):
    mounts, own, me, calls = _busy_v2_tree(tmp_path, monkeypatch, [101, 102])
    s = bench_cgroup.detect(mounts, own, probe=False)
    assert not s.usable and calls["enable"] == 1
    assert "--cgroup-move-to-leaf" in s.reason and "Device or resource busy" in s.reason
    assert calls["moves"] == [] and not (me / "zipmoe-leaf").exists()
    assert (me / "cgroup.procs").read_text().split() == ["101", "102"]
    assert (me / "cgroup.subtree_control").read_text() == ""


def test_detect_v2_busy_moves_to_leaf(tmp_path, monkeypatch):
    import errno

    # 102 forks 104 while it is moved (a second pass is needed); 999 exits before its move (ESRCH)
    mounts, own, me, calls = _busy_v2_tree(tmp_path, monkeypatch, [101, 102, 999, 103, 105, 106, 107], fork_on={102: 104},
                                           fail_on={999: errno.ESRCH})
    s = bench_cgroup.detect(mounts, own, probe=False, move_to_leaf=True)
    assert s.usable and s.version == 2 and s.parent == str(me), s.reason
    leaf = me / "zipmoe-leaf"
    assert sorted(int(p) for p in (leaf / "cgroup.procs").read_text().split()) == [101, 102, 103, 104, 105, 106, 107]
    assert (me / "cgroup.procs").read_text().split() == []
    assert all(f == leaf / "cgroup.procs" for f, _ in calls["moves"])
    assert "memory" in (me / "cgroup.subtree_control").read_text().split() and calls["enable"] == 2
    moved = [n for n in s.notes if n.startswith("moved ")]
    assert moved == [f"moved 7 processes of {me} into {leaf} so that the memory controller could be enabled "
                     f"for children (cgroup v2 no-internal-process rule)"]


def test_detect_v2_from_inside_the_leaf_uses_its_parent(tmp_path, monkeypatch):
    """A second bench run from a process already moved into zipmoe-leaf (seen on the GPU VM:
    every stage nested one leaf deeper): engine cgroups go beside the leaf, nothing moves."""
    mounts, own, me, calls = _busy_v2_tree(tmp_path, monkeypatch, [101, 102])
    assert bench_cgroup.detect(mounts, own, probe=False, move_to_leaf=True).usable
    leaf = me / "zipmoe-leaf"
    (leaf / "cgroup.controllers").write_text("cpu memory pids\n")
    (leaf / "cgroup.subtree_control").write_text("")
    moves = len(calls["moves"])
    s = bench_cgroup.detect(mounts, "0::/process_api/abc/zipmoe-leaf\n", probe=False, move_to_leaf=True)
    assert s.usable and s.parent == str(me), s.reason
    assert len(calls["moves"]) == moves and not (leaf / "zipmoe-leaf").exists()
    assert any("engine cgroups go beside it" in n for n in s.notes)


def test_detect_v2_move_to_leaf_failures_are_reasons(tmp_path, monkeypatch):
    import errno

    # the move of 102 is refused: 101 stays moved, 103 is not tried, nothing raises
    mounts, own, me, calls = _busy_v2_tree(tmp_path / "a", monkeypatch, [101, 102, 103], fail_on={102: errno.EPERM})
    s = bench_cgroup.detect(mounts, own, probe=False, move_to_leaf=True)
    assert not s.usable and "failed part way (1 moved" in s.reason and "cannot move process 102" in s.reason
    assert [p for _, p in calls["moves"]] == [101, 102] and calls["enable"] == 1
    assert (me / "cgroup.procs").read_text().split() == ["102", "103"]
    # processes that keep forking: give up after the passes, say so
    forks = {100 + i: 101 + i for i in range(20)}
    mounts, own, me, calls = _busy_v2_tree(tmp_path / "b", monkeypatch, [100], fork_on=forks)
    s = bench_cgroup.detect(mounts, own, probe=False, move_to_leaf=True)
    assert not s.usable and "still in" in s.reason and len(calls["moves"]) == 5
    # another error than EBUSY (here EACCES): moving would not help, so nothing is moved
    mounts, own, me, calls = _busy_v2_tree(tmp_path / "c", monkeypatch, [101], errno_first=errno.EACCES)
    s = bench_cgroup.detect(mounts, own, probe=False, move_to_leaf=True)
    assert not s.usable and calls["moves"] == [] and "--cgroup-move-to-leaf" not in s.reason
    assert "Permission denied" in s.reason


def test_cgroup_module_main_passes_move_to_leaf(monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(bench_cgroup, "detect", lambda **kw: seen.append(("detect", kw)) or bench_cgroup.CgroupSupport(False, reason="t"))
    monkeypatch.setattr(bench_cgroup, "check_page_cache_cap", lambda **kw: seen.append(("check", kw)) or {})
    assert bench_cgroup.main(["--move-to-leaf"]) == 0
    assert seen == [("detect", {"move_to_leaf": True}), ("check", {"move_to_leaf": True})]
    seen.clear()
    assert bench_cgroup.main(["--no-check"]) == 0 and seen == [("detect", {"move_to_leaf": False})]
    capsys.readouterr()
    assert bench_cgroup.main(["--move-to-leaves"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--move-to-leaves" in err[0]


def test_bench_passes_cgroup_move_to_leaf_to_detect(tmp_path, monkeypatch, capsys):
    class Stop(Exception):
        pass

    seen = []

    def fake_detect(**kw):
        seen.append(kw)
        raise Stop

    monkeypatch.setattr(bench_cgroup, "detect", fake_detect)
    monkeypatch.setattr(bench_run, "_container_info", lambda path: ({}, {}, "cid"))
    monkeypatch.setattr(bench_run, "machine_info", lambda device: {})
    f = tmp_path / "m.zmoe"
    f.write_bytes(b"")
    for flag in (True, False):
        cfg = bench_run.BenchConfig(container=f, engines=[], budgets=[], device="cpu", work_dir=tmp_path / "w", cgroup_move_to_leaf=flag)
        with pytest.raises(Stop):
            bench_run.run_bench(cfg, log=lambda m: None)
    assert seen == [{"move_to_leaf": True}, {"move_to_leaf": False}]
    # the CLI flag reaches BenchConfig
    got = []
    monkeypatch.setattr(bench_run, "run_bench", lambda cfg, **kw: got.append(cfg) or (_ for _ in ()).throw(UsageError("stop")))
    code, err = _cli(["bench", str(f), "--budget", "1G", "--device", "cpu", "--cgroup-move-to-leaf"], capsys)
    assert code == 2 and got[-1].cgroup_move_to_leaf is True and got[-1].cgroup is True
    code, err = _cli(["bench", str(f), "--budget", "1G", "--device", "cpu"], capsys)
    assert code == 2 and got[-1].cgroup_move_to_leaf is False
    code, err = _cli(["bench", str(f), "--budget", "1G", "--no-cgroup", "--cgroup-move-to-leaf"], capsys)
    assert code == 2 and len(err) == 1 and "contradict" in err[0] and len(got) == 2


@pytest.mark.skipif(not bench_cgroup.detect().usable, reason="no writable memory cgroup on this machine")
def test_real_cgroup_create_limit_remove():
    support = bench_cgroup.detect()
    with bench_cgroup.MemoryCgroup(support, 64 << 20) as cg:
        assert cg.path.is_dir()
        st = cg.stats()
        assert st["limit_bytes"] == 64 << 20 and st["oom_kills"] == 0
        assert cg.env()[bench_cgroup.ENV_CGROUP] == str(cg.path)
    assert not cg.path.exists()


@pytest.mark.skipif(not bench_cgroup.detect().usable, reason="no writable memory cgroup on this machine")
def test_real_cgroup_oom_kill_is_seen():
    import subprocess
    import sys

    support = bench_cgroup.detect()
    with bench_cgroup.MemoryCgroup(support, 48 << 20) as cg:
        env = dict(os.environ, **cg.env())
        code = "from zipmoe.runtime.bench.cgroup import join_from_env; join_from_env(); x = bytearray(200 << 20); x[::4096] = b'1' * len(x[::4096])"
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True)
        assert proc.returncode != 0
        assert cg.oom_kills() >= 1


def test_cold_modes_and_bandwidth(tmp_path):
    f = tmp_path / "data.bin"
    f.write_bytes(os.urandom(3 << 20))
    assert bench_cold.fadvise_dontneed([tmp_path]) == 1
    mode = bench_cold.make_cold([f], allow_drop_caches=False)
    assert mode == "fadvise"
    assert bench_cold.cold_mode_available([f]) in ("drop_caches", "fadvise")
    assert bench_cold.cold_mode_available([f], allow_drop_caches=False) == "fadvise"
    bw = bench_cold.disk_bandwidth(f, max_bytes=2 << 20, block=1 << 20)
    assert bw["bytes"] == 2 << 20 and bw["bytes_per_s"] > 0
    assert bench_cold._field({"costs": {"disk_bw": 5.0}}, ("disk_bw",)) == 5.0


# ----------------------------------------------------------------------------- CLI errors


def _cli(argv, capsys):
    from zipmoe_cli.app import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    return exc.value.code, err


def test_cli_bad_input_one_line(capsys, tmp_path):
    code, err = _cli(["bench", str(tmp_path / "x.zmoe"), "--baseline", "vllm", "--budget", "1G"], capsys)
    assert code == 2 and len(err) == 1 and "unknown baseline 'vllm'" in err[0]
    code, err = _cli(["bench", str(tmp_path / "x.zmoe"), "--budget", "lots"], capsys)
    assert code == 2 and "cannot read size" in err[0]
    code, err = _cli(["bench", str(tmp_path / "x.zmoe"), "--budget", "1G", "--batch", "1,x"], capsys)
    assert code == 2 and "--batch" in err[0]
    code, err = _cli(["bench", str(tmp_path / "x.zmoe"), "--budget", "1G", "--cold-method", "sync"], capsys)
    assert code == 2 and len(err) == 1 and "unknown --cold-method 'sync'" in err[0]
    code, err = _cli(["bench", "--report", str(tmp_path / "none.json")], capsys)
    assert code == 2 and "no such file" in err[0]
    code, err = _cli(["bench", str(tmp_path / "x.zmoe"), "--budget", "1G", "--device", "cpu"], capsys)
    assert code == 2 and "no such .zmoe" in err[0]


def test_cli_cuda_without_gpu(capsys, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    code, err = _cli(["bench", str(tmp_path / "x.zmoe"), "--budget", "1G", "--device", "cuda"], capsys)
    assert code == 1 and len(err) == 1 and "no CUDA device" in err[0]


def test_cli_plot_without_matplotlib(capsys, tmp_path):
    try:
        import matplotlib  # noqa: F401

        pytest.skip("matplotlib is installed")
    except ImportError:
        pass
    code, err = _cli(["bench", str(tmp_path / "x.zmoe"), "--budget", "1G", "--plot", str(tmp_path / "p.png")], capsys)
    assert code == 2 and "pip install 'zipmoe[bench]'" in err[0]


def test_report_only_roundtrip(tmp_path, capsys):
    G = 1 << 30
    doc = {"schema": bench_run.SCHEMA, "container": "m.zmoe", "device": "cpu", "disk_bw": {"bytes_per_s": 1e9, "source": "test"},
           "cgroup": {"usable": False, "reason": "test"}, "cold_mode": "fadvise",
           "results": [{"engine": "zipmoe", "budget": G, "runs": [_run("zipmoe", G, 0.1, eng_bytes=4e8)]},
                       {"engine": "accelerate", "budget": G, "runs": [_run("accelerate", G, 1.0)]}]}
    p = tmp_path / "out.json"
    p.write_text(json.dumps(doc))
    from zipmoe_cli.app import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", "--report", str(p)])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "10.00x" in out and "same greedy tokens" in out
    done = bench_run.finalize(json.loads(p.read_text()))
    assert done["ratios"][0]["tpot_x"] == pytest.approx(10.0)
    assert done["summary"][0]["floor_tpot_s"]["median"] == pytest.approx(0.1)


def test_merge_adds_cases_instead_of_dropping_them():
    """bench --merge: a batch-4 run of an engine keeps that engine's earlier batch-1 runs."""
    from zipmoe.runtime.bench.merge import merge_runs

    old = {"engine": "zipmoe", "budget": 1, "runs": [{"batch": 1, "new_tokens": 12, "tpot_s": 0.1},
                                                     {"batch": 4, "new_tokens": 12, "tpot_s": 0.5}]}
    new = {"engine": "zipmoe", "budget": 1, "runs": [{"batch": 4, "new_tokens": 12, "tpot_s": 0.4}]}
    merged = merge_runs(new, old)
    assert [(r["batch"], r["tpot_s"]) for r in merged["runs"]] == [(1, 0.1), (4, 0.4)]
    assert merge_runs({"runs": []}, {"runs": []})["runs"] == []


def test_an_oom_kill_names_the_limits_parts():
    """A worker the cgroup killed sends no report: the line still gives its baseline (what the
    limit holds beyond budget, KV cache and margin) instead of '0 B'."""
    from zipmoe.runtime.bench import run as bench_run

    spec = {"engine": "zipmoe", "budget": 800 << 20, "cgroup_margin": 256 << 20, "context": 4096, "device": "cuda"}
    line = bench_run._oom_line(spec, {}, (800 + 256 + 512) << 20)
    assert line.startswith("engine zipmoe cannot run in budget 800") and "own 512" in line and "KV cache" not in line
    assert "own 300" in bench_run._oom_line(spec, {"process_base_rss_bytes": 300 << 20}, 2 << 30)


def test_merge_keeps_why_a_case_could_not_run():
    """A failed case stays 'cannot run' (with its line) after a later --merge run of other cases
    of the same engine succeeds; a case the later run measured loses its old error."""
    from zipmoe.runtime.bench import tables
    from zipmoe.runtime.bench.merge import merge_runs

    old = {"engine": "zipmoe", "budget": 1, "ok": False, "error": "killed by the memory cgroup",
           "runs": [{"batch": 1, "new_tokens": 32}], "case_errors": {"b16-n32": "killed by the memory cgroup", "b1-n128": "killed"}}
    new = {"engine": "zipmoe", "budget": 1, "ok": True, "runs": [{"batch": 1, "new_tokens": 128}]}
    merged = merge_runs(new, old)
    assert merged["case_errors"] == {"b16-n32": "killed by the memory cgroup"}
    st = tables._status({"results": [merged]})
    assert st[("zipmoe", 1)]["cases"] == {(16, 32): "killed by the memory cgroup"} and "error" not in st[("zipmoe", 1)]
    cell = tables._cell(st, {}, "zipmoe", 1, (16, 32), "tpot_s")
    assert cell["text"] == "cannot run" and "cgroup" in cell["why"]
    assert tables._cell(st, {}, "zipmoe", 1, (4, 32), "tpot_s")["text"] == "not measured"


def test_bench_context_follows_the_run():
    from zipmoe.runtime.bench.inputs import run_context

    cases = [{"input_ids": [[1] * 20], "new_tokens": 32}, {"input_ids": [[1] * 20] * 4, "new_tokens": 512}]
    assert run_context(cases) == 576  # 20 + 512 + 1 -> 576
    assert run_context([{"input_ids": [[1] * 10], "new_tokens": 3}]) == 64


def test_llamacpp_engine_feeds_the_forced_stream():
    """The llama.cpp engine under teacher forcing evaluates each step's forced token (and keeps
    its own argmax for the agreement figure); sampling it cannot do, and its record says so."""
    from zipmoe.runtime.bench.llamacpp_engine import LlamaCppModel
    from zipmoe.runtime.bench.worker import RssSampler

    class FakeLlama:
        def __init__(self):
            self.fed = []

        def reset(self):
            self.fed = []

        def eval(self, toks):
            self.fed += list(toks)

    m = LlamaCppModel.__new__(LlamaCppModel)
    m.llm = FakeLlama()
    m._greedy_next = lambda: 7  # a model stuck on one token: greedy would loop
    sampler = RssSampler()
    try:
        case = {"input_ids": [[0, 3, 4]], "attention_mask": [[0, 1, 1]], "new_tokens": 4, "workload": "corpus",
                "forced": [[10, 11, 12, 13]]}
        rec = m.bench_run_case(case, {}, sampler, "warm", lambda: {})
        assert rec["tokens"] == [[10, 11, 12, 13]] and rec["argmax_tokens"] == [[7, 7, 7, 7]]
        assert m.llm.fed == [3, 4, 10, 11, 12] and rec["workload"] == "corpus" and rec["cycle"] is None
        rec = m.bench_run_case(dict(case, workload="sample", forced=None, new_tokens=12), {}, sampler, "warm", lambda: {})
        assert rec["workload"] == "greedy (sampling not supported)" and rec["cycle"] == 1
    finally:
        sampler.stop()


def test_token_check_compares_the_argmax_under_teacher_forcing():
    from zipmoe.runtime.bench import report

    base = {"batch": 1, "new_tokens": 3, "case": "b1-n3", "workload": "corpus", "tokens": [[5, 6, 7]]}
    runs = [dict(base, engine="zipmoe", budget=1, argmax_tokens=[[1, 2, 3]]),
            dict(base, engine="accelerate", budget=1, argmax_tokens=[[1, 2, 4]])]
    tc = report.token_check(runs)
    assert not tc["same"] and tc["mismatches"][0]["first_difference_at"] == 2
    assert tc["compared_on"] == "argmax under teacher forcing"
    runs[1]["argmax_tokens"] = [[1, 2, 3]]
    assert report.token_check(runs)["same"]
    # runs of another workload are another case: not compared with these, and summarised apart
    runs.append(dict(base, engine="zipmoe", budget=1, workload="greedy", tokens=[[9, 9, 9]]))
    assert report.token_check(runs)["compared"] == 1
    assert len(report.summarize(runs, None)) == 3


def test_preload_counts_model_code_in_the_baseline():
    """The worker imports the family's modeling module (and, for zipmoe on the CPU, the numba merge
    kernel) before it measures its own baseline: those hundreds of MiB belong to the process, not
    to the margin over the budget (the demo in float32 at 800M was killed by its cgroup without
    it). In a fresh interpreter, so that nothing is imported already."""
    import subprocess
    import sys

    code = """
import sys, json
from zipmoe.runtime.bench.worker import preload_model_code
before = "transformers.models.mixtral.modeling_mixtral" in sys.modules
got = preload_model_code({"model_type": "mixtral", "engine": "zipmoe", "device": "cpu"})
bad = preload_model_code({"model_type": "no_such_model", "engine": "accelerate", "device": "cpu"})
odd = preload_model_code({"model_type": "../x", "engine": "accelerate", "device": "cpu"})
gguf = preload_model_code({"model_type": "mixtral", "engine": "llama.cpp", "device": "cpu"})
print(json.dumps([before, got, "transformers.models.mixtral.modeling_mixtral" in sys.modules, bad, odd, gguf]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"}).stdout.strip().splitlines()[-1]
    before, got, after, bad, odd, gguf = json.loads(out)
    assert not before and after
    assert got == ["transformers.models.mixtral.modeling_mixtral", "zipmoe.kernels.cpu"]
    assert bad == [] and odd == []  # unknown or odd names: nothing, no error (loading reports them)
    assert gguf == []  # llama.cpp builds no transformers model, and runs no zipmoe kernel


@pytest.mark.gpu
def test_preload_on_cuda_takes_the_first_forwards_host_memory():
    """On CUDA the worker's preload also runs what a first forward loads (cuBLAS, the attention
    kernels, Triton's merge kernel), so that their host memory (about 0.76 GiB on the H200) is in
    the measured baseline: a first forward after it adds little host RSS. In a fresh process."""
    import subprocess
    import sys

    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    code = """
import json, psutil, torch
import torch.nn.functional as F
from zipmoe.runtime.bench.worker import preload_model_code
rss = lambda: psutil.Process().memory_info().rss
torch.zeros(1, device="cuda")  # the worker creates the CUDA context before it preloads
r0 = rss()
got = preload_model_code({"model_type": "qwen2_moe", "engine": "zipmoe", "device": "cuda"})
r1 = rss()
# a decode step's kinds of work at a real shape: bf16 GEMMs at batch 1 and 4, attention
for rows in (1, 4):
    x = torch.randn(rows, 2048, dtype=torch.bfloat16, device="cuda")
    F.linear(x, torch.randn(5632, 2048, dtype=torch.bfloat16, device="cuda"))
q = torch.randn(1, 16, 1, 128, dtype=torch.bfloat16, device="cuda")
k = torch.randn(1, 16, 40, 128, dtype=torch.bfloat16, device="cuda")
F.scaled_dot_product_attention(q, k, k)
torch.cuda.synchronize()
print(json.dumps([got, r1 - r0, rss() - r1]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"}).stdout.strip().splitlines()[-1]
    got, preload_bytes, after_bytes = json.loads(out)
    assert {"cuda: cublas", "cuda: attention"} <= set(got)
    print(f"preload {preload_bytes / 2**20:.0f} MiB, the first forward after it {after_bytes / 2**20:.0f} MiB")
    assert after_bytes < 128 << 20, (preload_bytes, after_bytes)


def test_a_killed_benchs_cgroup_is_swept_by_the_next(tmp_path):
    """A bench killed by a signal leaves its ``zipmoe-bench-<pid>-*`` cgroup behind (on 7 Dec two
    CI runs killed mid-test left one, and the next run's check that bench removes its cgroups
    failed); the next bench removes those whose pid is gone and that hold no process, and leaves
    a running bench's and anything else alone."""
    import subprocess
    import sys

    from zipmoe.runtime.bench.cgroup import sweep_stale

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"zipmoe-bench-{dead.pid}-0123abcd"
    mine = tmp_path / f"zipmoe-bench-{os.getpid()}-4567ef01"
    busy = tmp_path / f"zipmoe-bench-{dead.pid}-89abcdef"  # not empty: rmdir refuses (a cgroup with a process)
    other = tmp_path / "zipmoe-leaf"
    for d in (stale, mine, busy, other):
        d.mkdir()
    (busy / "cgroup.procs").write_text("1\n")
    assert sweep_stale(tmp_path) == [stale.name]
    assert not stale.exists() and mine.exists() and busy.exists() and other.exists()
    assert sweep_stale(tmp_path / "missing") == []
