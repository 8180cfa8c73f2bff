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


def read_index(data: bytes) -> dict:
    """The index of a container (bytes) as a 1.0-style JSON document, one object per tensor with
    its chunks inline (a 1.1 file's tensor columns and chunk table expanded), to edit in tests."""
    import struct

    from zipmoe.codecs import format as fmt

    minor = struct.unpack_from("<H", data, 10)[0]
    ioff, ilen = struct.unpack_from("<QQ", data, 24)
    doc = json.loads(data[ioff:ioff + ilen])
    if minor >= 1:
        t = doc.pop("chunk_table")
        rec = np.frombuffer(data[t["offset"]:t["offset"] + t["count"] * fmt.CHUNK_RECORD.itemsize], fmt.CHUNK_RECORD)
        cols = doc["tensors"]
        doc["tensors"] = [dict(zip(cols, row)) for row in zip(*cols.values())]
        a = 0
        for e in doc["tensors"]:
            n = e.pop("chunk_count")
            e["extent"] = [e.pop("extent_offset"), e.pop("extent_length")]
            a += n
            e["chunks"] = [{"kind": fmt.KINDS[int(r["kind"])], "offset": int(r["offset"]), "length": int(r["length"]),
                            "raw_offset": int(r["raw_offset"]), "raw_length": int(r["raw_length"]),
                            "codec": t["codecs"][int(r["codec"])], "checksum": format(int(r["checksum"]), "016x")}
                           for r in rec[a - n:a]]
    return doc


def rewrite_index(data: bytes, edit=None, *, major: int = 1, minor: int | None = None,
                  raw_index: bytes | None = None) -> bytes:
    """Re-emit a container (bytes) with its index edited and every checksum made valid again:
    ``edit(doc)`` changes the document :func:`read_index` gives (in place or by returning a new
    one); a 1.1 file gets its chunk table rebuilt from the edited chunks. ``major``/``minor``
    go into the header (the minor defaults to the file's). ``raw_index`` replaces
    the index bytes outright (for JSON no writer would produce). The data region is unchanged,
    so a hostile file built this way has valid chunk checksums and only what the edit says wrong."""
    import struct

    from zipmoe.codecs import format as fmt
    from zipmoe.codecs.checksum import checksum

    header_minor = minor
    minor = struct.unpack_from("<H", data, 10)[0]
    ioff = struct.unpack_from("<Q", data, 24)[0]
    doc = read_index(data)
    if edit is not None:
        doc = edit(doc) or doc
    body_end = ioff
    table = b""
    if minor >= 1:
        ioff_doc = json.loads(data[ioff:ioff + struct.unpack_from("<Q", data, 32)[0]])
        body_end = ioff_doc["chunk_table"]["offset"]
        codecs = list(fmt.KNOWN_CODECS)
        chunks = [c for e in doc["tensors"] for c in e["chunks"]]
        for c in chunks:
            if c["codec"] not in codecs:
                codecs.append(c["codec"])
        rec = np.zeros(len(chunks), fmt.CHUNK_RECORD)
        for i, c in enumerate(chunks):
            rec[i] = (c["offset"], c["length"], c["raw_offset"], c["raw_length"], int(c["checksum"], 16),
                      fmt.KINDS.index(c["kind"]), codecs.index(c["codec"]), b"")
        table = rec.tobytes()
        rows = doc["tensors"]
        for e in rows:
            e["chunk_count"] = len(e.pop("chunks"))
            e["extent_offset"], e["extent_length"] = e.pop("extent")
        doc["tensors"] = {k: [e.get(k) for e in rows] for k in (rows[0] if rows else {})}
        doc["chunk_table"] = {"offset": body_end, "count": len(chunks), "record_size": fmt.CHUNK_RECORD.itemsize,
                              "codecs": codecs, "checksum": format(checksum(table), "016x")}
        table += bytes(fmt.align_up(len(table)) - len(table))
    index = raw_index if raw_index is not None else json.dumps(doc).encode()
    new_ioff = body_end + len(table)
    hdr = struct.pack("<8sHHIQQQQQ", fmt.MAGIC, major, minor if header_minor is None else header_minor, 64, 4096, new_ioff, len(index), checksum(index), 0)
    return hdr + struct.pack("<Q", checksum(hdr)) + data[64:body_end] + table + index
