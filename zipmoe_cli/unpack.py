"""`zipmoe unpack`: a .zmoe back into a plain safetensors model folder, bit-identical."""

from __future__ import annotations

from pathlib import Path

import typer


def unpack(
    file: Path = typer.Argument(..., help="The .zmoe file."),
    out: Path = typer.Option(..., "-o", "--out", help="Output folder."),
    force: bool = typer.Option(False, "--force", help="Write into a non-empty folder."),
    workers: int = typer.Option(0, "--workers", help="Decode threads (default: one per core)."),
) -> None:
    """Restore the model folder: same tensor names, same bytes, config and tokenizer files."""
    from rich.console import Console

    from zipmoe.codecs.safetensors_out import unpack as do_unpack
    from zipmoe.units import format_size

    from .pack import progress_bar

    prog, update = progress_bar("unpacking")
    with prog:
        s = do_unpack(file, out, force=force, workers=workers or None, progress=update)
    Console().print(f"[bold green]unpacked[/bold green] {file} -> {s.out_dir}: {s.tensors} tensors "
                    f"({format_size(s.bytes)}) in {s.shards} safetensors file{'s' if s.shards > 1 else ''}, "
                    f"{len(s.files)} other files ({s.seconds:.2f} s)")
