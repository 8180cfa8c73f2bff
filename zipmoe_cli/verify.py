"""`zipmoe verify`: the index and its metadata, every checksum, every tensor decoded, optionally
compared with the source (a folder, a file or a hub repo id)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def verify(
    file: Path = typer.Argument(..., help="The .zmoe file."),
    against: Optional[Path] = typer.Option(None, "--against", help="Source checkpoint to compare bit for bit: a folder, a .safetensors file or a hub repo id ORG/NAME[@REVISION]."),
    workers: int = typer.Option(0, "--workers", help="Decode threads (default: one per core)."),
) -> None:
    """Check a container; exit 0 only when every byte is right.

    Header and index; every size bounded before use; every entry's role/layer/expert/proj
    against the naming rules, no expert projection twice, every MoE layer with every expert;
    zero padding; every chunk's checksum; every tensor decoded; with --against, bit for bit
    against the source (a folder, a .safetensors file or a hub repo id ORG/NAME[@REVISION]).
    """
    from rich.console import Console

    from zipmoe.codecs.verify import verify_container
    from zipmoe.units import format_size

    from .pack import progress_bar

    prog, update = progress_bar("verifying")
    with prog:
        rep = verify_container(file, against=against, workers=workers or None, progress=update)
    tail = f"; identical to {against}" if rep.compared else ""
    Console().print(f"[bold green]OK[/bold green] {file}: {rep.entries} tensors ({format_size(rep.bytes)}) "
                    f"and {rep.files} files, all checksums match{tail} ({rep.seconds:.2f} s)")
