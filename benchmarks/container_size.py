"""Container size against the per-tensor entropy bound, format 1.0 (every extent 4096-aligned)
against 1.1 (dense tensors and embedded files packed back to back; experts stay aligned).

Checkpoints: a BERT-base-shaped model made with transformers' ``from_config`` (110 M parameters,
200 tensors, 125 of them biases and LayerNorms of 768 or 3072 values; weights as initialised,
N(0, 0.02), and the 1-D tensors given trained-like spread: biases N(0, 0.02), LayerNorm weights
1 + N(0, 0.05)), and every ``zipmoe synth`` family at its ``tiny`` preset (or ``--preset``).

    python benchmarks/container_size.py --work /tmp/size [--preset small] [--families mixtral,olmoe] [--no-bert]

Prints one row per checkpoint: bound and file size as % of the source bf16 bytes, and the
points above the bound for 1.0 and 1.1.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path


SMALL_BYTES = 64 << 10  # what the "small dense" column counts (dense tensors under 64 KiB)


def bert_like(out: Path) -> Path:
    import torch
    from transformers import BertConfig, BertModel

    if (out / "config.json").exists():
        return out
    torch.manual_seed(0)
    model = BertModel(BertConfig()).to(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                noise = torch.randn(p.shape, generator=g)
                p.copy_((1 + 0.05 * noise) if name.endswith("LayerNorm.weight") else 0.02 * noise)
    model.save_pretrained(out, safe_serialization=True)
    return out


def row(name: str, src: Path, work: Path, workers: int) -> str:
    from zipmoe.codecs.checkpoint import open_checkpoint
    from zipmoe.codecs.writer import pack

    with open_checkpoint(src) as ck:
        n = len(ck.tensors)
        small = sum(1 for t in ck.tensors if t.nbytes < SMALL_BYTES and ".experts." not in t.name)
    res = {}
    for version in ("1.0", "1.1"):
        s = pack(src, work / f"{name}-{version}.zmoe", workers=workers, force=True, version=version)
        res[version] = s
    s0, s1 = res["1.0"], res["1.1"]
    bound = 100 * s1.bound_ratio
    f0, f1 = 100 * s0.ratio, 100 * s1.ratio
    return (f"| {name} | {n} | {small} | {s1.bf16_bytes / 1e6:.1f} | {bound:.2f}% | {f0:.2f}% | {f1:.2f}% "
            f"| {f0 - bound:+.2f} | {f1 - bound:+.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True, help="scratch folder (checkpoints and containers)")
    ap.add_argument("--families", default="mixtral,qwen2_moe,qwen3_moe,olmoe,deepseek_v2,switch_transformers")
    ap.add_argument("--preset", default="tiny", help="synth preset for the families (tiny, small, ...)")
    ap.add_argument("--no-bert", action="store_true")
    ap.add_argument("--workers", type=int, default=2)
    a = ap.parse_args()
    import torch

    torch.set_num_threads(2)
    a.work.mkdir(parents=True, exist_ok=True)
    print("| checkpoint | tensors | small dense | bf16 MB | bound | 1.0 file | 1.1 file | 1.0 − bound (pp) | 1.1 − bound (pp) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    if not a.no_bert:
        print(row("bert-base-like", bert_like(a.work / "bert"), a.work, a.workers), flush=True)
    from zipmoe.runtime import synth

    for fam in [f for f in a.families.split(",") if f]:
        d = a.work / f"synth-{fam}-{a.preset}"
        if not (d / "config.json").exists():
            shutil.rmtree(d, ignore_errors=True)
            synth.write(fam, d, preset=a.preset, seed=0, force=True, progress=False)
        print(row(f"synth {fam} {a.preset}", d, a.work, a.workers), flush=True)


if __name__ == "__main__":
    main()
