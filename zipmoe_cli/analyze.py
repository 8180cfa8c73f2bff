"""`zipmoe analyze`: placeholder until its issue lands (see docs/architecture.md)."""

from __future__ import annotations

from .app import app


@app.command(name="analyze", help="(not implemented yet)")
def analyze() -> None:
    from zipmoe.errors import ZipmoeError

    raise ZipmoeError("`zipmoe analyze` is not implemented yet")
