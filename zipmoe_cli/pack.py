"""`zipmoe pack`: placeholder until its issue lands (see docs/architecture.md)."""

from __future__ import annotations

from .app import app


@app.command(name="pack", help="(not implemented yet)")
def pack() -> None:
    from zipmoe.errors import ZipmoeError

    raise ZipmoeError("`zipmoe pack` is not implemented yet")
