"""`zipmoe plan`: placeholder until its issue lands (see docs/architecture.md)."""

from __future__ import annotations

from .app import app


@app.command(name="plan", help="(not implemented yet)")
def plan() -> None:
    from zipmoe.errors import ZipmoeError

    raise ZipmoeError("`zipmoe plan` is not implemented yet")
