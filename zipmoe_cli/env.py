"""The one place the command line reads the environment for what it runs.

Nothing below the command line reads an environment variable of zipmoe's: the engine, the
planner and the bench harness take arguments (``zipmoe.load(readers=..., prefetch=...,
force=...)``, ``get_profile(cache_dir=...)``, ``BenchConfig(deepspeed_offload=...)``), and the
commands read the variables here and pass them down. docs/architecture.md, "Environment
variables (read by the command line only)", lists every one.

Torch-free (``zipmoe --help`` imports no torch). Each function takes the environment as an
argument (default ``os.environ``), so that a test can hand it a dict.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from zipmoe.errors import UsageError

__all__ = ["engine_env", "load_options", "cache_dir", "deepspeed_env", "deepspeed_libaio_env", "READERS", "PREFETCH", "FORCE", "CACHE_DIR",
           "DEEPSPEED_OFFLOAD", "DEEPSPEED_BUILD_TIMEOUT", "DEEPSPEED_LOAD_IN_BUDGET", "DEEPSPEED_LIBAIO", "moe_infinity_site_env",
           "MOE_INFINITY_SITE", "llama_cpp_source_env", "LLAMA_CPP_SOURCE"]

READERS = "ZIPMOE_READERS"
PREFETCH = "ZIPMOE_PREFETCH"
FORCE = "ZIPMOE_FORCE"
CACHE_DIR = "ZIPMOE_CACHE_DIR"
DEEPSPEED_OFFLOAD = "ZIPMOE_BENCH_DEEPSPEED_OFFLOAD"
DEEPSPEED_BUILD_TIMEOUT = "ZIPMOE_BENCH_DEEPSPEED_BUILD_TIMEOUT"
DEEPSPEED_LOAD_IN_BUDGET = "ZIPMOE_BENCH_DEEPSPEED_LOAD_IN_BUDGET"
DEEPSPEED_LIBAIO = "ZIPMOE_BENCH_DEEPSPEED_LIBAIO"
MOE_INFINITY_SITE = "ZIPMOE_BENCH_MOE_INFINITY_SITE"
LLAMA_CPP_SOURCE = "ZIPMOE_BENCH_LLAMA_CPP_SOURCE"


def _get(environ: Mapping[str, str] | None, name: str) -> str:
    return (os.environ if environ is None else environ).get(name, "").strip()


def _whole(environ, name: str) -> int | None:
    v = _get(environ, name)
    if not v:
        return None
    if not v.isdigit() or int(v) < 1:
        raise UsageError(f"{name}={v!r}: expected a whole number of at least 1")
    return int(v)


def _switch(environ, name: str) -> bool | None:
    v = _get(environ, name)
    if not v:
        return None
    if v not in ("0", "1"):
        raise UsageError(f"{name}={v!r}: expected 0 or 1")
    return v == "1"


def engine_env(environ: Mapping[str, str] | None = None) -> dict:
    """The engine settings the environment overrides, as keyword arguments of ``zipmoe.load``:
    ``readers`` from ``ZIPMOE_READERS`` (a whole number of at least 1), ``prefetch`` from
    ``ZIPMOE_PREFETCH`` (0 or 1), ``force`` from ``ZIPMOE_FORCE`` (0 or 1). Only the variables
    that are set (and not empty) appear; a wrong value is a :class:`UsageError`."""
    out: dict = {}
    readers = _whole(environ, READERS)
    if readers is not None:
        out["readers"] = readers
    for key, name in (("prefetch", PREFETCH), ("force", FORCE)):
        v = _switch(environ, name)
        if v is not None:
            out[key] = v
    return out


def load_options(force: bool = False, environ: Mapping[str, str] | None = None) -> dict:
    """:func:`engine_env` with a command's ``--force`` on top (``--force`` wins over ``ZIPMOE_FORCE=0``)."""
    out = engine_env(environ)
    if force:
        out["force"] = True
    return out


def cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """zipmoe's cache folder (the planner's hardware profiles): ``ZIPMOE_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/zipmoe``, else ``~/.cache/zipmoe``."""
    explicit = _get(environ, CACHE_DIR)
    if explicit:
        return Path(explicit).expanduser()
    base = _get(environ, "XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "zipmoe"


def deepspeed_env(environ: Mapping[str, str] | None = None) -> dict:
    """`zipmoe bench`'s deepspeed baseline as the environment sets it (its options win):
    ``offload`` from ``ZIPMOE_BENCH_DEEPSPEED_OFFLOAD`` (``nvme``, ``cpu``; ``auto`` or unset:
    None), ``build_timeout_s`` from ``ZIPMOE_BENCH_DEEPSPEED_BUILD_TIMEOUT`` (seconds above 0, or
    None), ``load_in_budget`` from ``ZIPMOE_BENCH_DEEPSPEED_LOAD_IN_BUDGET`` (0 or 1, or None);
    its libaio: :func:`deepspeed_libaio_env`."""
    from zipmoe.runtime.bench.deepspeed_engine import check_offload  # torch-free

    offload = check_offload(_get(environ, DEEPSPEED_OFFLOAD) or None, f"{DEEPSPEED_OFFLOAD}=")
    timeout = _get(environ, DEEPSPEED_BUILD_TIMEOUT) or None
    if timeout is not None:
        try:
            seconds = float(timeout)
        except ValueError:
            seconds = float("nan")
        if not seconds > 0 or seconds == float("inf"):
            raise UsageError(f"{DEEPSPEED_BUILD_TIMEOUT}={timeout!r}: expected seconds, a number above 0")
        timeout = seconds
    return {"offload": offload, "build_timeout_s": timeout, "load_in_budget": _switch(environ, DEEPSPEED_LOAD_IN_BUDGET)}


def deepspeed_libaio_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The deepspeed baseline's libaio prefix from ``ZIPMOE_BENCH_DEEPSPEED_LIBAIO`` (a folder with
    include/libaio.h and lib/libaio.so, made absolute; None when unset or empty; ``--deepspeed-libaio``
    wins); a folder without them is one :class:`UsageError` line naming the variable."""
    from zipmoe.runtime.bench.deepspeed_engine import check_libaio  # torch-free

    return check_libaio(_get(environ, DEEPSPEED_LIBAIO) or None, f"{DEEPSPEED_LIBAIO}=")


def moe_infinity_site_env(environ: Mapping[str, str] | None = None) -> Path | None:
    """`zipmoe bench`'s moe-infinity folder from ``ZIPMOE_BENCH_MOE_INFINITY_SITE`` (None when unset
    or empty; ``--moe-infinity-site`` wins)."""
    value = _get(environ, MOE_INFINITY_SITE)
    return Path(value).expanduser() if value else None


def llama_cpp_source_env(environ: Mapping[str, str] | None = None) -> Path | None:
    """`zipmoe bench`'s folder with llama.cpp's converter from ``ZIPMOE_BENCH_LLAMA_CPP_SOURCE``
    (None when unset or empty; ``--llama-cpp-source`` wins)."""
    value = _get(environ, LLAMA_CPP_SOURCE)
    return Path(value).expanduser() if value else None
