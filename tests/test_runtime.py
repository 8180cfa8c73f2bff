"""The product's promise: a model served from a .zmoe is bit-identical to the original.

For every family synth makes (tiny), at budgets from "every expert resident" down to the
smallest the model accepts: prefill logits at batch 1 and batch 4 (left padding, attention
mask) are ``torch.equal`` to transformers' eager reference on the same device, and greedy
generation gives the same tokens with the same per-step logits (the decode steps). The same
tests run on CUDA with ``-m gpu``.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import zipmoe
from zipmoe.runtime.engine.loader import requirements

from test_runtime_fixtures import FAMILIES, container, inputs, is_seq2seq, reference

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]
BUDGETS = ["resident", "half", "min"]


def _vocab(src) -> int:
    return json.loads((src / "config.json").read_text())["vocab_size"]


def _budget(req: dict, which: str) -> int:
    if which == "resident":
        return req["budget_for"](1.0)
    if which == "half":
        return req["budget_for"](0.5)
    return req["min_budget"]


def _same_generation(ref, model, batch: dict, steps: int = 5) -> None:
    kw = dict(max_new_tokens=steps, do_sample=False, output_logits=True, return_dict_in_generate=True,
              pad_token_id=0)
    gen_in = {k: v for k, v in batch.items() if k != "decoder_input_ids"}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = ref.generate(**gen_in, **kw)
        b = model.generate(**gen_in, **kw)
    assert torch.equal(a.sequences, b.sequences)
    assert len(a.logits) == len(b.logits)
    for step, (la, lb) in enumerate(zip(a.logits, b.logits)):
        assert torch.equal(la, lb), f"logits differ at generation step {step}"


@pytest.fixture(scope="module")
def refs():
    return {}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", FAMILIES)
def test_bit_identical_at_every_budget(tmp_path_factory, refs, family, device):
    src, path = container(tmp_path_factory, family)
    if (family, device) not in refs:
        refs[(family, device)] = reference(src, device)
    ref = refs[(family, device)]
    seq2seq = is_seq2seq(family)
    vocab = _vocab(src)
    req = requirements(path, workers=1, device=device)
    b4 = inputs(vocab, seq2seq, device, batch=4)
    b1 = inputs(vocab, seq2seq, device, batch=1, seed=1)
    with torch.no_grad():
        want4 = ref(**b4).logits
        want1 = ref(**b1).logits
    for which in BUDGETS:
        budget = _budget(req, which)
        model, _ = zipmoe.load(path, budget=budget, device=device, workers=1)
        rt = model.zipmoe
        try:
            with torch.no_grad():
                got1 = model(**b1).logits
                got4 = model(**b4).logits
            assert torch.equal(got1, want1), f"{family} batch 1 logits differ at budget {which}"
            assert torch.equal(got4, want4), f"{family} batch 4 logits differ at budget {which}"
            _same_generation(ref, model, b4)
            c = rt.counters
            assert c.peak_held_bytes <= budget
            if device == "cuda":  # the Triton merge on the device when triton is installed
                from zipmoe.kernels import triton_available

                assert rt.fetcher.device.device_merge == triton_available()
            if which == "min":
                assert c.bytes_read > 0 and c.hits["none"] > 0
            if which == "resident":
                # every expert tensor was read once at most, then stayed whole
                assert c.bytes_read <= rt.expert_bytes_stored
        finally:
            rt.close()


def test_fused_source_layout(tmp_path_factory):
    """A checkpoint that stores experts fused ([E, 2I, H]) serves the same as the split one."""
    src, path = container(tmp_path_factory, "qwen3_moe", layout="fused")
    ref = reference(src)
    req = requirements(path, workers=1)
    batch = inputs(_vocab(src), False, batch=4)
    with torch.no_grad():
        want = ref(**batch).logits
    model, _ = zipmoe.load(path, budget=req["min_budget"] + 4096, device="cpu", workers=1)
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, want)
    model.zipmoe.close()


def test_two_workers_and_pools_of_every_kind(tmp_path_factory):
    """A plan that uses all four pools: warm runs hit them, and logits stay identical."""
    src, path = container(tmp_path_factory, "mixtral")
    ref = reference(src)
    req = requirements(path, workers=2)
    full = req["expert_bytes_full"]
    model0, _ = zipmoe.load(path, budget=req["budget_for"](1.0), workers=2)
    cid = model0.zipmoe.container_id
    model0.zipmoe.close()
    plan = {"container_id": cid, "pools": {"full": full // 8, "compressed": full // 8, "sm_only": full // 8,
                                           "e_only": full // 8}}
    budget = req["budget_for"](0.5)
    model, _ = zipmoe.load(path, budget=budget, workers=2, plan=plan)
    rt = model.zipmoe
    assert rt.pools == plan["pools"]
    for seed in range(4):
        batch = inputs(_vocab(src), False, batch=2, seed=seed)
        with torch.no_grad():
            assert torch.equal(model(**batch).logits, ref(**batch).logits)
    hits = rt.counters.hits
    assert all(hits[p] > 0 for p in ("full", "compressed", "sm_only", "e_only")), hits
    assert rt.counters.peak_held_bytes <= budget
    # every tensor is in one pool at most, and no pool is over its capacity
    pools = rt.cache.pools
    uids = [u for p in pools.values() for u in p.items]
    assert len(uids) == len(set(uids))
    assert all(p.used <= p.capacity for p in pools.values())
    rt.close()


def test_warm_fills_full_pool_and_reads_nothing_after(tmp_path_factory):
    src, path = container(tmp_path_factory, "olmoe")
    req = requirements(path, workers=1)
    model, _ = zipmoe.load(path, budget=req["budget_for"](1.0), workers=1, warm=True)
    rt = model.zipmoe
    before = rt.counters.bytes_read
    with torch.no_grad():
        model(**inputs(_vocab(src), False, batch=2))
    assert rt.counters.bytes_read == before
    assert rt.counters.hits["none"] == 0 and rt.counters.hits["full"] > 0
    rt.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["mixtral", "switch_transformers"])
def test_float32_compute_matches_float32_reference(tmp_path_factory, family, device):
    """dtype="float32" (what the demo's config asks for): experts merged in bf16, converted exactly."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    src, path = container(tmp_path_factory, family)
    seq2seq = is_seq2seq(family)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if seq2seq:
            ref = AutoModelForSeq2SeqLM.from_pretrained(src, dtype=torch.float32).to(device).eval()
        else:
            ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, experts_implementation="eager")
            ref = ref.to(device).eval()
    req = requirements(path, workers=1, dtype="float32", device=device)
    batch = inputs(_vocab(src), seq2seq, device, batch=4)
    with torch.no_grad():
        want = ref(**batch).logits
    for budget in (req["budget_for"](1.0), req["min_budget"]):
        model, _ = zipmoe.load(path, budget=budget, workers=1, dtype="float32", device=device)
        rt = model.zipmoe
        with torch.no_grad():
            assert torch.equal(model(**batch).logits, want)
        _same_generation(ref, model, batch, steps=3)
        assert rt.counters.peak_held_bytes <= budget
        rt.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grad_mode_forward_matches_too(tmp_path_factory, dtype):
    """model(ids) without torch.no_grad(): the weights' autograd flag matches the reference's."""
    from transformers import AutoModelForCausalLM

    src, path = container(tmp_path_factory, "qwen2_moe")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, experts_implementation="eager").eval()
    batch = inputs(_vocab(src), False, batch=4)
    want = ref(**batch).logits.detach()
    model, _ = zipmoe.load(path, budget="64M", workers=1, dtype=str(dtype).replace("torch.", ""))
    assert torch.equal(model(**batch).logits.detach(), want)
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, want)
    model.zipmoe.close()


def test_deepseek_v3_from_transformers_config(tmp_path_factory):
    """DeepSeek-V3 (served, not made by synth): a random tiny checkpoint from its config class."""
    src, path = container(tmp_path_factory, "deepseek_v3")
    ref = reference(src)
    batch = inputs(_vocab(src), False, batch=4)
    req = requirements(path, workers=1)
    with torch.no_grad():
        want = ref(**batch).logits
    model, _ = zipmoe.load(path, budget=req["min_budget"], workers=1)
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, want)
    _same_generation(ref, model, batch, steps=3)
    model.zipmoe.close()
