"""`zipmoe synth`: placeholder until its issue lands (see docs/architecture.md)."""

from __future__ import annotations

from .app import app


@app.command(name="synth", help="(not implemented yet)")
def synth() -> None:
    from zipmoe.errors import ZipmoeError

    raise ZipmoeError("`zipmoe synth` is not implemented yet")
