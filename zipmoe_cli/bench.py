"""`zipmoe bench`: placeholder until its issue lands (see docs/architecture.md)."""

from __future__ import annotations

from .app import app


@app.command(name="bench", help="(not implemented yet)")
def bench() -> None:
    from zipmoe.errors import ZipmoeError

    raise ZipmoeError("`zipmoe bench` is not implemented yet")
