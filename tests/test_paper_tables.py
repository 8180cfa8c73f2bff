"""The paper's tables over several models and the memory-pressure case: `zipmoe bench --report A
--report B --paper-md/--paper-json`, `--pressure SIZE` (runtime/bench/pressure.py, tables.py)."""

from __future__ import annotations

import json

import psutil
import pytest

from zipmoe.errors import UsageError
from zipmoe.runtime.bench import report, tables
from zipmoe.runtime.bench.pressure import Ballast

M = 400 << 20


def _run(engine, tpot, n=8, batch=1, budget=M, ttft=0.5):
    return {"engine": engine, "budget": budget, "batch": batch, "new_tokens": n, "generated": n, "case": f"b{batch}-n{n}",
            "ttft_s": ttft, "tpot_s": tpot, "e2e_s": ttft + tpot * (n - 1), "tokens_per_s": batch * n / (ttft + tpot * (n - 1)),
            "tokens": [[1] * n] * batch}


def _doc(cid, runs, model_type="qwen2_moe", pressure=None, container="m.zmoe"):
    results = {}
    for r in runs:
        results.setdefault((r["engine"], r["budget"]), {"engine": r["engine"], "budget": r["budget"], "ok": True, "runs": []})["runs"].append(r)
    doc = {"schema": "zipmoe-bench/1", "container": container, "container_id": cid, "results": list(results.values()), "errors": [],
           "configs": [{"engines": sorted({r["engine"] for r in runs}), "budgets": [M]}],
           "model": {"model_type": model_type, "num_layers": 4}, "machine": {"gpu": "NVIDIA H200"}, "device": "cuda"}
    if pressure:
        doc["pressure"] = pressure
    doc["summary"] = report.summarize(runs, None)
    return doc


def test_several_models_and_their_pressure_runs_in_one_set_of_tables():
    """Documents are grouped by container: two of one model combine (the later case over the
    earlier, other cases kept), its --pressure document becomes its memory-pressure table, the
    encoder-decoder says what TTFT and TPOT mean there."""
    a1 = _doc("A", [_run("zipmoe", 0.2), _run("accelerate", 2.0)], container="ds.zmoe")
    a2 = _doc("A", [_run("zipmoe", 0.1), _run("zipmoe", 0.3, batch=4)], container="ds.zmoe")  # a later sitting
    ap = _doc("A", [_run("zipmoe", 0.12), _run("accelerate", 5.0)], container="ds.zmoe",
              pressure={"leave_bytes": 8 << 30, "occupied_bytes": 100 << 30, "held_to_the_end": True, "swap_bytes": 0})
    b = _doc("B", [_run("zipmoe", 0.05)], model_type="switch_transformers", container="sw.zmoe")
    al = _doc("A", [_run("llama.cpp", 0.9)], container="ds.zmoe")
    al["device"] = "cpu"  # llama.cpp's CPU build beside the GPU engines
    t = tables.build_all([a1, a2, al, ap, b])
    assert t["schema"] == tables.MULTI_SCHEMA and [m["name"].split()[0] for m in t["models"]] == ["ds", "sw"]
    ds, sw = t["models"]
    lat = {r["engine"]: r for r in ds["tables"]["latency"]["rows"]}
    assert lat["zipmoe"]["tpot_s"]["value"] == pytest.approx(0.1)  # the later sitting's
    assert lat["accelerate"]["tpot_s"]["value"] == pytest.approx(2.0)  # kept from the first
    assert ds["tables"]["throughput"]["batches"] == [1, 4]
    assert lat["llama.cpp"]["tpot_s"]["value"] == pytest.approx(0.9)
    assert any(n.startswith("llama.cpp: measured with --device cpu (the other engines: cuda)") for n in ds["notes"])
    pr = {r["engine"]: r for r in ds["tables"]["pressure"]["rows"]}
    # an engine whose run without pressure had another length: its own longest, marked @N
    ap2 = _doc("A", [_run("zipmoe", 0.12, n=32)], pressure={"leave_bytes": 1 << 30, "held_to_the_end": True})
    pz = tables.build_all([a2, ap2])["tables"]["pressure"]["rows"][0]
    assert pz["tpot_s"]["value"] == pytest.approx(0.1) and pz["tpot_s"]["new_tokens"] == 8 and pz["new_tokens"] == 32
    assert pr["accelerate"]["slowdown"] == pytest.approx(2.5) and pr["zipmoe"]["slowdown"] == pytest.approx(1.2)
    assert "100 G occupied" in ds["tables"]["pressure"]["title"]
    assert "pressure" not in sw["tables"] and sw["tables"]["latency"]["encoder_decoder"]
    assert "encoder" in sw["tables"]["latency"]["title"] and "decoder-only" in ds["tables"]["latency"]["title"]
    md = tables.markdown(t)
    assert md.count("### ") == 2 and "memory pressure" in md and "| accelerate | 400 M | b1 n8 | 2.00 s | 5.00 s | 2.50x |" in md
    assert json.loads(json.dumps(t))["models"][1]["name"].startswith("sw")
    one = tables.build_all([b])  # one model: the single-model document, as before
    assert one["schema"] == tables.SCHEMA


def test_a_ballast_that_died_is_a_note():
    a = _doc("A", [_run("zipmoe", 0.1)])
    ap = _doc("A", [_run("zipmoe", 0.1)], pressure={"leave_bytes": 1 << 30, "held_to_the_end": False, "swap_bytes": 4 << 30})
    t = tables.build_all([a, ap])
    assert any("not under pressure" in n for n in t["notes"]) and any("swap" in n for n in t["notes"])


def test_ballast_occupies_the_memory_and_lets_it_go():
    avail = psutil.virtual_memory().available
    want = 192 << 20
    with Ballast(avail - want, log=lambda *_: None) as b:
        assert b.alive()
        rss = psutil.Process(b.record["pid"]).memory_info().rss
        assert rss >= 0.9 * b.record["occupied_bytes"]  # every page written, so held
        assert abs(b.record["occupied_bytes"] - want) < (64 << 20)
    assert not b.alive() and b.record["held_to_the_end"] is True
    with pytest.raises(UsageError, match="available now"):
        Ballast(avail + (8 << 30)).__enter__()
    with pytest.raises(UsageError, match="leave at least"):
        Ballast(1 << 20).__enter__()


def test_cli_several_reports_need_a_paper_output(tmp_path, capsys):
    from zipmoe_cli.app import main

    paths = []
    for cid in ("A", "B"):
        d = _doc(cid, [_run("zipmoe", 0.1)], container=f"{cid}.zmoe")
        p = tmp_path / f"{cid}.json"
        p.write_text(json.dumps(d))
        paths.append(p)
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--report", str(paths[0]), "--report", str(paths[1])])
    assert exc.value.code == 2 and "--paper" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--report", str(paths[0]), "--report", str(paths[1]), "--paper-md", str(tmp_path / "t.md"),
              "--paper-json", str(tmp_path / "t.json")])
    assert exc.value.code in (0, None)
    assert (tmp_path / "t.md").read_text().count("### ") == 2
    assert json.loads((tmp_path / "t.json").read_text())["schema"] == tables.MULTI_SCHEMA
    for size, line in (("1K", "leave at least"), ("100000G", "available now")):
        with pytest.raises(SystemExit) as exc:
            main(["bench", str(tmp_path / "x.zmoe"), "--budget", "1M", "--pressure", size])
        assert exc.value.code == 2 and line in capsys.readouterr().err


def test_latency_at_the_length_most_engines_ran_and_the_others_at_their_own():
    """The baselines ran 32 tokens, zipmoe's engines 64: the table is at 64 (more pairs ran it) and
    the baselines' cells are their 32-token figures, marked @32, with the note saying what @ means."""
    d = _doc("A", [_run("zipmoe", 0.1, n=64), _run("zipmoe-basic", 0.2, n=64), _run("zipmoe-pools", 0.15, n=64),
                   _run("accelerate", 2.0, n=32), _run("zipmoe", 0.12, n=32)])
    t = tables.build(d)
    lat = {r["engine"]: r for r in t["tables"]["latency"]["rows"]}
    assert t["tables"]["latency"]["new_tokens"] == 64
    assert lat["zipmoe"]["tpot_s"]["value"] == pytest.approx(0.1) and "new_tokens" not in lat["zipmoe"]["tpot_s"]
    assert lat["accelerate"]["tpot_s"]["value"] == pytest.approx(2.0) and lat["accelerate"]["tpot_s"]["new_tokens"] == 32
    md = tables.markdown(t)
    assert "| accelerate | 400 M | 500.0 ms @32 | 2.00 s @32 |" in md and "@N:" in md


def test_an_output_that_cannot_be_written_is_one_line(tmp_path, capsys):
    from zipmoe_cli.app import main

    p = tmp_path / "A.json"
    p.write_text(json.dumps(_doc("A", [_run("zipmoe", 0.1)])))
    blocker = tmp_path / "file"
    blocker.write_text("")
    for opt in ("--paper-md", "--paper-json"):
        with pytest.raises(SystemExit) as exc:
            main(["bench", "--report", str(p), opt, str(blocker / "x")])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and f"{opt} {blocker / 'x'}: cannot write it" in err and "internal error" not in err


def test_sittings_on_two_machines_mark_each_figure_with_its_machine():
    """Merged sittings of one model on an H200 and an H100: each figure carries its machine's letter,
    the notes name the letters, the ablation gives no speed-up across machines, and a failure of the
    first sitting that the second overcame (DeepSpeed's build) is not the engine's state any more."""
    old = _doc("A", [_run("zipmoe", 0.2), _run("zipmoe-basic", 0.25), _run("accelerate", 2.0)])
    old["started"] = "2026-12-04T04:25:36"
    old["errors"] = [{"engine": "deepspeed", "error": "building its async_io op failed"}]
    new = _doc("A", [_run("zipmoe", 0.1), _run("deepspeed", 3.0)])
    new["machine"] = {"gpu": "NVIDIA H100 80GB HBM3"}
    new["started"] = "2026-12-07T22:30:00"
    t = tables.build_all([old, new])
    assert "[A] measured on NVIDIA H200, 2026-12-04 (sittings merged: compare figures of one letter; the ablation's " \
           "speed-ups and the slow-downs under pressure are given only within one)" in t["notes"]
    assert any(n.startswith("[B] measured on NVIDIA H100 80GB HBM3, 2026-12-07") for n in t["notes"])
    assert not any("cannot run" in n for n in t["notes"]), t["notes"]
    lat = {r["engine"]: r for r in t["tables"]["latency"]["rows"]}
    assert lat["zipmoe"]["tpot_s"]["machine"] == "B" and lat["accelerate"]["tpot_s"]["machine"] == "A"
    assert lat["deepspeed"]["tpot_s"]["value"] == pytest.approx(3.0)
    abl = {r["engine"]: r for r in t["tables"]["ablation"]["rows"]}
    assert abl["zipmoe-basic"]["speedup_over_basic"] == pytest.approx(1.0) and abl["zipmoe"]["speedup_over_basic"] is None
    md = tables.markdown(t)
    assert "Measured on 2 machines, marked [A], [B]" in md and "| zipmoe | 400 M | 500.0 ms [B] | 100.0 ms [B] |" in md, md
    # a pressure case of the first sitting against the second's run without pressure: no slow-down across machines
    ap = _doc("A", [_run("zipmoe", 0.12), _run("accelerate", 2.2)], pressure={"leave_bytes": 8 << 30, "held_to_the_end": True})
    ap["started"] = old["started"]
    pr = {r["engine"]: r for r in tables.build_all([old, new, ap])["tables"]["pressure"]["rows"]}
    assert pr["zipmoe"]["tpot_pressure_s"]["machine"] == "A" and pr["zipmoe"]["tpot_s"]["machine"] == "B"
    assert pr["zipmoe"]["slowdown"] is None and pr["accelerate"]["slowdown"] == pytest.approx(1.1)
    # a later sitting that failed the engine again, otherwise: its error is the engine's state, the earlier one gone
    again = _doc("A", [_run("zipmoe", 0.1)])
    again["machine"], again["started"] = new["machine"], new["started"]
    again["errors"] = [{"engine": "deepspeed", "budget": M, "error": "its NVMe offload needs 5 swap buffers"}]
    notes = tables.build_all([old, again])["notes"]
    assert any("swap buffers" in n for n in notes) and not any("async_io" in n for n in notes), notes
    # one machine: no letters, no such notes, the speed-up given
    one = tables.build_all([_doc("A", [_run("accelerate", 2.0), _run("zipmoe-basic", 0.2)]), _doc("A", [_run("zipmoe", 0.1)])])
    assert not any(n.startswith("[") for n in one["notes"]) and "machine" not in one["tables"]["latency"]["rows"][0]["tpot_s"]
    assert {r["engine"]: r for r in one["tables"]["ablation"]["rows"]}["zipmoe"]["speedup_over_basic"] == pytest.approx(2.0)


def test_throughput_marks_a_run_of_another_length_than_the_batchs_usual_one():
    """Throughput takes each engine's longest run at a batch; where that is not the length the
    batch's other runs have (a 512-token run beside 64-token ones, §27c), the cell says so (@512)."""
    doc = _doc("A", [_run("zipmoe", 0.1, n=64), _run("zipmoe", 0.08, n=512), _run("zipmoe-basic", 0.12, n=64),
                     _run("accelerate", 1.0, n=64)])
    t = tables.build_all([doc])
    thr = {r["engine"]: r["by_batch"]["1"] for r in t["tables"]["throughput"]["rows"]}
    assert thr["zipmoe"]["new_tokens"] == 512 and "new_tokens" not in thr["zipmoe-basic"], thr
    md = tables.markdown(t)
    row = next(line for line in md.splitlines() if line.startswith("| zipmoe | ") and "@512" in line)
    assert "@512" in row and "each engine's longest run at that batch" in md
