"""`zipmoe chat`: placeholder until its issue lands (see docs/architecture.md)."""

from __future__ import annotations

from .app import app


@app.command(name="chat", help="(not implemented yet)")
def chat() -> None:
    from zipmoe.errors import ZipmoeError

    raise ZipmoeError("`zipmoe chat` is not implemented yet")
