"""`zipmoe bench` end to end on a tiny MoE on the CPU: real worker processes, real cgroups
where the machine has them, the zipmoe runtime against Accelerate's disk offload."""

from __future__ import annotations

import json
import os

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_container(tmp_path_factory):
    """A 2-layer Qwen2-MoE (8 experts, top 2) saved by transformers and packed."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig

    from zipmoe.codecs.writer import pack

    root = tmp_path_factory.mktemp("bench")
    cfg = Qwen2MoeConfig(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    src = root / "tiny"
    model.save_pretrained(src)
    pack(src, root / "tiny.zmoe")
    return root


def test_bench_end_to_end_cpu(tiny_container, capsys):
    from zipmoe_cli.app import main

    root = tiny_container
    out = root / "out.json"
    argv = ["bench", str(root / "tiny.zmoe"), "--baseline", "accelerate", "--budget", "2M",
            "--batch", "2", "--new-tokens", "6", "--runs", "1", "--cold", "--cold-method", "fadvise", "--device", "cpu", "--threads", "1",
            "--source", str(root / "tiny"), "--json", str(out), "--workload", "corpus"]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr()
    assert exc.value.code == 0, err.err[-2000:]
    doc = json.loads(out.read_text())
    ok = {(r["engine"], r["budget"]) for r in doc["results"] if r.get("ok")}
    assert ok == {("zipmoe", 2 << 20), ("accelerate", 2 << 20)}
    assert doc["token_check"]["same"], doc["token_check"]
    assert "same greedy tokens" in err.out
    z = next(r for r in doc["summary"] if r["engine"] == "zipmoe")
    assert z["generated"] == 6 and z["tpot_s"]["median"] > 0 and z["ttft_s"]["median"] > 0
    run = next(r for d in doc["results"] if d["engine"] == "zipmoe" and d.get("ok") for r in d["runs"])
    assert sum(run["counters"]["hits"].values()) > 0 and len(run["tokens"]) == 2
    # the corpus workload: every engine decoded the same teacher-forced stream (hashed word ids:
    # this model has no tokenizer), compared on the model's argmax at each forced step
    acc = next(r for d in doc["results"] if d["engine"] == "accelerate" and d.get("ok") for r in d["runs"])
    assert doc["prompts"]["workload"] == "corpus" and "hashed word ids" in doc["prompts"]["ids"]
    assert run["workload"] == acc["workload"] == "corpus" and run["tokens"] == acc["tokens"]
    assert run["argmax_tokens"] == acc["argmax_tokens"] and doc["token_check"]["compared_on"] == "argmax under teacher forcing"
    assert run["distinct_tokens"] >= 6 and run["cycle"] is None and acc["distinct_tokens"] == run["distinct_tokens"]
    assert run["distinct_experts"] > 0 and run["cache_capacity_experts"] >= 0 and run["diagnostics_source"]
    assert run["hit_rate_first_quarter"] is not None and run["hit_rate_last_quarter"] is not None
    assert run["belady_hit_rate"] is not None and "belady_hit_rate" not in acc
    assert "MIN" in err.out and "distinct" in err.out
    assert run["bytes_read_engine"] is not None
    # no --context: the run's own length (prompt + new tokens, rounded up to 64), not 4096
    assert run["decode_loop"] and run["context"] % 64 == 0 and run["context"] <= 256 and run["stop"] == "max_new_tokens"
    assert any(x["engine"] == "zipmoe" and x["baseline"] == "accelerate" and x["tpot_x"] for x in doc["ratios"])
    assert doc["disk_bw"]["bytes_per_s"] > 0
    assert doc["cold_mode"] == "fadvise"  # --cold-method fadvise: never drop_caches, even as root
    assert {r["cold_mode"] for d in doc["results"] if d.get("ok") for r in d["runs"]} == {"fadvise"}
    if doc["cgroup"]["usable"]:
        res = next(d for d in doc["results"] if d["engine"] == "zipmoe")
        stats = res["cgroup_stats"]
        # tightened by the worker to budget + its measured baseline + margin + the KV cache (on top of the budget)
        assert res["kv_allowance_bytes"] == run["kv_bytes"] > 0  # batch 2 x 256 positions (the model's limit)
        assert stats["limit_bytes"] == ((2 << 20) + res["process_base_rss_bytes"] + doc["cgroup"]["slack_bytes"]
                                        + res["kv_allowance_bytes"])
        assert stats["peak_bytes"] <= stats["limit_bytes"]
    # the modeling code and the CPU merge kernel were imported before that baseline was measured
    res = next(d for d in doc["results"] if d["engine"] == "zipmoe")
    assert any(m.startswith("transformers.models.") for m in res["preloaded"]) and "zipmoe.kernels.cpu" in res["preloaded"]
    assert not any(p.name.startswith("zipmoe-bench-") for p in _cgroup_children(doc))


def test_failing_engine_keeps_partial_results(tiny_container, monkeypatch, capsys):
    """An engine that cannot run in its budget: the others' results stay in out.json, one line, exit 1.
    (The worker is stubbed: the real ones are exercised above.)"""
    from zipmoe.runtime.bench import run as bench_run
    from zipmoe_cli.app import main

    root = tiny_container

    def fake_worker(spec, support, limit, log_path, on_progress, timeout_s=None):
        if spec["budget"] == 1 << 10:
            return {"engine": spec["engine"], "budget": spec["budget"], "ok": False, "runs": [], "user_error": True,
                    "error": "budget 1.00 KiB is too small: this model needs at least 300.00 KiB", "error_type": "BudgetError"}
        on_progress()
        run = {"engine": spec["engine"], "budget": spec["budget"], "batch": 1, "new_tokens": 2, "generated": 2, "case": "b1-n2",
               "ttft_s": 0.1, "tpot_s": 0.05, "e2e_s": 0.15, "tokens_per_s": 13.3, "tokens": [[1, 2]]}
        return {"engine": spec["engine"], "budget": spec["budget"], "ok": True, "runs": [run]}

    monkeypatch.setattr(bench_run, "run_worker", fake_worker)
    out = root / "partial.json"
    with pytest.raises(SystemExit) as exc:
        main(["bench", str(root / "tiny.zmoe"), "--engine", "zipmoe", "--budget", "1K", "--budget", "2M", "--runs", "1",
              "--new-tokens", "2", "--device", "cpu", "--json", str(out), "--disk-bw", "1G"])
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("zipmoe: error")]
    assert exc.value.code == 1 and len(err) == 1
    assert "engine zipmoe" in err[0] and "too small" in err[0]
    doc = json.loads(out.read_text())
    assert [(d["engine"], d["budget"], d["ok"]) for d in doc["results"]] == [("zipmoe", 1 << 10, False), ("zipmoe", 2 << 20, True)]
    assert doc["summary"][0]["tpot_s"]["median"] == pytest.approx(0.05)
    assert doc["errors"][0]["budget"] == 1 << 10


def test_engine_timeout_kills_the_worker_and_says_so(tiny_container, capsys):
    """A worker past --engine-timeout is killed with its children: one line, exit 1, the result
    recorded as timed out (not as a budget failure), no cgroup left behind."""
    root = tiny_container
    out = root / "timeout.json"
    code, cap = _main_code(["bench", str(root / "tiny.zmoe"), "--engine", "zipmoe", "--budget", "2M", "--runs", "1", "--new-tokens", "2",
                            "--device", "cpu", "--json", str(out), "--disk-bw", "1G", "--engine-timeout", "0.2",
                            "--work-dir", str(root / "work-timeout")], capsys)
    err = [x for x in cap.err.splitlines() if x.startswith("zipmoe: error")]
    assert code == 1 and len(err) == 1, err
    assert "did not finish in 0.2 s" in err[0] and "--engine-timeout" in err[0]
    doc = json.loads(out.read_text())
    res = doc["results"][0]
    assert not res["ok"] and res["error_type"] == "Timeout" and res["returncode"] == -9
    assert not any(p.name.startswith("zipmoe-bench-") for p in _cgroup_children(doc))
    code, _ = _main_code(["bench", str(root / "tiny.zmoe"), "--budget", "2M", "--engine-timeout", "-1"], capsys)
    assert code == 2


def test_rounds_run_every_engine_again_and_pair_them(tiny_container, capsys):
    """--rounds 2: every engine runs once per round (its own worker, its own log), the runs are
    tagged with their round and pooled in the summary, and the paired table gives zipmoe-basic
    against zipmoe round by round; --rounds 0 is one line and exit 2."""
    root = tiny_container
    out = root / "rounds.json"
    work = root / "work-rounds"
    code, cap = _main_code(["bench", str(root / "tiny.zmoe"), "--engine", "zipmoe", "--engine", "zipmoe-basic", "--budget", "2M",
                            "--runs", "1", "--rounds", "2", "--new-tokens", "4", "--device", "cpu", "--threads", "1",
                            "--cold", "--cold-method", "fadvise", "--json", str(out), "--work-dir", str(work)], capsys)
    assert code == 0, cap.err[-2000:]
    doc = json.loads(out.read_text())
    assert doc["configs"][-1]["rounds"] == 2
    for res in doc["results"]:
        assert res["ok"] and sorted(r["round"] for r in res["runs"]) == [0, 1], res["engine"]
    assert {r["engine"]: r["runs"] for r in doc["summary"]} == {"zipmoe": 2, "zipmoe-basic": 2}
    (pair,) = doc["paired"]
    assert pair["engine"] == "zipmoe-basic" and pair["against"] == "zipmoe" and pair["rounds"] == 2
    assert pair["min"] <= pair["tpot_x"] <= pair["max"] and len(pair["per_round"]) == 2
    assert "round by round" in cap.out
    assert sorted(p.name for p in work.glob(f"worker-zipmoe-{2 << 20}-*.log")) == [
        f"worker-zipmoe-{2 << 20}-b1-n4-r1.log", f"worker-zipmoe-{2 << 20}-b1-n4-r2.log"]
    assert doc["token_check"]["same"]
    code, cap = _main_code(["bench", str(root / "tiny.zmoe"), "--budget", "2M", "--rounds", "0"], capsys)
    err = [x for x in cap.err.splitlines() if x.startswith("zipmoe: error")]
    assert code == 2 and err == ["zipmoe: error: --rounds must be at least 1, got 0"], cap.err


def _main_code(argv, capsys):
    from zipmoe_cli.app import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    return exc.value.code, capsys.readouterr()


def _cgroup_children(doc):
    parent = doc["cgroup"].get("parent")
    if not parent or not os.path.isdir(parent):
        return []
    from pathlib import Path

    return [p for p in Path(parent).iterdir() if p.is_dir()]


def test_bench_encoder_decoder_counts_the_decoder_tokens(tmp_path, capsys):
    """SwitchTransformers (encoder-decoder): the prompt goes to the encoder once, the decoder makes
    the new tokens after its start token; every engine's record holds exactly those tokens (the
    teacher-forced stream), so TTFT, TPOT, tokens/s and the token check count the decoder's
    steps (a slice by the prompt's length left none: generated 0, tokens/s 0)."""
    from zipmoe.codecs.writer import pack
    from zipmoe.runtime.synth.writer import write

    src = tmp_path / "sw"
    write("switch_transformers", src, "tiny", progress=False)
    pack(src, tmp_path / "sw.zmoe")
    out = tmp_path / "sw.json"
    import psutil

    leave = psutil.virtual_memory().available - (768 << 20)  # and under --pressure: 768 MiB occupied while the engines run
    code, cap = _main_code(["bench", str(tmp_path / "sw.zmoe"), "--engine", "zipmoe", "--engine", "accelerate", "--budget", "2M",
                            "--batch", "1", "--new-tokens", "5", "--runs", "1", "--device", "cpu", "--threads", "1",
                            "--disk-bw", "1G", "--source", str(src), "--json", str(out), "--work-dir", str(tmp_path / "w"),
                            "--pressure", str(leave)], capsys)
    assert code == 0, cap.err[-2000:]
    doc = json.loads(out.read_text())
    assert doc["pressure"]["held_to_the_end"] and doc["pressure"]["occupied_bytes"] > (256 << 20)
    assert not psutil.pid_exists(doc["pressure"]["pid"]) or psutil.Process(doc["pressure"]["pid"]).status() == psutil.STATUS_ZOMBIE
    runs = {d["engine"]: d["runs"][0] for d in doc["results"] if d.get("ok")}
    assert set(runs) == {"zipmoe", "accelerate"}
    for r in runs.values():
        assert r["generated"] == 5 and len(r["tokens"][0]) == 5 and r["tokens_per_s"] > 0
        assert r["distinct_tokens"] >= 2 and len(r["argmax_tokens"][0]) == 5
    assert runs["zipmoe"]["tokens"] == runs["accelerate"]["tokens"]
    assert runs["zipmoe"]["argmax_tokens"] == runs["accelerate"]["argmax_tokens"] and doc["token_check"]["same"]


def test_bench_prints_predicted_against_measured(tiny_container, capsys, tmp_path):
    """With a plan judged on recorded routing and a profile with served state costs, every zipmoe
    run carries the plan's prediction (zipmoe-basic: the plan's 'full only' alternative) and the
    cost model charged for the run's own routing, and bench prints them against the measurement."""
    import numpy as np

    from zipmoe.codecs.reader import ContainerReader
    from zipmoe.runtime.plan.profile import PROFILE_FORMAT, PROFILE_REVISION, container_info, machine_info
    from zipmoe_cli.app import main

    root = tiny_container
    zm = root / "tiny.zmoe"
    with ContainerReader(zm) as r:
        cid = r.container_id
    prof = {"format": PROFILE_FORMAT, "revision": PROFILE_REVISION, "machine": machine_info("cpu"),
            "container": container_info(zm, cid), "dtype": "bfloat16", "disk": {"method": "O_DIRECT", "bw": 1e9},
            "decomp": {"codec": "zstd"}, "merge": {"kernel": "numba"}, "compute": {"s_per_expert": 40e-6, "torch_threads": 1},
            "costs": {"disk_bw": 1.0e9, "disk_latency": 60e-6, "decomp_bw_per_worker": 1.5e9, "merge_bw": 3e9,
                      "compute_s_per_expert": 40e-6},
            "step_costs": {"resident_step_s": 0.004, "graphs": False,
                           "per_expert_s": {"full": 0.0, "compressed": 0.0004, "sm_only": 0.0005, "e_only": 0.0006,
                                            "none": 0.0008}}}
    pf = tmp_path / "profile.json"
    pf.write_text(json.dumps(prof))
    rng = np.random.default_rng(0)
    tr = tmp_path / "t.jsonl"
    with open(tr, "w") as f:  # a prefill, then decode steps (their input shape marks them)
        f.write(json.dumps({"container_id": cid, "num_layers": 2, "num_experts": 8, "top_k": 2}) + "\n")
        f.write(json.dumps({"layers": {str(l): [rng.choice(8, 2, replace=False).tolist() for _ in range(4)] for l in (0, 1)},
                            "input": [1, 4]}) + "\n")
        for _ in range(40):
            f.write(json.dumps({"layers": {str(l): [rng.choice(8, 2, replace=False).tolist()] for l in (0, 1)},
                                "input": [1, 1]}) + "\n")
    plan = tmp_path / "plan.json"
    with pytest.raises(SystemExit) as exc:
        main(["plan", str(zm), "--budget", "2M", "--trace", str(tr), "--profile", str(pf), "--workers", "1", "-o", str(plan)])
    assert exc.value.code in (0, None), capsys.readouterr().err[-2000:]
    p = json.loads(plan.read_text())
    assert p["hit_model"] == "replay" and "hits: the best" in capsys.readouterr().out
    out = tmp_path / "out.json"
    argv = ["bench", str(zm), "--engine", "zipmoe", "--engine", "zipmoe-basic", "--engine", "zipmoe-default", "--plan", str(plan), "--profile", str(pf),
            "--budget", "2M", "--batch", "1", "--new-tokens", "6", "--runs", "1", "--cold", "--cold-method", "fadvise",
            "--device", "cpu", "--threads", "1", "--json", str(out), "--workload", "corpus", "--work-dir", str(tmp_path / "w")]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr()
    assert exc.value.code == 0, err.err[-2000:]
    doc = json.loads(out.read_text())
    runs = {d["engine"]: d["runs"][0] for d in doc["results"] if d.get("ok")}
    assert runs["zipmoe"]["predicted_tpot_s"] == pytest.approx(p["expected_tpot_s"])
    assert runs["zipmoe-basic"]["predicted_tpot_s"] == pytest.approx(p["alternatives"]["full only"]["expected_tpot_s"])
    for r in runs.values():
        assert r["model_tpot_s"] >= 0.004 and sum(r["model_hits"].values()) == pytest.approx(2)
        # the replay of the run's routing accounts for every use the counters saw
        assert sum(r["model_tensor_hits"].values()) == sum(r["counters"]["hits"].values())
        # the process's RSS sampled through the run: the first token, then every RSS_EVERY (16)
        assert [s[0] for s in r["rss_by_token"]] == [1] and r["rss_by_token"][0][1] > 0 and r["rss_by_token"][0][2] is None
    assert "predicted against measured" in err.out and "replay" in err.out
    # the default plan (no --plan: fitted at load from the profile) says which plan it fitted, as chat does
    line = next(d for d in doc["results"] if d["engine"] == "zipmoe-default")["load_info"]["default_plan"]
    assert " ".join(f"zipmoe-default @ 2.00 MiB: {line.strip().splitlines()[-1]}".split()) in " ".join(err.out.split())
    assert line.strip().splitlines()[-1].startswith("default plan:"), line
    # batch 2: the plan's batch-1 prediction is not set against a batch-2 step
    i = argv.index("zipmoe-basic")
    one = argv[:i - 1] + argv[i + 3:]  # the plan's engine only

    def first_run(out_name, **opts):
        """The plan's engine with these options (``--batch``, ``--plan``): its first run, and the console."""
        args = list(one)
        for opt, value in dict(opts, json=str(tmp_path / out_name)).items():
            args[args.index(f"--{opt}") + 1] = str(value)
        with pytest.raises(SystemExit) as exc:
            main(args)
        err = capsys.readouterr()
        assert exc.value.code == 0, err.err[-2000:]
        return json.loads((tmp_path / out_name).read_text())["results"][0]["runs"][0], err

    run, _ = first_run("out2.json", batch=2)
    assert run["batch"] == 2 and "predicted_tpot_s" not in run and "predicts batch 1" in run["prediction_note"]
    assert "model_tpot_s" not in run and "no costs served at batch 2" in run["prediction_note"]
    # a plan made for two rows, from the profile's costs served at two rows (`zipmoe plan --batch 2`):
    # its prediction and the cost model at two rows are set against the step of two rows (on an H100
    # at 8G, 6 Dec, a batch-4 plan's runs had neither)
    b2 = {"resident_step_s": 0.006, "graphs": False,
          "per_expert_s": {"full": 0.0, "compressed": 0.0005, "sm_only": 0.0006, "e_only": 0.0007, "none": 0.0009}}
    pf.write_text(json.dumps(dict(prof, batches={"2": {"step_costs": b2, "experts_per_layer": 3.0}})))
    plan2 = tmp_path / "plan2.json"
    with pytest.raises(SystemExit) as exc:
        main(["plan", str(zm), "--budget", "2M", "--trace", str(tr), "--profile", str(pf), "--workers", "1", "--batch", "2",
              "-o", str(plan2)])
    assert exc.value.code in (0, None), capsys.readouterr().err[-2000:]
    p2 = json.loads(plan2.read_text())
    assert p2["batch"] == 2
    run, err = first_run("out3.json", batch=2, plan=plan2)
    assert run["predicted_tpot_s"] == pytest.approx(p2["expected_tpot_s"]) and "prediction_note" not in run, run.get("prediction_note")
    assert run["model_tpot_s"] >= 0.006  # the resident step of two rows, and the states' costs at two rows
    assert "per step of N rows" in err.out
    pf.write_text(json.dumps(prof))
    # the same engine and budget at another batch in the same work dir keeps the first bench's runs file
    files = sorted(p.name for p in (tmp_path / "w").glob("runs-zipmoe-*.jsonl"))
    assert files == ["runs-zipmoe-2097152-b1-n6.jsonl", "runs-zipmoe-2097152-b2-n6.jsonl",
                     "runs-zipmoe-basic-2097152-b1-n6.jsonl", "runs-zipmoe-default-2097152-b1-n6.jsonl"], files
    first = [json.loads(x) for x in (tmp_path / "w" / files[0]).read_text().splitlines() if x.strip()]
    assert first and all(r["batch"] == 1 for r in first)
    # and its worker log (on 6 Dec a batch-4 run killed by its cgroup lost its log to a later case's)
    logs = sorted(p.name for p in (tmp_path / "w").glob("worker-zipmoe-2097152-*.log"))
    assert logs == ["worker-zipmoe-2097152-b1-n6.log", "worker-zipmoe-2097152-b2-n6.log"], logs
