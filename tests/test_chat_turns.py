"""`zipmoe chat` conversations: the KV cache kept across turns, /reset, --context.

The reference for a turn is transformers (eager experts) carrying its own ``StaticCache`` of
the same length over the same way: crop it to the longest common prefix of what it holds and
the newly rendered conversation, and generate from the whole prompt (``generate`` feeds only
the rest).
"""

from __future__ import annotations

import io
import json
import warnings

import pytest
import torch

from zipmoe.runtime.engine.hf_compat import NO_AUTO_COMPILE, cache_kw, crop
from zipmoe_cli.app import main

from test_runtime_fixtures import container, reference

COMMON = ["--greedy", "--budget", "64M", "--workers", "1", "--threads", "1"]


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


def _lcp(a, b) -> int:
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    return i


def _reference_conversation(src, prompts, *, system, context, max_new):
    from transformers import AutoTokenizer, StaticCache

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(src)
    ref = reference(src)
    cache = StaticCache(config=ref.config, max_cache_len=context)
    held: list[int] = []
    history = [{"role": "system", "content": system}] if system else []
    turns = []
    for p in prompts:
        history.append({"role": "user", "content": p})
        enc = tok.apply_chat_template(history, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        ids = enc["input_ids"][0].tolist()
        keep = min(_lcp(held, ids), len(ids) - 1)
        length = int(cache.get_seq_length())
        if length > keep:
            crop(cache, length - keep)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = ref.generate(**enc, **{cache_kw(ref): cache}, max_new_tokens=max_new, do_sample=False, **NO_AUTO_COMPILE)
        new = out[0, len(ids):].tolist()
        held = (ids + new)[: int(cache.get_seq_length())]
        text = tok.decode(new, skip_special_tokens=True)
        history.append({"role": "assistant", "content": text})
        turns.append({"token_ids": new, "prompt_tokens": len(ids), "prefill_tokens": len(ids) - keep})
    return turns


@pytest.mark.parametrize("n_turns", [2, 3])
def test_turns_equal_the_reference_carrying_its_cache(mixtral, capsys, n_turns):
    src, path = mixtral
    prompts = ["Hello there", "And what else?", "More."][:n_turns]
    argv = ["chat", str(path), "--max-new-tokens", "4", "--json", "--context", "120"] + COMMON
    for p in prompts:
        argv += ["--prompt", p]
    code, out, err = _run(argv, capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert set(doc) == {"turns"} and len(doc["turns"]) == n_turns
    want = _reference_conversation(src, prompts, system=None, context=120, max_new=4)
    for i, (got, w) in enumerate(zip(doc["turns"], want)):
        assert got["token_ids"] == w["token_ids"], f"turn {i + 1}"
        s = got["stats"]
        assert s["prompt_tokens"] == w["prompt_tokens"]
        assert s["prefill_tokens"] == w["prefill_tokens"], f"turn {i + 1}"
        for k in ("ttft_s", "tpot_s", "tokens_per_s", "bytes_read", "hits", "new_tokens"):
            assert k in s
        if i:  # a later turn computes only its new suffix
            assert s["prefill_tokens"] < s["prompt_tokens"]
        else:
            assert s["prefill_tokens"] == s["prompt_tokens"]


def test_one_prompt_keeps_the_single_turn_document(mixtral, capsys):
    src, path = mixtral
    limit = json.loads((src / "config.json").read_text())["max_position_embeddings"]
    code, out, err = _run(["chat", str(path), "--prompt", "Hi", "--max-new-tokens", "3", "--json"] + COMMON, capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert set(doc) == {"token_ids", "text", "stats", "interrupted"}
    assert doc["stats"]["prefill_tokens"] == doc["stats"]["prompt_tokens"]
    assert doc["stats"]["context"] == min(4096, limit)  # the default, never more than the model's positions


def test_load_line_shows_the_kv_cache_and_the_clamp(mixtral, capsys):
    src, path = mixtral
    limit = json.loads((src / "config.json").read_text())["max_position_embeddings"]
    code, out, err = _run(["chat", str(path), "--prompt", "Hi", "--max-new-tokens", "2", "--context", "99999"] + COMMON,
                          capsys)
    assert code == 0, err
    line = next(x for x in err.splitlines() if x.startswith("KV cache:"))
    assert f"{limit} tokens" in line and "asked for 99999" in line and "on top of the budget" in line


def test_reset_and_the_cache_across_interactive_turns(mixtral, capsys, monkeypatch):
    _, path = mixtral
    stdin = "hello\nand again\n/reset\nhello\n/exit\n"
    code, out, err = _run(["chat", str(path), "--max-new-tokens", "3", "--context", "96"] + COMMON,
                          capsys, stdin, monkeypatch)
    assert code == 0, err
    stats = [x for x in err.splitlines() if "tok/s" in x]
    assert len(stats) == 3
    assert "from the cache" not in stats[0] and "from the cache" in stats[1]
    assert "conversation cleared" in err and "from the cache" not in stats[2]  # /reset dropped the cache


def test_a_conversation_longer_than_the_cache(mixtral, capsys, monkeypatch):
    _, path = mixtral
    # one-shot: one line, non-zero exit
    code, out, err = _run(["chat", str(path), "--prompt", "word " * 40, "--context", "16"] + COMMON, capsys)
    last = err.strip().splitlines()[-1]
    assert code == 2 and last.startswith("zipmoe: error: ") and "KV cache holds 16" in last
    assert "Traceback" not in err
    # interactive: the answer stops when the cache is full, the next turn too long is one line, /reset recovers
    stdin = "hi\n" + "more words " * 20 + "\n/reset\nhi\n/exit\n"
    code, out, err = _run(["chat", str(path), "--max-new-tokens", "40", "--context", "40"] + COMMON,
                          capsys, stdin, monkeypatch)
    assert code == 0, err
    assert "KV cache holds 40" in err and "Traceback" not in err
    assert "the KV cache is full at 40 tokens" in err  # the first answer ran into the end of the cache
    assert err.count("tok/s") == 2  # the first and the last turn answered


def test_bad_context_is_one_line(mixtral, capsys):
    _, path = mixtral
    code, out, err = _run(["chat", str(path), "--prompt", "x", "--context", "1"] + COMMON, capsys)
    assert code == 2 and err.strip().splitlines()[-1].startswith("zipmoe: error: --context")
