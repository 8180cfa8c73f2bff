"""The environment is read by the command line only (zipmoe_cli/env.py), and passed down.

Unit tests of ``engine_env``/``load_options``/``cache_dir``/``deepspeed_env``; chat and serve
turning the variables (and ``--force``) into ``zipmoe.load`` keywords, with one line for a wrong
value; docs/architecture.md's table naming every variable the command line reads (that no
module below the command line reads one is tests/test_engine_settings.py's).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from test_cli_pack import assert_one_line_error, run
from zipmoe.errors import UsageError
from zipmoe_cli.env import cache_dir, deepspeed_env, engine_env, load_options

ROOT = Path(__file__).resolve().parents[1]


def test_engine_env_reads_readers_prefetch_and_force():
    assert engine_env({}) == {}
    assert engine_env({"ZIPMOE_READERS": "", "ZIPMOE_PREFETCH": " ", "OTHER": "1"}) == {}
    assert engine_env({"ZIPMOE_READERS": "3", "ZIPMOE_PREFETCH": "0", "ZIPMOE_FORCE": "1"}) == \
        {"readers": 3, "prefetch": False, "force": True}
    assert engine_env({"ZIPMOE_READERS": " 8 ", "ZIPMOE_PREFETCH": "1"}) == {"readers": 8, "prefetch": True}
    for v in ("x", "0", "-1", "1.5", "2e3"):
        with pytest.raises(UsageError, match=re.escape(f"ZIPMOE_READERS={v!r}: expected a whole number of at least 1")):
            engine_env({"ZIPMOE_READERS": v})
    for name in ("ZIPMOE_PREFETCH", "ZIPMOE_FORCE"):
        for v in ("yes", "true", "2"):
            with pytest.raises(UsageError, match=re.escape(f"{name}={v!r}: expected 0 or 1")):
                engine_env({name: v})


def test_engine_env_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("ZIPMOE_READERS", "5")
    monkeypatch.delenv("ZIPMOE_PREFETCH", raising=False)
    monkeypatch.delenv("ZIPMOE_FORCE", raising=False)
    assert engine_env() == {"readers": 5}


def test_force_option_on_top_of_the_environment():
    assert load_options(False, {}) == {}
    assert load_options(True, {}) == {"force": True}
    assert load_options(True, {"ZIPMOE_FORCE": "0", "ZIPMOE_READERS": "2"}) == {"force": True, "readers": 2}
    assert load_options(False, {"ZIPMOE_FORCE": "0"}) == {"force": False}


def test_cache_dir_rule(tmp_path):
    assert cache_dir({"ZIPMOE_CACHE_DIR": str(tmp_path / "z"), "XDG_CACHE_HOME": "/x"}) == tmp_path / "z"
    assert cache_dir({"XDG_CACHE_HOME": str(tmp_path / "x")}) == tmp_path / "x" / "zipmoe"
    assert cache_dir({"ZIPMOE_CACHE_DIR": ""}) == Path(os.path.expanduser("~")) / ".cache" / "zipmoe"


def test_deepspeed_env():
    assert deepspeed_env({}) == {"offload": None, "build_timeout_s": None, "load_in_budget": None}
    assert deepspeed_env({"ZIPMOE_BENCH_DEEPSPEED_OFFLOAD": "auto"})["offload"] is None
    got = deepspeed_env({"ZIPMOE_BENCH_DEEPSPEED_OFFLOAD": "cpu", "ZIPMOE_BENCH_DEEPSPEED_BUILD_TIMEOUT": "90.5",
                         "ZIPMOE_BENCH_DEEPSPEED_LOAD_IN_BUDGET": "1"})
    assert got == {"offload": "cpu", "build_timeout_s": 90.5, "load_in_budget": True}
    with pytest.raises(UsageError, match=re.escape("ZIPMOE_BENCH_DEEPSPEED_OFFLOAD='disk': use nvme or cpu")):
        deepspeed_env({"ZIPMOE_BENCH_DEEPSPEED_OFFLOAD": "disk"})
    for v in ("soon", "0", "-5", "inf", "nan"):
        with pytest.raises(UsageError, match="ZIPMOE_BENCH_DEEPSPEED_BUILD_TIMEOUT=.*expected seconds"):
            deepspeed_env({"ZIPMOE_BENCH_DEEPSPEED_BUILD_TIMEOUT": v})
    with pytest.raises(UsageError, match="ZIPMOE_BENCH_DEEPSPEED_LOAD_IN_BUDGET='yes': expected 0 or 1"):
        deepspeed_env({"ZIPMOE_BENCH_DEEPSPEED_LOAD_IN_BUDGET": "yes"})


class _Stop(UsageError):
    pass


def test_chat_passes_the_environment_and_force_to_load(monkeypatch, capsys, tmp_path):
    """chat: ZIPMOE_READERS / ZIPMOE_PREFETCH / --force become load() keywords; nothing is
    written into os.environ for the loader."""
    from zipmoe.runtime.engine import loader

    seen = []

    def fake_load(path, **kw):
        seen.append(kw)
        raise _Stop("stopped before loading")

    monkeypatch.setattr(loader, "load", fake_load)
    monkeypatch.delenv("ZIPMOE_FORCE", raising=False)
    monkeypatch.setenv("ZIPMOE_READERS", "3")
    monkeypatch.setenv("ZIPMOE_PREFETCH", "1")
    args = ["chat", tmp_path / "x.zmoe", "--prompt", "hi", "--json", "--workers", "1", "--threads", "1"]
    code, _, err = run(capsys, *args, "--force")
    assert_one_line_error(code, err, "stopped before loading")
    assert seen[-1]["readers"] == 3 and seen[-1]["prefetch"] is True and seen[-1]["force"] is True
    assert "ZIPMOE_FORCE" not in os.environ
    monkeypatch.delenv("ZIPMOE_READERS")
    monkeypatch.delenv("ZIPMOE_PREFETCH")
    code, _, err = run(capsys, *args)
    assert_one_line_error(code, err, "stopped before loading")
    assert not {"readers", "prefetch", "force"} & set(seen[-1])
    n = len(seen)
    for var, value, needle in [("ZIPMOE_READERS", "x", "ZIPMOE_READERS='x': expected a whole number of at least 1"),
                               ("ZIPMOE_PREFETCH", "yes", "ZIPMOE_PREFETCH='yes': expected 0 or 1"),
                               ("ZIPMOE_FORCE", "on", "ZIPMOE_FORCE='on': expected 0 or 1")]:
        monkeypatch.setenv(var, value)
        code, _, err = run(capsys, *args)
        assert code == 2
        assert_one_line_error(code, err, needle)
        monkeypatch.delenv(var)
    assert len(seen) == n  # refused before loading


def test_serve_passes_the_environment_to_load(monkeypatch, capsys, tmp_path_factory):
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    pytest.importorskip("sse_starlette")
    pytest.importorskip("prometheus_client")
    from test_runtime_fixtures import container
    from zipmoe.runtime.server import app as server_app

    _, path = container(tmp_path_factory, "mixtral")
    seen = []

    def fake_state(cfg, **kw):
        seen.append(cfg)
        raise _Stop("stopped before serving")

    monkeypatch.setattr(server_app, "ServerState", fake_state)
    monkeypatch.setenv("ZIPMOE_READERS", "2")
    monkeypatch.setenv("ZIPMOE_PREFETCH", "0")
    monkeypatch.delenv("ZIPMOE_FORCE", raising=False)
    args = ["serve", path, "--port", "0", "--workers", "1", "--threads", "1"]
    code, _, err = run(capsys, *args)
    assert code == 2 and "stopped before serving" in err
    got = seen[-1].load_args  # zipmoe_cli/serving.py's, as chat's
    assert got["readers"] == 2 and got["prefetch"] is False and "force" not in got
    monkeypatch.setenv("ZIPMOE_READERS", "0")
    code, _, err = run(capsys, *args)
    assert_one_line_error(code, err, "ZIPMOE_READERS='0': expected a whole number of at least 1")
    assert len(seen) == 1


def _documented() -> set[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Environment variables (read by the command line only)", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `(ZIPMOE_[A-Z_]+)` \|", section, re.M))


def test_the_table_names_every_variable_the_command_line_reads():
    mentioned = set()
    for f in sorted((ROOT / "zipmoe_cli").glob("*.py")):
        mentioned |= set(re.findall(r"ZIPMOE_[A-Z][A-Z_]*[A-Z]", f.read_text()))
    assert mentioned, "the scan found nothing: the test would pass vacuously"
    assert mentioned <= _documented(), sorted(mentioned - _documented())
