"""How long opening a container of DeepSeek-V3's size takes: header, index (and chunk table),
validation, config.json and the metadata check, i.e. ``ContainerReader(path)``.

A synthetic file, laid out as ``zipmoe pack`` lays out DeepSeek-V3 (671 B parameters: 61 layers,
the first 3 dense, 256 routed experts x 3 projections of [2048, 7168] in the other 58, shared
experts, MLA attention, a 129,280-token vocabulary), with 1 MiB exponent shards: about 44,700
entries and 740,000 chunks. The data region is a sparse hole (the file's apparent size is about
900 GB; it occupies a few hundred MB): opening a file reads no tensor data. It is written twice,
as format 1.0 (chunks inline in the JSON index) and as 1.1 (binary chunk table).

    python benchmarks/index_open.py --out /tmp/idx                 # build both, time both
    python benchmarks/index_open.py --open /tmp/idx/dsv3-1.0.zmoe  # time opening FILE(s) only
                                                                   # (e.g. with another zipmoe)

``--layers``/``--experts`` shrink the model (a quick check that the files are valid).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

CONFIG = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
          "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
          "first_k_dense_replace": 3, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
          "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
          "v_head_dim": 128, "num_attention_heads": 128, "vocab_size": 129280}


def tensors(layers: int, experts: int) -> list:
    """(name, shape) of every tensor of the (shrunk) DeepSeek-V3, in source order."""
    H, I, M, V = 7168, 18432, 2048, 129280
    out = [("model.embed_tokens.weight", (V, H))]
    for L in range(layers):
        p = f"model.layers.{L}"
        out += [(f"{p}.input_layernorm.weight", (H,)), (f"{p}.post_attention_layernorm.weight", (H,)),
                (f"{p}.self_attn.q_a_proj.weight", (1536, H)), (f"{p}.self_attn.q_a_layernorm.weight", (1536,)),
                (f"{p}.self_attn.q_b_proj.weight", (128 * 192, 1536)),
                (f"{p}.self_attn.kv_a_proj_with_mqa.weight", (576, H)),
                (f"{p}.self_attn.kv_a_layernorm.weight", (512,)),
                (f"{p}.self_attn.kv_b_proj.weight", (128 * 256, 512)), (f"{p}.self_attn.o_proj.weight", (H, 128 * 128))]
        if L < 3:
            out += [(f"{p}.mlp.{n}_proj.weight", s) for n, s in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I)))]
            continue
        out += [(f"{p}.mlp.gate.weight", (experts, H)), (f"{p}.mlp.gate.e_score_correction_bias", (experts,))]
        out += [(f"{p}.mlp.shared_experts.{n}_proj.weight", s) for n, s in (("gate", (M, H)), ("up", (M, H)), ("down", (H, M)))]
        for x in range(experts):
            out += [(f"{p}.mlp.experts.{x}.{n}_proj.weight", s) for n, s in (("gate", (M, H)), ("up", (M, H)), ("down", (H, M)))]
    out += [("model.norm.weight", (H,)), ("lm_head.weight", (V, H))]
    return out


def build(path: Path, version: str, layers: int, experts: int, shard: int = 1 << 20) -> dict:
    """Write the synthetic container; returns counts."""
    from zipmoe.codecs import format as fmt
    from zipmoe.codecs.checksum import checksum
    from zipmoe.codecs.metadata import derive
    from zipmoe.codecs.writer import _PROJ_ORDER

    cfg = dict(CONFIG, num_hidden_layers=layers, n_routed_experts=experts)
    rng = np.random.default_rng(0)
    items = []
    for i, (name, shape) in enumerate(tensors(layers, experts)):
        d = derive(name, shape, cfg)
        items.append((d.role != "dense", d.layer or 0, d.expert or 0, _PROJ_ORDER.get(d.proj, 9), i, name, shape, d))
    items.sort(key=lambda t: t[:5] if t[0] else (0, t[4]))
    packed = version != "1.0"
    pos, entries, prev_dense = fmt.DATA_START, [], False
    for _, _, _, _, i, name, shape, d in items:
        n = int(np.prod(shape))
        nbytes = 2 * n
        dense = packed and d.role == "dense"
        if not (dense and prev_dense):
            pos = fmt.align_up(pos)
        prev_dense = dense
        start, chunks = pos, []
        for a in range(0, n, shard):
            raw = min(shard, n - a)
            length = int(raw * 0.66) + 16  # what zstd makes of trained bf16 exponents
            chunks.append(fmt.Chunk("exp", pos, length, a, raw, "zstd", int(rng.integers(1 << 63))))
            pos += length
        chunks.append(fmt.Chunk("sm", pos, n, 0, n, "raw", int(rng.integers(1 << 63))))
        pos += n
        entries.append(fmt.TensorEntry(name, "BF16", tuple(shape), d.role, d.layer, d.expert, d.proj, None,
                                       tuple(shape), (start, pos - start), chunks, nbytes, i))
    config = json.dumps(cfg).encode()
    pos = fmt.align_up(pos)
    files = [fmt.FileEntry("config.json", pos, len(config), len(config), "raw", checksum(config))]
    writes = [(pos, config)]
    pos = fmt.align_up(pos + len(config))
    table = None
    if packed:
        raw_table = fmt.chunk_table_bytes(entries)
        table = {"offset": pos, "count": len(raw_table) // fmt.CHUNK_RECORD.itemsize, "checksum": checksum(raw_table)}
        writes.append((pos, raw_table))
        pos = fmt.align_up(pos + len(raw_table))
    meta = {"format_version": version, "created_by": "benchmarks/index_open.py", "codec": "zstd", "shard_size": shard,
            "alignment": 4096, "model": {"architecture": "DeepseekV3ForCausalLM", "model_type": "deepseek_v3",
                                         "family": "deepseek_v3", "num_layers": layers, "num_experts": experts,
                                         "top_k": 8}}
    index = fmt.index_to_bytes(fmt.Index(meta, entries, files), table)
    writes.append((pos, index))
    header = fmt.pack_header(pos, len(index), checksum(index), minor=int(version.split(".")[1]))
    writes.append((0, header))
    with open(path, "wb") as f:
        for off, data in writes:
            f.seek(off)
            f.write(data)
    return {"entries": len(entries), "chunks": sum(len(e.chunks) for e in entries), "index_bytes": len(index),
            "table_bytes": table["count"] * fmt.CHUNK_RECORD.itemsize if table else 0, "file_bytes": pos + len(index)}


def time_open(path: Path, repeats: int) -> list:
    from zipmoe.codecs.reader import ContainerReader

    times = []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        r = ContainerReader(path)
        times.append((time.perf_counter() - t0, time.process_time() - c0))
        r.close()
        del r
    return times


def _fmt(t: list) -> str:
    wall = statistics.median(x[0] for x in t)
    cpu = statistics.median(x[1] for x in t)
    return f"open {wall:.3f} s wall, {cpu:.3f} s CPU (medians of {len(t)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="folder for the two synthetic files")
    ap.add_argument("--open", type=Path, nargs="+", help="only time opening these files")
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    import zipmoe

    where = Path(zipmoe.__file__).resolve().parent.parent
    if a.open:
        for p in a.open:
            t = time_open(p, a.repeats)
            print(f"{p.name}: {_fmt(t)}; zipmoe at {where}")
        return
    if a.out is None:
        sys.exit("give --out DIR (to build and time) or --open FILE...")
    a.out.mkdir(parents=True, exist_ok=True)
    for version in ("1.0", "1.1"):
        p = a.out / f"dsv3-{version}.zmoe"
        t0 = time.perf_counter()
        info = build(p, version, a.layers, a.experts)
        built = time.perf_counter() - t0
        t = time_open(p, a.repeats)
        table = f", chunk table {info['table_bytes'] / 1e6:.1f} MB" if info["table_bytes"] else ""
        print(f"format {version}: {info['entries']} entries, {info['chunks']} chunks, "
              f"index {info['index_bytes'] / 1e6:.1f} MB{table}, file {info['file_bytes'] / 1e9:.0f} GB (sparse), "
              f"built in {built:.1f} s; {_fmt(t)}; zipmoe at {where}")
        os.sync()


if __name__ == "__main__":
    main()
