"""Tiny checkpoints for the container/pack tests (no tests here; imported by them)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file


def _bf16(g: torch.Generator, *shape, scale: float = 0.05) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)


def write_mixtral(out: Path, layers: int = 2, experts: int = 4, hidden: int = 16, inter: int = 24,
                  vocab: int = 64, seed: int = 0, sharded: bool = True) -> dict:
    """A Mixtral-style folder: per-expert w1/w2/w3, experts scattered over two shards, an F32
    norm, an I64 buffer, tokenizer/generation files. Returns {name: tensor}."""
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": _bf16(g, vocab, hidden)}
    for L in range(layers):
        p = f"model.layers.{L}"
        for n in ("q", "k", "v", "o"):
            t[f"{p}.self_attn.{n}_proj.weight"] = _bf16(g, hidden, hidden)
        t[f"{p}.input_layernorm.weight"] = torch.ones(hidden, dtype=torch.float32) + torch.rand(hidden, generator=g)
        t[f"{p}.post_attention_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        t[f"{p}.block_sparse_moe.gate.weight"] = _bf16(g, experts, hidden)
        for e in range(experts):
            q = f"{p}.block_sparse_moe.experts.{e}"
            t[f"{q}.w1.weight"] = _bf16(g, inter, hidden)
            t[f"{q}.w2.weight"] = _bf16(g, hidden, inter)
            t[f"{q}.w3.weight"] = _bf16(g, inter, hidden)
    t["model.norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    t["model.step_counter"] = torch.arange(5, dtype=torch.int64)
    t["lm_head.weight"] = _bf16(g, vocab, hidden)
    # special bit patterns in one dense tensor: NaN payloads, +-inf, -0, subnormals
    special = torch.from_numpy(np.array([0x7FC1, 0xFFFF, 0x7F80, 0xFF80, 0x8000, 0x0000, 0x0001, 0x807F], dtype=np.uint16).view(np.int16))
    t["model.special"] = special.view(torch.bfloat16)
    cfg = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_hidden_layers": layers,
           "num_local_experts": experts, "num_experts_per_tok": 2, "hidden_size": hidden,
           "intermediate_size": inter, "vocab_size": vocab}
    (out / "config.json").write_text(json.dumps(cfg))
    (out / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    (out / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    names = list(t)
    if sharded:
        # odd-numbered experts in shard 2, everything else in shard 1: experts scattered
        s2 = [n for n in names if ".experts." in n and int(n.split(".experts.")[1].split(".")[0]) % 2]
        s1 = [n for n in names if n not in s2]
        files = {"model-00001-of-00002.safetensors": s1, "model-00002-of-00002.safetensors": s2}
        wm = {}
        for fname, ns in files.items():
            save_file({n: t[n] for n in ns}, str(out / fname), metadata={"format": "pt"})
            wm.update({n: fname for n in ns})
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    else:
        save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    return t


def write_fused(out: Path, layers: int = 2, experts: int = 4, hidden: int = 16, inter: int = 8, seed: int = 1) -> dict:
    """A transformers-5 fused layout: mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]."""
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    t = {"model.embed_tokens.weight": _bf16(g, 32, hidden)}
    for L in range(layers):
        p = f"model.layers.{L}"
        t[f"{p}.mlp.gate.weight"] = _bf16(g, experts, hidden)
        t[f"{p}.mlp.experts.gate_up_proj"] = _bf16(g, experts, 2 * inter, hidden)
        t[f"{p}.mlp.experts.down_proj"] = _bf16(g, experts, hidden, inter)
        t[f"{p}.mlp.shared_expert.up_proj.weight"] = _bf16(g, inter, hidden)
        t[f"{p}.input_layernorm.weight"] = torch.ones(hidden, dtype=torch.float32)
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_hidden_layers": layers,
           "num_experts": experts, "num_experts_per_tok": 2, "hidden_size": hidden}
    (out / "config.json").write_text(json.dumps(cfg))
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    return t


def write_dense(out: Path, seed: int = 2) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    t = {"model.layers.0.mlp.up_proj.weight": _bf16(g, 32, 16), "model.norm.weight": torch.ones(16)}
    (out / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 1}))
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    return t
