"""`zipmoe serve FILE.zmoe`: an OpenAI-compatible HTTP server over a model served from its container.

The listening socket is bound first (a port in use is one line and exit 2), then uvicorn
serves :func:`zipmoe.runtime.server.app.build_app` while the model loads on the model thread
(``/health`` answers 503 until it is ready). A load that fails (a corrupted file, a budget
below the minimum) stops the server and prints one line. SIGTERM or Ctrl-C: stop accepting,
let the requests in flight finish for up to ``--shutdown-timeout`` seconds, cancel the rest,
exit 0. Heavy modules (torch, transformers, starlette) are imported inside the command, so
``zipmoe serve --help`` stays fast. See docs/serve.md.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import typer



def serve(
    file: Path = typer.Argument(..., help="The .zmoe file."),
    budget: str = typer.Option("8G", "--budget", help="Memory for weights: dense + expert cache + in-flight (e.g. 8G, 512M)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0 for every interface)."),
    port: int = typer.Option(8000, "--port", help="Port to listen on (0: any free port, printed at start)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="ZIPMOE_API_KEY", show_envvar=True,
                                          help="Require 'Authorization: Bearer KEY' on every route but /health."),
    max_batch: int = typer.Option(8, "--max-batch", help="Most requests decoded together in one batch."),
    model_name: Optional[str] = typer.Option(None, "--model-name", help="The model id clients ask for (default: the file's stem)."),
    plan: Optional[Path] = typer.Option(None, "--plan", help="plan.json from `zipmoe plan` (cache pool sizes)."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
    dtype: str = typer.Option("auto", "--dtype", help="Compute dtype: auto (config.json's), bfloat16 or float32."),
    workers: int = typer.Option(0, "--workers", help="Decompression threads (default: half the cores)."),
    threads: int = typer.Option(0, "--threads", help="Torch threads (default: the cores the workers leave)."),
    warm: bool = typer.Option(False, "--warm", help="Fill the full-tensor pool before serving."),
    max_tokens: int = typer.Option(4096, "--max-tokens", help="Largest max_tokens a request may ask for."),
    default_max_tokens: int = typer.Option(1024, "--default-max-tokens", help="max_tokens of a request that does not say (capped by the context)."),
    max_body: str = typer.Option("1M", "--max-body", help="Largest request body (413 above)."),
    max_waiting: int = typer.Option(256, "--max-waiting", help="Most requests queued for a slot (429 above)."),
    shutdown_timeout: float = typer.Option(10.0, "--shutdown-timeout", help="Seconds requests in flight may take to finish after SIGTERM/Ctrl-C."),
    log_level: str = typer.Option("warning", "--log-level", help="uvicorn's log level (info shows every request)."),
    context: int = typer.Option(4096, "--context", help="KV cache in tokens of the decode loop a lone request runs on, as `zipmoe chat`, and the longest prompt + answer a request may have (clamped to the model's max_position_embeddings; on top of --budget)."),
    attention: str = typer.Option("reproducible", "--attention", metavar="reproducible|pytorch", help="On CUDA, as `zipmoe chat --attention`: reproducible attention kernels (the default), or PyTorch's own choice."),
) -> None:
    """Serve a model over HTTP with the OpenAI API (chat, completions, streaming, metrics)."""
    from zipmoe.errors import ContainerError, UsageError
    from zipmoe.units import parse_size

    for name, value in (("--max-batch", max_batch), ("--max-tokens", max_tokens),
                        ("--default-max-tokens", default_max_tokens), ("--max-waiting", max_waiting)):
        if value < 1:
            raise UsageError(f"{name} must be at least 1")
    if workers < 0 or threads < 0:
        raise UsageError("--workers and --threads must be at least 1")
    if not 0 <= port <= 65535:
        raise UsageError(f"--port must be in 0..65535, not {port}")
    if context < 2:
        raise UsageError("--context must be at least 2 tokens")
    if shutdown_timeout < 0:
        raise UsageError("--shutdown-timeout must be 0 or more")
    if log_level.lower() not in ("critical", "error", "warning", "info", "debug", "trace"):
        raise UsageError(f"unknown --log-level {log_level!r} (use critical, error, warning, info, debug or trace)")
    if api_key is not None and not api_key.strip():
        raise UsageError("--api-key (or ZIPMOE_API_KEY) is empty")
    from zipmoe.runtime.engine.settings import check_attention
    from zipmoe_cli.env import engine_env

    check_attention(attention)  # before the port is taken (the load runs later, on the model thread)
    engine_env()  # ZIPMOE_READERS / _PREFETCH / _FORCE: a wrong value stops here, before the port is taken
    budget_bytes = parse_size(budget)
    body_bytes = parse_size(max_body)
    if body_bytes < 1024:
        raise UsageError("--max-body must be at least 1K")
    if not file.exists():
        raise ContainerError(f"{file}: no such file")
    if file.is_dir():
        raise ContainerError(f"{file} is a folder: give a .zmoe file (`zipmoe pack` makes one)")
    if plan is not None and not plan.exists():
        raise UsageError(f"{plan}: no such plan file")
    try:
        from zipmoe.codecs.reader import ContainerReader

        ContainerReader(file).close()  # a file that is not a container fails here, before the port is taken
    except ContainerError:
        raise
    except OSError as exc:
        raise ContainerError(f"{file}: {exc.strerror or exc}") from None
    try:
        import uvicorn  # noqa: F401
        import starlette  # noqa: F401
        import sse_starlette  # noqa: F401
        import prometheus_client  # noqa: F401
    except ImportError as exc:
        raise UsageError(f"zipmoe serve needs the serve extra ({exc.name} is missing): pip install 'zipmoe[serve]'") from None

    sock = _bind(host, port)
    actual_port = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    _say(f"zipmoe serve: loading {file} as {model_name or file.stem!r} under a {budget} budget; "
         f"listening on http://{shown}:{actual_port}")

    from zipmoe.runtime.server.app import ServeConfig, ServerState, build_app
    from zipmoe_cli.default_plan import keep_usage
    from zipmoe_cli.serving import load_args

    args = load_args(file, budget_bytes=budget_bytes, device=device, plan=plan, workers=workers, threads=threads,
                     dtype=dtype, warm=warm, attention=attention, say=lambda line: _say(f"zipmoe serve: {line}"))
    cfg = ServeConfig(file=file, load_args=args, model_name=model_name or file.stem, api_key=api_key,
                      max_batch=max_batch, max_waiting=max_waiting, max_tokens=max_tokens,
                      default_max_tokens=default_max_tokens, max_body=body_bytes, shutdown_timeout=shutdown_timeout,
                      context=context)
    server_box: dict = {}

    def on_fatal(exc) -> None:
        srv = server_box.get("server")
        if srv is not None:
            srv.should_exit = True

    def on_ready(state) -> None:
        from zipmoe.units import format_size

        rt = state.model.zipmoe
        loop = state.stepper.loop
        if rt.plan_note:
            _say(f"zipmoe serve: warning: {rt.plan_note}")
        if loop is not None:
            _say(f"zipmoe serve: a lone request's {loop.describe_kv(context)}")
        _say(f"zipmoe serve: ready: {rt.family.name}, context {state.context} tokens, batches of up to "
             f"{max_batch}, budget {format_size(rt.budget)}{', API key required' if api_key else ''}")

    state = ServerState(cfg, on_fatal=on_fatal, on_ready=on_ready)
    asgi = build_app(state)
    server = _make_server(asgi, log_level.lower(), shutdown_timeout, state.begin_shutdown)
    server_box["server"] = server
    import asyncio

    try:
        asyncio.run(server.serve(sockets=[sock]))
    finally:
        sock.close()
        state.stop()  # after a forced exit the lifespan's shutdown may not have run: cancel, end the model thread
        if getattr(state, "model", None) is not None and getattr(state.model, "zipmoe", None) is not None:
            keep_usage(state.model.zipmoe)
    if state.load_error is not None:
        raise state.load_error
    _say("zipmoe serve: stopped")


def _say(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _bind(host: str, port: int):
    import socket

    from zipmoe.errors import UsageError

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UsageError(f"cannot listen on {host!r}: {exc.strerror}") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        if os.name != "nt":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(addr)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        why = "the port is in use" if exc.errno in (98, 48, 10048) else (exc.strerror or str(exc))
        raise UsageError(f"cannot listen on {host}:{port}: {why}") from None
    sock.set_inheritable(True)
    return sock


def _make_server(asgi, log_level: str, shutdown_timeout: float, on_exit):
    import logging

    import sse_starlette.sse  # noqa: F401 - patches uvicorn's exit handler to end SSE streams on shutdown
    import uvicorn

    class _Server(uvicorn.Server):
        """uvicorn, minus re-raising the signal after a graceful shutdown (which would turn
        SIGTERM into a kill and Ctrl-C into a KeyboardInterrupt instead of exit 0)."""

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            self._captured_signals.clear()
            on_exit()
            if self.force_exit:  # a second Ctrl-C: the tasks still running are cancelled, not errors
                logging.getLogger("uvicorn.error").setLevel(logging.CRITICAL + 1)

    config = uvicorn.Config(asgi, log_level=log_level, access_log=log_level in ("info", "debug", "trace"),
                            timeout_graceful_shutdown=int(shutdown_timeout + 5), lifespan="on",
                            server_header=False)
    return _Server(config)
