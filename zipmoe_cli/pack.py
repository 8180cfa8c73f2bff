"""`zipmoe pack`: a checkpoint folder (or .safetensors file, or hub repo id) into one .zmoe container."""

from __future__ import annotations

from pathlib import Path

import typer


def progress_bar(description: str):
    """A rich progress bar for byte counts; returns (progress, callback)."""
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    console = Console(stderr=True)
    prog = Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
                    TransferSpeedColumn(), TimeRemainingColumn(), transient=True, console=console,
                    disable=not console.is_terminal)
    task = prog.add_task(description, total=None)

    def update(done: int, total: int) -> None:
        prog.update(task, completed=done, total=total)

    return prog, update


def pack(
    path: Path = typer.Argument(..., help="Model folder (config.json + *.safetensors), one .safetensors file, or a hub repo id ORG/NAME[@REVISION] (from the local hub cache; downloaded unless HF_HUB_OFFLINE is set)."),
    out: Path = typer.Option(..., "-o", "--out", help="Output .zmoe file."),
    codec: str = typer.Option("zstd", "--codec", help="Exponent codec: zstd (default, smallest), zstd-fast, lz4, lz4hc."),
    shard_size: str = typer.Option("1M", "--shard-size", help="Exponent bytes per compressed chunk, e.g. 256K, 1M."),
    workers: int = typer.Option(0, "--workers", help="Compression threads (default: one per core)."),
    force: bool = typer.Option(False, "--force", help="Overwrite OUT if it exists."),
) -> None:
    """Pack a bf16 checkpoint losslessly: exponents compressed, sign-mantissa bytes raw."""
    from rich.console import Console

    from zipmoe.codecs.exponent import PACK_CODECS
    from zipmoe.codecs.writer import pack as do_pack
    from zipmoe.errors import UsageError
    from zipmoe.units import format_size, parse_size

    if codec not in PACK_CODECS:
        raise UsageError(f"unknown codec {codec!r}: choose one of {', '.join(PACK_CODECS)}")
    size = parse_size(shard_size)
    if size < 4096:
        raise UsageError(f"--shard-size must be at least 4K, got {shard_size}")
    if workers < 0:
        raise UsageError(f"--workers must be at least 1, got {workers}")
    console = Console(stderr=True)
    prog, update = progress_bar("packing")
    with prog:
        s = do_pack(path, out, codec=codec, shard_size=size, workers=workers or None, force=force, progress=update)
    con = Console()
    if s.dense_only:
        console.print("[yellow]no expert tensors found: packed as a dense model[/yellow]")
    experts = (f"{s.num_expert_entries} expert tensors ({s.num_experts} experts per layer"
               f"{', from fused tensors' if s.fused_tensors else ''}), " if not s.dense_only else "")
    if s.stale_removed:
        con.print(f"  removed {len(s.stale_removed)} leftover temporary file(s) of an interrupted pack: "
                  f"{', '.join(s.stale_removed)}", style="dim")
    con.print(f"[bold green]packed[/bold green] {path} -> {s.out_path}")
    con.print(f"  {s.num_tensors} source tensors: {experts}{s.num_entries - s.num_expert_entries} dense entries")
    con.print(f"  codec {s.codec}, exponent shards of {format_size(s.shard_size)}, {s.workers} workers")
    if s.bf16_bytes:
        con.print(f"  bf16 tensors   {format_size(s.bf16_bytes):>12} -> {format_size(s.bf16_stored_bytes):>12}  "
                  f"{100 * s.bf16_ratio:6.2f}%")
        con.print(f"  bound          {'':>12}    {format_size(s.bound_bytes):>12}  {100 * s.bound_ratio:6.2f}%"
                  f"  (8 + H(exp))/16, summed per tensor")
    if s.other_bytes:
        con.print(f"  other dtypes   {format_size(s.other_bytes):>12} -> {format_size(s.other_stored_bytes):>12}")
    con.print(f"  file           {format_size(s.source_bytes):>12} -> {format_size(s.file_bytes):>12}  "
              f"{100 * s.ratio:6.2f}% of the source tensor bytes")
    con.print(f"  time           {s.seconds:10.2f} s   {format_size(s.throughput)}/s")
