"""Workloads that are not loops (runtime/plan/workload.py): the bundled corpus, the teacher-
forced token streams, ``ForcedTokens`` in zipmoe's decode loop against transformers, and the
bench worker's diagnostics on a corpus run and a greedy one."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from zipmoe.errors import UsageError
from zipmoe.runtime.plan import workload as wl

from test_runtime_fixtures import container, reference

CONTEXT = 128


def test_corpus_passages_are_long_natural_text():
    ps = wl.corpus_passages()
    assert len(ps) == 8
    assert all(len(p.split()) >= 450 for p in ps)
    srcs = wl.corpus_sources()
    assert len(srcs) == 8 and all("public domain (Project Gutenberg)" in s for s in srcs)
    assert ps[0].startswith("It is a truth universally acknowledged") and "Call me Ishmael" in ps[2]


def test_hashed_stream_is_deterministic_zipfian_and_long_enough():
    cfg = {"vocab_size": 32000, "eos_token_id": 1, "pad_token_id": 0, "bos_token_id": 2}
    p1, f1 = wl.teacher_forced(None, cfg, rows=10, prompt_tokens=32, new_tokens=512)
    p2, f2 = wl.teacher_forced(None, dict(cfg), rows=10, prompt_tokens=32, new_tokens=512)
    assert (p1, f1) == (p2, f2)
    assert [len(p) for p in p1] == [32] * 10 and [len(f) for f in f1] == [512] * 10
    assert all(5 <= t < 32000 for r in p1 + f1 for t in r)
    share = [len(set(r[:500])) / 500 for r in f1]
    assert all(0.3 <= s <= 0.65 for s in share), share
    # rows beyond the eighth: the same passage, further in
    ids = wl.passage_ids(None, cfg)
    assert p1[0] == ids[0][:32] and p1[8] == ids[0][wl.ROW_SHIFT: wl.ROW_SHIFT + 32]
    assert f1[1] == ids[1][32:544] if len(ids[1]) >= 544 else f1[1][: len(ids[1]) - 32] == ids[1][32:]
    # a text shorter than the row continues into the next one
    p, f = wl.teacher_forced(None, cfg, rows=1, prompt_tokens=4, new_tokens=10, texts=["one two three", "four five six seven eight nine ten eleven twelve"])
    words = "one two three four five six seven eight nine ten eleven twelve one two".split()
    assert p[0] + f[0] == [wl.hash_id(w, 32000, {0, 1, 2}) for w in words]
    # specials never appear; small vocabularies work
    p, f = wl.teacher_forced(None, {"vocab_size": 8, "eos_token_id": 6}, rows=1, prompt_tokens=4, new_tokens=60)
    assert set(p[0] + f[0]) <= {5, 7}
    assert wl.uses_hashed_ids(None)
    with pytest.raises(UsageError):
        wl.teacher_forced(None, {}, rows=1, prompt_tokens=4, new_tokens=4)
    with pytest.raises(UsageError, match="unknown workload"):
        wl.check_workload("loop")


class _RealTok:
    """A stand-in for a real tokenizer (>= 1000 tokens): ids from the words, a BOS it adds."""

    bos_token_id = 1

    def __len__(self):
        return 50000

    def __call__(self, text, add_special_tokens=True):
        ids = [100 + (sum(map(ord, w)) % 40000) for w in text.split()]
        return {"input_ids": ([1] if add_special_tokens else []) + ids}


def test_real_tokenizer_stream_keeps_its_bos():
    tok = _RealTok()
    assert not wl.uses_hashed_ids(tok) and wl.ids_origin(tok) == "the model's tokenizer"
    p, f = wl.teacher_forced(tok, {"vocab_size": 50000}, rows=2, prompt_tokens=32, new_tokens=512)
    text = tok(wl.corpus_passages()[0], add_special_tokens=False)["input_ids"]
    assert p[0][0] == 1 and p[0][1:] == text[:31] and f[0] == text[31:543]
    assert len(p[1]) == 32 and len(f[1]) == 512


def _ref_generate(ref, ids, steps, processor):
    from transformers import LogitsProcessorList, StaticCache

    from zipmoe.runtime.engine.hf_compat import NO_AUTO_COMPILE, cache_kw

    cache = StaticCache(config=ref.config, max_cache_len=CONTEXT)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ref.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **{cache_kw(ref): cache},
                            max_new_tokens=steps, min_new_tokens=steps, do_sample=False, output_logits=True,
                            return_dict_in_generate=True, pad_token_id=0,
                            logits_processor=LogitsProcessorList([processor]), **NO_AUTO_COMPILE)


def test_forced_steps_are_bit_identical_to_transformers(tmp_path_factory):
    """The same teacher-forced stream through zipmoe's decode loop and transformers' generate
    (eager experts, a static cache of the same length): the same tokens (the stream) and
    logits torch.equal at every forced step."""
    import zipmoe
    from zipmoe.runtime.bench.inputs import load_tokenizer
    from zipmoe.runtime.engine.loader import requirements
    from zipmoe.runtime.engine.loop import DecodeLoop
    from zipmoe.runtime.engine.sampling import ForcedTokens

    src, path = container(tmp_path_factory, "mixtral")
    cfg = json.loads((src / "config.json").read_text())
    prompts, forced = wl.teacher_forced(load_tokenizer(src), cfg, rows=2, prompt_tokens=12, new_tokens=6)
    # the same ids whichever engine asks (the bench tokenises once; so does any other caller)
    assert (prompts, forced) == wl.teacher_forced(load_tokenizer(src), dict(cfg), rows=2, prompt_tokens=12, new_tokens=6)
    ids = torch.tensor(prompts)
    want = _ref_generate(reference(src), ids, 6, ForcedTokens(forced))
    assert want.sequences[:, 12:].tolist() == forced
    model, _ = zipmoe.load(path, budget=requirements(path, workers=1)["budget_for"](0.5), workers=1)
    try:
        loop = DecodeLoop(model, context=CONTEXT, batch=2)
        proc = ForcedTokens(forced, keep_argmax=True)
        res = loop.generate(ids, None, max_new_tokens=6, min_new_tokens=6, do_sample=False, keep_logits=True,
                            generation_kwargs={"pad_token_id": 0}, forced=proc)
        assert res.tokens == forced
        assert len(res.logits) == len(want.logits) == 6
        for step, (a, b) in enumerate(zip(want.logits, res.logits)):
            assert torch.equal(a, b), f"logits differ at forced step {step}"
        # the argmax the token check compares: the greedy choice at each forced position (the
        # end-of-sequence id masked by min_new_tokens, as greedy decoding masks it)
        eos = cfg["eos_token_id"]
        masked = [lg.clone().index_fill_(1, torch.tensor([eos]), float("-inf")) for lg in res.logits]
        assert proc.argmax_tokens() == [[int(torch.argmax(lg[r])) for lg in masked] for r in range(2)]
    finally:
        model.zipmoe.close()


def test_corpus_run_does_not_cycle_greedy_does_and_the_report_warns(tmp_path_factory):
    """The worker's run on the tiny synthetic Mixtral, in this process: 64 teacher-forced
    tokens have many distinct ids and no cycle; greedy decoding of the same model loops and
    the report says so. Both records carry the cache diagnostics."""
    import zipmoe
    from zipmoe.runtime.bench import report
    from zipmoe.runtime.bench import worker
    from zipmoe.runtime.bench.inputs import corpus_ids, load_tokenizer, make_cases
    from zipmoe.runtime.engine.loader import requirements

    src, path = container(tmp_path_factory, "mixtral")
    cfg = json.loads((src / "config.json").read_text())
    ids, forced, pad, origin = corpus_ids(load_tokenizer(src), cfg, [1], [64])
    assert "hashed word ids" in origin  # the synthetic byte-level tokenizer has 261 tokens
    corpus = make_cases(ids, pad, [1], [64], workload="corpus", forced=forced)[0]
    greedy = make_cases(ids, pad, [1], [64], workload="greedy")[0]
    assert "forced" not in greedy and corpus["forced"] == [forced[0][:64]]
    worker._LOOP.clear()
    model, _ = zipmoe.load(path, budget=requirements(path, workers=1)["budget_for"](0.3), workers=1)
    sampler = worker.RssSampler()
    spec = {"engine": "zipmoe", "device": "cpu", "context": 128, "min_tokens": 2}
    try:
        runs = {}
        for case in (corpus, greedy):
            rec = worker.run_case(model, model.zipmoe, torch, case, spec, sampler, "warm")
            rec.update(engine="zipmoe", budget=1, case=case["id"])
            runs[case["workload"]] = rec
        sample = make_cases(ids, pad, [1], [16], workload="sample", temperature=1.0, seed=3)[0]
        s1, s2 = (worker.run_case(model, model.zipmoe, torch, sample, spec, sampler, "warm") for _ in range(2))
    finally:
        sampler.stop()
        model.zipmoe.close()
        worker._LOOP.clear()
    assert s1["workload"] == "sample" and s1["seed"] == 3 and s1["temperature"] == 1.0
    assert s1["tokens"] == s2["tokens"] and s1["distinct_tokens"] > 8  # the seed is set before every run
    c, g = runs["corpus"], runs["greedy"]
    assert c["diagnostics_source"] == "the runtime's counters"
    assert c["workload"] == "corpus" and c["tokens"] == corpus["forced"] and len(c["argmax_tokens"][0]) == 64
    assert c["cycle"] is None and c["distinct_tokens"] >= 30
    assert g["workload"] == "greedy" and g["cycle"] is not None and g["distinct_tokens"] < 10
    for r in (c, g):
        assert r["distinct_experts"] > 0 and r["cache_capacity_experts"] > 0
        assert 0 <= r["hit_rate_first_quarter"] <= 1 and 0 <= r["hit_rate_last_quarter"] <= 1
        assert r["lru_hit_rate"] <= r["belady_hit_rate"] <= 1
    assert c["distinct_experts"] >= g["distinct_experts"]
    warn = report.cycle_warnings([c, g])
    assert len(warn) == 1 and "greedy" in warn[0] and "cycle" in warn[0]
    rows = report.summarize([c, g], None)
    assert {r["cycle"] for r in rows} == {None, g["cycle"]}


def test_trace_fallback_gives_the_same_diagnostics(tmp_path_factory, monkeypatch):
    """Without the counters' log of layer calls the worker records an activation trace per run:
    the same routing (teacher forcing makes it deterministic), so the same figures."""
    import zipmoe
    from zipmoe.runtime.bench import worker
    from zipmoe.runtime.bench.inputs import corpus_ids, load_tokenizer, make_cases
    from zipmoe.runtime.engine.counters import Counters
    from zipmoe.runtime.engine.loader import requirements

    src, path = container(tmp_path_factory, "mixtral")
    cfg = json.loads((src / "config.json").read_text())
    ids, forced, pad, _ = corpus_ids(load_tokenizer(src), cfg, [2], [16])
    case = make_cases(ids, pad, [2], [16], workload="corpus", forced=forced)[0]
    spec = {"engine": "zipmoe", "device": "cpu", "context": 64, "min_tokens": 2}
    got = {}
    for mode in ("counters", "trace"):
        if mode == "trace":
            if not hasattr(Counters, "log_uses"):
                pytest.skip("this runtime has no counters log: the trace is the only source")
            monkeypatch.delattr(Counters, "log_uses")
        worker._LOOP.clear()  # the worker keeps its one model's loop: a new model needs a new one
        model, _ = zipmoe.load(path, budget=requirements(path, workers=1)["budget_for"](0.4), workers=1)
        sampler = worker.RssSampler()
        try:
            got[mode] = worker.run_case(model, model.zipmoe, torch, case, spec, sampler, "warm")
        finally:
            sampler.stop()
            model.zipmoe.close()
            worker._LOOP.clear()
    a, b = got["counters"], got["trace"]
    assert b["diagnostics_source"] == "an activation trace", b.get("diagnostics_note")
    for k in ("distinct_experts", "decode_expert_uses", "belady_hit_rate", "lru_hit_rate", "cache_capacity_experts"):
        assert a[k] == b[k], k


def test_calibration_teacher_forces_the_corpus_by_default(tmp_path_factory, monkeypatch):
    """`zipmoe plan --calibrate builtin` (record_trace): every corpus passage teacher-forced,
    one trace step per forward; the greedy workload is still there; plan.check serves the same rows."""
    import os

    from zipmoe.runtime.engine.loader import requirements
    from zipmoe.runtime.engine.trace import read_trace
    from zipmoe.runtime.plan.calibrate import BUILTIN_PROMPTS, calibration_inputs, read_prompts, record_trace
    from zipmoe_cli.default_plan import keep_usage

    src, path = container(tmp_path_factory, "mixtral")
    assert read_prompts("builtin") == read_prompts("corpus") == wl.corpus_passages()
    assert read_prompts("builtin", "greedy") == BUILTIN_PROMPTS
    with pytest.raises(UsageError, match="unknown workload"):
        read_prompts("builtin", "loop")
    budget = requirements(path, workers=1)["budget_for"](0.5)
    cfg = json.loads((src / "config.json").read_text())
    from zipmoe.runtime.bench.inputs import load_tokenizer

    rows = calibration_inputs(load_tokenizer(src), cfg, read_prompts("builtin"), "corpus", 4)
    assert len(rows) == 8 and all(len(p) == 32 and len(f) == 4 for p, f in rows)
    for workload, n_prompts in (("corpus", 8), ("greedy", 2)):
        kept = tmp_path_factory.mktemp(f"kept-{workload}")
        monkeypatch.setenv("ZIPMOE_CACHE_DIR", str(kept))  # where `zipmoe plan --calibrate`'s keep_usage writes
        trace = record_trace(path, read_prompts("builtin", workload)[:n_prompts], budget, "cpu", 1, max_new_tokens=4,
                             workload=workload, on_done=keep_usage)
        try:
            _, steps = read_trace(trace, with_input=True)
            if workload == "corpus":
                assert len(steps) == 8 * 4  # each passage: its prefill + 3 decode steps (the 4th token is not fed)
                assert [s[1] for s in steps[:4]] == [[1, 32], [1, 1], [1, 1], [1, 1]]
                # the calibration's routing is kept for the default plan, one call per step and layer
                from zipmoe.codecs.reader import ContainerReader
                from zipmoe.runtime.plan.default import read_usage, stats_path

                with ContainerReader(path) as r:
                    cid = r.container_id
                counts, calls, warn = read_usage(stats_path(kept, cid), cid)
                assert warn is None and calls == 8 * 4 and counts
                traced = {}
                for layers, _shape in steps:
                    for layer, rows in layers.items():
                        for e in {e for row in rows for e in row}:
                            traced[(str(layer), str(e))] = traced.get((str(layer), str(e)), 0) + 1
                assert {(l, e): n for l, per in counts.items() for e, n in per.items()} == traced
            else:
                assert steps and steps[0][1][1] > 1
        finally:
            os.unlink(trace)
            os.unlink(str(trace) + ".prefetch.json")


def test_workload_errors_are_one_line(capsys):
    from zipmoe.runtime.plan import check

    with pytest.raises(SystemExit) as exc:
        check.main(["x.zmoe", "--plan", "p.json", "--workload", "loop"])
    assert exc.value.code == 2 and "invalid choice" in capsys.readouterr().err
    from zipmoe_cli.app import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", "x.zmoe", "--budget", "1M", "--workload", "loop"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and err == ["zipmoe: error: unknown workload 'loop': choose from corpus, sample, greedy"]
    with pytest.raises(SystemExit) as exc:
        main(["bench", "x.zmoe", "--budget", "1M", "--workload", "sample", "--temperature", "0"])
    assert exc.value.code == 2 and "--temperature must be above 0" in capsys.readouterr().err
