"""The typer application and the one place where errors become exit codes.

Every command is a function in its own module (``zipmoe_cli/analyze.py`` has ``analyze``, ...);
:func:`register` adds them to :data:`app` when :func:`main` runs (the command modules never
import this one: one direction only). The command modules import nothing heavy at their top
(no torch, no transformers): ``zipmoe --help`` and ``zipmoe CMD --help`` stay fast, and each
command imports what it needs when it runs. A new command: a module with its function, and one
line in :func:`register`. Errors a user can
cause are :class:`zipmoe.errors.ZipmoeError`: they print as one line on stderr and exit
non-zero. Anything else is a bug: it prints one line too, unless ``--debug`` (anywhere on the
command line) or ``ZIPMOE_DEBUG=1`` asks for the traceback.
"""

from __future__ import annotations

import os
import sys

import typer

from zipmoe.version import __version__
from zipmoe.errors import ZipmoeError

app = typer.Typer(
    name="zipmoe",
    help="Lossless compression and SSD serving for Mixture-of-Experts models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"zipmoe {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks (may also follow the command)."),
) -> None:
    """Lossless compression and SSD serving for Mixture-of-Experts models."""


def register() -> None:
    """Add every command to :data:`app` (once), in the order ``zipmoe --help`` lists them."""
    if app.registered_commands:
        return
    from . import analyze, bench, chat, pack, plan, serve, synth, unpack, verify

    app.command(name="analyze")(analyze.analyze)
    app.command(name="bench")(bench.bench)
    app.command(name="chat")(chat.chat)
    app.command(name="pack")(pack.pack)
    app.command(name="plan")(plan.plan)
    app.command(name="serve")(serve.serve)
    app.command(name="synth", help=synth.HELP)(synth.synth)
    app.command(name="unpack")(unpack.unpack)
    app.command(name="verify")(verify.verify)


def _fail(message: str, code: int) -> None:
    sys.stderr.write(f"zipmoe: error: {message}\n")
    sys.stderr.flush()
    raise SystemExit(code)


def main(argv: list[str] | None = None) -> None:
    """Console entry point."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args or os.environ.get("ZIPMOE_DEBUG", "") not in ("", "0")
    args = [a for a in args if a != "--debug"]
    register()
    try:
        app(args=args, prog_name="zipmoe", standalone_mode=True)
    except ZipmoeError as exc:
        if debug:
            raise
        _fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__, exc.exit_code)
    except KeyboardInterrupt:
        if debug:
            raise
        _fail("interrupted", 130)
    except MemoryError:
        if debug:
            raise
        _fail("out of memory (try a smaller --budget or fewer --workers)", 1)
    except Exception as exc:  # a bug, not the user's fault: still one line by default
        if debug:
            raise
        _fail(f"internal error: {type(exc).__name__}: {exc} (run again with --debug for the traceback)", 1)


if __name__ == "__main__":  # pragma: no cover
    main()
