"""`zipmoe unpack`: placeholder until its issue lands (see docs/architecture.md)."""

from __future__ import annotations

from .app import app


@app.command(name="unpack", help="(not implemented yet)")
def unpack() -> None:
    from zipmoe.errors import ZipmoeError

    raise ZipmoeError("`zipmoe unpack` is not implemented yet")
