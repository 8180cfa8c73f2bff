"""A lone request on `zipmoe serve` is set up as `zipmoe chat` sets up a turn, and stays so.

Both commands build zipmoe.load's keywords through zipmoe_cli/serving.py; here each command is
run with zipmoe.load replaced by a recorder that stops the command, and the keywords compared:
budget, device, the default plan, decode workers, torch threads, dtype, attention kernels and
the engine settings from the environment. The decode loop's context is the same default in
both, and the server's one context figure is that loop's (every request fits it). Grad mode:
the server's stepper and chat both run under inference mode (tests/test_serve_engine.py,
tests/test_loop.py check that the logits carry no graph).
"""

from __future__ import annotations

import inspect

import pytest

from zipmoe.errors import UsageError
from zipmoe_cli.app import main

from test_runtime_fixtures import container


class _Stop(UsageError):
    pass


def _recorded(monkeypatch, argv, capsys) -> dict:
    import zipmoe.runtime.engine.loader as loader

    seen: dict = {}

    def fake_load(path, **kw):
        seen.update(kw)
        raise _Stop("recorded")

    monkeypatch.setattr(loader, "load", fake_load)
    try:
        main(argv)
    except SystemExit as exc:
        assert exc.code == 2, capsys.readouterr().err
    err = capsys.readouterr().err
    assert "recorded" in err.strip().splitlines()[-1], err
    return seen


@pytest.mark.parametrize("env", [{}, {"ZIPMOE_READERS": "2", "ZIPMOE_PREFETCH": "1"}])
def test_serve_loads_what_chat_loads(tmp_path_factory, monkeypatch, capsys, env):
    _, path = container(tmp_path_factory, "mixtral")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("ZIPMOE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    common = ["--budget", "64M", "--device", "cpu"]
    chat = _recorded(monkeypatch, ["chat", str(path), "--prompt", "hi", "--json", *common], capsys)
    serve = _recorded(monkeypatch, ["serve", str(path), "--port", "0", *common], capsys)
    chat.pop("trace", None), chat.pop("kernels", None)  # chat's own options (defaults: no trace, exact)
    assert chat == serve
    assert {"budget", "device", "plan", "workers", "threads", "dtype", "attention", "warm"} <= set(serve)
    if env:
        assert serve["readers"] == 2 and serve["prefetch"] is True
    # the same options given, the same keywords
    more = ["--workers", "1", "--threads", "1", "--dtype", "float32", "--attention", "pytorch"]
    chat = _recorded(monkeypatch, ["chat", str(path), "--prompt", "hi", "--json", *common, *more], capsys)
    serve = _recorded(monkeypatch, ["serve", str(path), "--port", "0", *common, *more], capsys)
    chat.pop("trace", None), chat.pop("kernels", None)
    assert chat == serve and serve["threads"] == 1 and serve["attention"] == "pytorch"


def test_the_decode_loops_context_is_the_same_default():
    from zipmoe_cli.chat import chat
    from zipmoe_cli.serve import serve

    def default(fn, name):
        return inspect.signature(fn).parameters[name].default.default

    assert default(chat, "context") == default(serve, "context") == 4096


def test_the_servers_context_is_its_loops(tmp_path_factory):
    """A model whose limit is above --context: the server advertises and enforces the loop's
    length, so that a lone request never leaves chat's decode loop for another path."""
    import time

    from zipmoe.runtime.engine.loader import requirements
    from zipmoe.runtime.server.app import ServeConfig, ServerState

    _, path = container(tmp_path_factory, "mixtral")
    req = requirements(path, workers=1)
    cfg = ServeConfig(file=path, load_args=dict(budget=req["budget_for"](1.0), device="cpu", workers=1, threads=1),
                      context=40)
    state = ServerState(cfg)
    state.start()
    try:
        t = time.time()
        while not state.ready and state.load_error is None and time.time() - t < 120:
            time.sleep(0.05)
        assert state.ready, state.load_error
        assert state.stepper.loop.context == 40 and state.context == 40
        assert state.stepper.loop.growing  # the KV cache chat's loop has: sized to the conversation
        assert state.stepper.fits_loop(state.context)
    finally:
        state.stop()
