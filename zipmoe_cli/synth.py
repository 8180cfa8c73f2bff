"""`zipmoe synth`: synthetic checkpoints of every supported family, and the demo MoE."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

HELP = """Write a checkpoint that transformers loads offline.

[bold]zipmoe synth FAMILY -o DIR[/bold] writes random weights with a real model's shapes
(trained-like scales, routers with a trained model's expert popularity); [bold]zipmoe synth demo -o DIR[/bold] upcycles
SmolLM2-135M-Instruct into a Mixtral MoE that chats; [bold]zipmoe synth --list[/bold] shows
families and presets."""


def synth(
    family: Optional[str] = typer.Argument(None, help="mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v2, switch_transformers, or demo."),
    out: Optional[Path] = typer.Option(None, "-o", "--out", help="Output folder (must be empty unless --force)."),
    preset: str = typer.Option("tiny", "--preset", "-p", help="Preset name (see --list)."),
    seed: int = typer.Option(0, "--seed", help="Random seed: same family, preset and seed give identical files."),
    routing: Optional[str] = typer.Option(None, "--routing", help="natural: a trained model's expert popularity (default, except for the tiny presets); skewed: Zipf exponent --skew (the tiny presets' default)."),
    skew: Optional[float] = typer.Option(None, "--skew", help="Zipf exponent of expert popularity for --routing skewed (default 1; 0 = uniform); implies --routing skewed."),
    dtype: str = typer.Option("bf16", "--dtype", help="Tensor dtype (bf16 only)."),
    layout: str = typer.Option("split", "--layout", help="split: one tensor per expert (the family's usual names); fused: transformers-5 gate_up_proj/down_proj."),
    dist: str = typer.Option("normal", "--dist", help="Weight distribution: normal or student-t (heavier tails)."),
    experts: Optional[int] = typer.Option(None, "--experts", help="demo only: experts per layer (default 8)."),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="demo only: experts per token (default 2)."),
    layers: Optional[int] = typer.Option(None, "--layers", help="Keep only the first N layers of the preset (its real shapes, a smaller model); encoder-decoder: N on each side, the sparse layers at the preset's step."),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty output folder."),
    list_: bool = typer.Option(False, "--list", help="List families and presets with parameter counts and sizes."),
) -> None:
    from rich.console import Console

    from zipmoe.errors import UsageError

    console = Console()
    if list_:
        _print_list(console, family)
        return
    if family is None:
        raise UsageError("name a family (or `demo`), e.g. `zipmoe synth mixtral -o DIR`; `zipmoe synth --list` shows them")
    if out is None:
        raise UsageError("missing -o DIR: the folder to write")
    if family == "demo":
        from zipmoe.runtime.synth import build_demo

        if layers is not None:
            raise UsageError("--layers belongs to the family presets, not the demo")
        if routing is not None:
            raise UsageError("--routing belongs to the family presets; the demo's routers are calibrated (--skew)")
        r = build_demo(out, experts=8 if experts is None else experts, top_k=2 if top_k is None else top_k,
                       seed=seed, skew=1.0 if skew is None else skew, force=force)
        from zipmoe.units import format_size

        console.print(f"wrote {r.path}: demo MoE upcycled from SmolLM2-135M-Instruct, {r.experts} experts, "
                      f"top-{r.top_k}, {r.params / 1e6:.0f}M parameters, {format_size(r.nbytes)} bf16, "
                      f"{r.seconds:.0f} s")
        return
    if experts is not None or top_k is not None:
        raise UsageError("--experts and --top-k belong to `zipmoe synth demo`; a family preset fixes them")
    from zipmoe.runtime.synth import write

    r = write(family, out, preset=preset, seed=seed, skew=skew, layout=layout, dtype=dtype, force=force, dist=dist,
              routing=routing, layers=layers)
    _print_result(console, r)


def _print_list(console, family) -> None:
    from rich.console import Console
    from rich.table import Table

    from zipmoe.runtime.synth import preset_table
    from zipmoe.units import format_size

    table = Table(title="zipmoe synth: families and presets")
    for col in ("family", "preset", "shape of", "parameters", "in experts", "bf16 size"):
        table.add_column(col, justify="right" if col in ("parameters", "in experts", "bf16 size") else "left")
    for row in preset_table(family):
        table.add_row(row["family"], row["preset"], row["source"], _count(row["params"]),
                      f"{100 * row['expert_params'] / row['params']:.0f}%", format_size(row["bf16_bytes"]))
    Console(width=max(console.width, 120)).print(table)
    console.print("demo: SmolLM2-135M-Instruct upcycled into a Mixtral MoE (`zipmoe synth demo -o DIR "
                  "[--experts 8] [--top-k 2]`)")


def _count(n: int) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f} B"
    if n >= 1e6:
        return f"{n / 1e6:.1f} M"
    return f"{n / 1e3:.0f} K"


def _print_result(console, r) -> None:
    from zipmoe.units import format_size

    console.print(f"wrote {r.path}: {r.family}/{r.preset}, {_count(r.params)} parameters, "
                  f"{format_size(r.nbytes)} bf16 in {r.seconds:.1f} s "
                  f"({r.nbytes / max(r.seconds, 1e-9) / 1e6:.0f} MB/s)")
    if r.routing == "natural":
        console.print(f"routing natural: Zipf exponent {r.skew} (a trained model's per-layer selection entropy)")
    else:
        console.print(f"routing skewed: Zipf exponent {r.skew}")
    console.print(f"exponent entropy (bits, sample): per tensor {r.entropy('per_tensor'):.3f}, "
                  f"experts {r.entropy('expert'):.3f}, all tensors pooled {r.entropy('all'):.3f}")
    hist = r.exp_hist["all"]
    total = hist.sum()
    if total:
        top = sorted(range(256), key=lambda i: -hist[i])[:8]
        top.sort()
        width = 40
        peak = max(hist[i] for i in top)
        for i in top:
            bar = "#" * max(1, int(width * hist[i] / peak))
            console.print(f"  exp {i:3d} (2^{i - 127:+d}) {100 * hist[i] / total:5.1f}% {bar}")
