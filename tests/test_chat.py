"""`zipmoe chat`: one-shot JSON, the interactive loop, traces, and every bad input as one line."""

from __future__ import annotations

import io
import json
import shutil

import pytest
import torch

from zipmoe_cli.app import main

from test_runtime_fixtures import container, reference


def _run(argv, capsys, stdin: str | None = None, monkeypatch=None):
    if stdin is not None:
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    code = 0
    try:
        main(argv)
    except SystemExit as exc:
        code = exc.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    src, path = container(tmp_path_factory, "mixtral")
    if not (src / "tokenizer.json").exists() and not (src / "tokenizer_config.json").exists():
        pytest.skip("needs synth checkpoints with a tokenizer")
    return src, path


def test_prompt_json_is_the_reference_greedy_answer(mixtral, capsys, tmp_path):
    src, path = mixtral
    trace = tmp_path / "trace.jsonl"
    code, out, err = _run([
        "chat", str(path), "--prompt", "Hello there", "--greedy", "--max-new-tokens", "6", "--json",
        "--budget", "64M", "--workers", "1", "--threads", "1", "--trace-out", str(trace), "--system", "Be brief.",
    ], capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert set(doc) >= {"token_ids", "text", "stats"}
    s = doc["stats"]
    for k in ("ttft_s", "tpot_s", "tokens_per_s", "bytes_read", "hits"):
        assert k in s
    assert set(s["hits"]) == {"full", "compressed", "sm_only", "e_only", "none"}
    torch.set_num_threads(1)  # chat set it to --threads; the reference runs the same way
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src)
    ref = reference(src)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    enc = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        want = ref.generate(**enc, max_new_tokens=6, do_sample=False)[0, enc["input_ids"].shape[1]:].tolist()
    assert doc["token_ids"] == want[: len(doc["token_ids"])] and len(doc["token_ids"]) >= 1
    from zipmoe.runtime.engine.trace import read_trace

    header, steps = read_trace(trace)
    assert header["num_experts"] == 8 and header["top_k"] == 2
    assert len(steps) == len(doc["token_ids"])  # prefill + one step per further token (last one not run)
    first = steps[0][str(header["layers"][0])]
    assert len(first) == enc["input_ids"].shape[1] and all(len(ids) == 2 for ids in first)


def test_interactive_turns_reset_stats_exit(mixtral, capsys, monkeypatch):
    _, path = mixtral
    stdin = "hello\n/stats\nand again\n/reset\n/bogus\nbye\n/exit\n"
    code, out, err = _run(["chat", str(path), "--greedy", "--max-new-tokens", "3", "--budget", "64M",
                           "--workers", "1", "--threads", "1"], capsys, stdin, monkeypatch)
    assert code == 0, err
    assert err.count("tok/s") == 3  # one quiet stats line per answer
    assert "since load" in err and "conversation cleared" in err and "commands:" in err


def test_interactive_survives_a_corrupted_chunk(mixtral, capsys, monkeypatch, tmp_path):
    _, path = mixtral
    bad = tmp_path / "bad.zmoe"
    shutil.copy(path, bad)
    from zipmoe.codecs.reader import ContainerReader

    with ContainerReader(bad) as r:
        sms = [c for e in r.entries if e.role == "expert" for c in e.chunks if c.kind == "sm"]
    with open(bad, "r+b") as f:  # flip one byte in every expert's SM chunk
        for c in sms:
            f.seek(c.offset)
            b = f.read(1)
            f.seek(c.offset)
            f.write(bytes([b[0] ^ 0x55]))
    code, out, err = _run(["chat", str(bad), "--greedy", "--max-new-tokens", "2", "--budget", "64M",
                           "--workers", "1", "--threads", "1"], capsys, "hi\n/stats\n/exit\n", monkeypatch)
    assert code == 0
    assert "checksum mismatch" in err and "experts." in err  # names the tensor
    assert "since load" in err  # the loop went on
    code, out, err = _run(["chat", str(bad), "--prompt", "hi", "--greedy", "--max-new-tokens", "2",
                           "--budget", "64M", "--workers", "1", "--threads", "1"], capsys)
    last = err.strip().splitlines()[-1]
    assert code == 1 and last.startswith("zipmoe: error: tensor ") and "checksum mismatch" in last


@pytest.mark.parametrize("args, code, words", [
    (["--budget", "1K"], 1, "at least"),
    (["--budget", "lots"], 2, ""),
    (["--plan", "/nonexistent/plan.json"], 2, "does not exist"),
    (["--json"], 2, "--prompt"),
    (["--max-new-tokens", "0"], 2, "at least 1"),
    (["--attention", "fastest"], 2, "attention must be one of reproducible, pytorch"),  # before loading
])
def test_bad_input_is_one_line(mixtral, capsys, args, code, words):
    _, path = mixtral
    got, out, err = _run(["chat", str(path), "--prompt", "x"] * ("--json" not in args) + ["chat", str(path)] *
                         ("--json" in args) + args, capsys)
    assert got == code, err
    last = err.strip().splitlines()[-1]  # (after the "loading ..." note)
    assert last.startswith("zipmoe: error: ") and words in last


def test_plan_for_another_model(mixtral, capsys, tmp_path):
    _, path = mixtral
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"container_id": "0" * 32, "pools": {"full": 1 << 20}}))
    code, out, err = _run(["chat", str(path), "--prompt", "x", "--plan", str(plan), "--budget", "64M"], capsys)
    assert code == 1 and "another model" in err.strip().splitlines()[-1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_cuda_without_gpu(mixtral, capsys):
    _, path = mixtral
    code, out, err = _run(["chat", str(path), "--prompt", "x", "--device", "cuda"], capsys)
    assert code == 1 and "no CUDA device" in err
