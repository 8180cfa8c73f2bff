"""Shared by the runtime, chat and scheduler tests: tiny checkpoints packed into containers.

Checkpoints come from ``zipmoe.runtime.synth`` (preset ``tiny``); where synth is not
available, from tiny configs of transformers' own config classes, randomly initialised (no
tokenizer then). Each (family, layout) is built once per test session.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

# One torch thread: on a shared 2-core machine, more threads spin against each other (10x slower
# tiny forwards); results are the same (the reference runs with the same setting).
torch.set_num_threads(1)

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "switch_transformers"]

_TINY = {
    "mixtral": dict(model_type="mixtral", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                    vocab_size=256, max_position_embeddings=128),
    "qwen2_moe": dict(model_type="qwen2_moe", hidden_size=64, intermediate_size=128, moe_intermediate_size=48,
                      shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, vocab_size=256,
                      max_position_embeddings=128),
    "qwen3_moe": dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=128, moe_intermediate_size=48,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      num_experts=8, num_experts_per_tok=2, vocab_size=256, max_position_embeddings=128),
    "olmoe": dict(model_type="olmoe", hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, num_experts=8, num_experts_per_tok=2,
                  vocab_size=256, max_position_embeddings=128),
    "deepseek_v2": dict(model_type="deepseek_v2", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                        n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=32,
                        q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                        vocab_size=256, max_position_embeddings=128, topk_method="greedy"),
    "deepseek_v3": dict(model_type="deepseek_v3", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                        n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=32,
                        q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, vocab_size=256,
                        max_position_embeddings=128, n_group=1, topk_group=1),
    "switch_transformers": dict(model_type="switch_transformers", d_model=64, d_ff=128, d_kv=16, num_heads=4,
                                num_layers=2, num_decoder_layers=2, num_sparse_encoder_layers=2,
                                num_sparse_decoder_layers=2, num_experts=8, vocab_size=256,
                                expert_capacity=1024),
}


def is_seq2seq(family: str) -> bool:
    return family == "switch_transformers"


def _write_own(family: str, out: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(**_TINY[family])
    auto = AutoModelForSeq2SeqLM if is_seq2seq(family) else AutoModelForCausalLM
    m = auto.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.05)
    m.save_pretrained(out)


def write_checkpoint(family: str, out: Path, layout: str = "split") -> Path:
    if family not in FAMILIES:  # served but not made by synth (deepseek_v3): transformers' config
        _write_own(family, out)
        return out
    try:
        from zipmoe.runtime import synth

        synth.write(family, out, preset="tiny", seed=0, layout=layout, force=True, progress=False)
    except (ImportError, AttributeError):
        if layout != "split":
            pytest.skip("fused layouts need zipmoe.runtime.synth")
        _write_own(family, out)
    return out


_BUILT: dict = {}


def container(tmp_path_factory, family: str, layout: str = "split") -> tuple[Path, Path]:
    """(checkpoint folder, .zmoe path) for ``family``, built once per session."""
    key = (family, layout)
    if key not in _BUILT:
        from zipmoe.codecs.writer import pack

        base = tmp_path_factory.mktemp(f"{family}-{layout}")
        src = write_checkpoint(family, base / "src", layout)
        out = base / f"{family}.zmoe"
        pack(src, out, force=True)
        _BUILT[key] = (src, out)
    return _BUILT[key]


def reference(src: Path, device="cpu"):
    """The source checkpoint loaded by transformers, eager experts: the bit-identity reference."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    family = json.loads((src / "config.json").read_text())["model_type"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if is_seq2seq(family):
            m = AutoModelForSeq2SeqLM.from_pretrained(src, dtype=torch.bfloat16)
        else:
            m = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16, experts_implementation="eager")
    return m.to(device).eval()


def inputs(vocab: int, seq2seq: bool, device="cpu", batch: int = 4, seq: int = 10, seed: int = 0) -> dict:
    """Random ids, with left padding on two rows when batch > 1 (a real attention mask)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, seq), generator=g)
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[1, :4] = 0
        mask[-1, :2] = 0
        ids[mask == 0] = 0
    out = {"input_ids": ids.to(device), "attention_mask": mask.to(device)}
    if seq2seq:
        out["decoder_input_ids"] = torch.randint(3, vocab, (batch, 4), generator=g).to(device)
    return out
