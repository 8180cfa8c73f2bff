"""`zipmoe analyze`: bit-field entropy per tensor, the size bound, and measured codec sizes."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer

SUMMARY_ABOVE = 40  # more tensors than this: per-role totals + the top N, unless --all


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def _bits(x: float | None, nd: int = 3) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def analyze(
    path: Path = typer.Argument(..., help="Model folder (config.json + *.safetensors), one .safetensors file, or a hub repo id ORG/NAME[@REVISION]."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document instead of tables."),
    measure: bool = typer.Option(False, "--measure", help="Also compress with each codec: real sizes and decode speed (slow)."),
    codec: Optional[List[str]] = typer.Option(None, "--codec", help="Codec(s) for --measure (repeatable; default: all)."),
    shard_size: str = typer.Option("1M", "--shard-size", help="Exponent bytes per shard for --measure."),
    show_all: bool = typer.Option(False, "--all", help="List every tensor (default: a summary for big models)."),
    top: int = typer.Option(20, "--top", help="Tensors listed in the summary, largest first."),
    workers: int = typer.Option(0, "--workers", help="Threads for the entropy pass (default: one per core, up to 4; --measure uses 1)."),
) -> None:
    """Sign/exponent/mantissa entropy per tensor and in total, and the bound (8 + H(exp))/16."""
    from zipmoe.codecs.entropy import analyze_checkpoint
    from zipmoe.codecs.checkpoint import open_checkpoint
    from zipmoe.errors import UsageError
    from zipmoe.units import parse_size

    from .pack import progress_bar

    if workers < 0:
        raise UsageError(f"--workers must be at least 1, got {workers}")
    if top < 0:
        raise UsageError(f"--top must be 0 or more, got {top}")
    size = parse_size(shard_size)
    if size < 4096:
        raise UsageError(f"--shard-size must be at least 4K, got {shard_size}")
    codecs = None
    if codec:
        from zipmoe.codecs.exponent import CODECS

        codecs = [c for item in codec for c in item.split(",") if c]
        bad = [c for c in codecs if c not in CODECS]
        if bad:
            raise UsageError(f"unknown codec {bad[0]!r}: choose from {', '.join(CODECS)}")
    if codec and not measure:
        measure = True

    with open_checkpoint(path) as ck:
        prog, update = progress_bar("analyzing")
        done = [0]

        def on_tensor(i, count, r):
            done[0] += r.nbytes
            update(done[0], ck.total_bytes)

        with prog:
            res = analyze_checkpoint(ck, measure=measure, codecs=codecs, shard_size=size,
                                     workers=workers or None, on_tensor=on_tensor)

    if as_json:
        sys.stdout.write(json.dumps(res.to_dict(), indent=1) + "\n")
        return
    _print_tables(res, show_all, top)


def _print_tables(res, show_all: bool, top: int) -> None:
    from rich.console import Console
    from rich.table import Table

    from zipmoe.units import format_size

    con = Console()
    if not con.is_terminal:
        con = Console(width=220)
    codecs = res.measured
    roles = Table(title=f"{res.path}  ({res.model_type or 'no config'})", title_justify="left")
    for col in ("group", "tensors", "size", "sign", "exponent", "mantissa", "bound"):
        roles.add_column(col, justify="left" if col == "group" else "right")
    for c in codecs:
        roles.add_column(f"{c} size", justify="right")
        roles.add_column(f"{c} GB/s", justify="right")
    order = ["expert", "dense", "other"]
    groups = [(k, res.by_role[k]) for k in order if k in res.by_role] + [("total", res.total)]
    for name, t in groups:
        d = t.to_dict()
        label = {"other": "non-bf16", "expert": "expert (bf16)", "dense": "dense (bf16)"}.get(name, name)
        row = [label, str(d["tensors"]), format_size(d["nbytes"]), _bits(d["sign_entropy_bits"]),
               _bits(d["exp_entropy_bits"]), _bits(d["mant_entropy_bits"]), _pct(d["bound"])]
        for c in codecs:
            m = (d.get("codecs") or {}).get(c)
            row += [_pct(m and m["ratio"]), _bits(m and m["decode_merge_gbps"], 2)]
        roles.add_row(*row, style="bold" if name == "total" else None)

    tensors = res.tensors
    summarised = not show_all and len(tensors) > SUMMARY_ABOVE
    if summarised:
        tensors = sorted(tensors, key=lambda r: -r.nbytes)[:top]
    tt = Table(title=(f"largest {len(tensors)} of {len(res.tensors)} tensors (--all for every one)"
                      if summarised else f"{len(tensors)} tensors"), title_justify="left")
    for col in ("name", "dtype", "shape", "role", "layer", "expert", "sign", "exp", "mant", "bound"):
        tt.add_column(col, justify="left" if col in ("name", "dtype", "shape", "role") else "right",
                      overflow="fold" if col == "name" else "ellipsis")
    for c in codecs:
        tt.add_column(c, justify="right")
    for r in tensors:
        e = r.entropy
        role = r.role + (f" {r.proj}" if r.proj else "") + (" fused" if r.fused else "")
        row = [r.name, r.dtype, "x".join(map(str, r.shape)) or "scalar", role,
               "" if r.layer is None else str(r.layer), "" if r.expert is None else str(r.expert),
               _bits(e and e.sign_bits), _bits(e and e.exp_bits), _bits(e and e.mant_bits),
               _pct(e and e.bound)]
        by = {m.codec: m for m in r.codecs}
        for c in codecs:
            m = by.get(c)
            row.append("-" if m is None else f"{100 * m.ratio:.2f}% {m.to_dict()['decode_merge_gbps'] or 0:.2f}")
        tt.add_row(*row)

    con.print(roles)
    if tensors:
        con.print(tt)
    if codecs:
        con.print("codec columns: stored size (E chunks + raw sign-mantissa bytes) as % of bf16, and decode + "
                  "merge GB/s of bf16 on one core (per-shard, in cache)")
    d = res.total.to_dict()
    con.print(f"total: {d['tensors']} tensors, {format_size(d['nbytes'])}; bf16: {d['bf16_tensors']} tensors, "
              f"{format_size(d['bf16_bytes'])} ({res.seconds:.1f} s)")
    if d["bf16_bytes"]:
        con.print(f"entropy, bits per value (size-weighted over bf16 tensors): sign {_bits(d['sign_entropy_bits'])}, "
                  f"exponent {_bits(d['exp_entropy_bits'])} (pooled {_bits(d['pooled_exp_entropy_bits'])}), "
                  f"mantissa {_bits(d['mant_entropy_bits'])}")
        con.print(f"bound (8 + H(exp))/16 per tensor: {_pct(d['bound'])} of bf16 = {format_size(d['bound_bytes'])}")
        for c, m in (d.get("codecs") or {}).items():
            con.print(f"  {c:<10} {_pct(m['ratio'])} of bf16 (+{100 * (m['ratio'] - d['bound']):.2f} pp over the bound), "
                      f"decode {_bits(m['decode_gbps'], 2)} GB/s, decode + merge {_bits(m['decode_merge_gbps'], 2)} GB/s")
    else:
        con.print("no bf16 tensors: nothing to split (zipmoe packs them losslessly as they are)")
