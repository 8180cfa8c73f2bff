"""`zipmoe verify`: placeholder until its issue lands (see docs/architecture.md)."""

from __future__ import annotations

from .app import app


@app.command(name="verify", help="(not implemented yet)")
def verify() -> None:
    from zipmoe.errors import ZipmoeError

    raise ZipmoeError("`zipmoe verify` is not implemented yet")
