"""The memory limit the process runs under, checked at load against what serving will need.

A demo chat at ``--budget 280M`` inside a 0.8 GB cgroup ran at 100 s per token: the budget
bounds the weights, but the process also needs its interpreter, torch and transformers (its
*baseline*) and the KV cache; under a limit below that sum the kernel reclaims the process's own
code pages and every token faults them back in. So at load, :func:`check` finds the tightest
limit that applies (:func:`limits`):

* cgroup v2: ``memory.max`` of the process's cgroup and of every ancestor (``/proc/self/cgroup``
  line ``0::/path``, under the cgroup2 mount, ``/sys/fs/cgroup``);
* cgroup v1: ``memory.limit_in_bytes`` of the memory controller's cgroup (line
  ``N:memory:/path`` or ``N:...,memory,...:/path``, under ``/sys/fs/cgroup/memory``);
* ``RLIMIT_AS`` (compared with the address space: the process's ``VmSize`` + what serving adds)
  and ``RLIMIT_DATA`` (with ``VmData`` + what serving adds);

and refuses in one line, with the figures, when the limit is below baseline + budget + KV cache
(``BudgetError``; ``--force`` on chat and plan, ``zipmoe.load(force=True)``, proceeds). The
baseline is measured, not guessed: the process's resident memory (``VmRSS``) when the check runs,
just before the weights are loaded. The KV cache is estimated for ``kv_tokens`` tokens (default
:data:`DEFAULT_KV_TOKENS`) at batch 1 from the config (:mod:`.kvsize`: layers × keys and values
per position × the dtype's bytes).
"""

from __future__ import annotations

from pathlib import Path

from zipmoe.errors import BudgetError
from zipmoe.runtime.engine.kvsize import kv_cache_bytes as _kv_bytes
from zipmoe.units import format_size

__all__ = ["limits", "check", "process_memory", "kv_cache_bytes", "DEFAULT_KV_TOKENS"]

DEFAULT_KV_TOKENS = 4096
_UNLIMITED = 1 << 60


def _read_int(p: Path) -> int | None:
    try:
        text = p.read_text().strip()
    except OSError:
        return None
    if text in ("max", "") or not text.lstrip("-").isdigit():
        return None
    v = int(text)
    return v if 0 < v < _UNLIMITED else None  # v1 reports "no limit" as a huge number


def limits(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> list[tuple[int, str, str]]:
    """``[(bytes, kind, where)]`` of every memory limit that applies: ``kind`` is ``cgroup``,
    ``RLIMIT_AS`` or ``RLIMIT_DATA``. ``proc_cgroup`` and ``root`` can point elsewhere (tests)."""
    out = []
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        lines = []
    rootp = Path(root)
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, ctrls, rel = parts
        rel = rel.lstrip("/")
        if hid == "0" and ctrls == "":  # v2: the cgroup and its ancestors
            p = rootp / rel if rel else rootp
            while True:
                v = _read_int(p / "memory.max")
                if v is not None:
                    out.append((v, "cgroup", str(p / "memory.max")))
                if p == rootp or rootp not in p.parents:
                    break
                p = p.parent
        elif "memory" in ctrls.split(","):  # v1
            for base in (rootp / "memory", rootp / ctrls):
                f = base / rel / "memory.limit_in_bytes"
                v = _read_int(f)
                if v is not None:
                    out.append((v, "cgroup", str(f)))
                    break
    try:
        import resource

        for name in ("RLIMIT_AS", "RLIMIT_DATA"):
            soft, _hard = resource.getrlimit(getattr(resource, name))
            if soft != resource.RLIM_INFINITY and 0 < soft < _UNLIMITED:
                out.append((int(soft), name, "setrlimit"))
    except (ImportError, AttributeError, OSError, ValueError):
        pass
    return out


def process_memory(status: str = "/proc/self/status") -> dict:
    """``{"rss", "size", "data"}`` in bytes from ``/proc/self/status`` (VmRSS, VmSize, VmData; 0 when absent)."""
    out = {"rss": 0, "size": 0, "data": 0}
    keys = {"VmRSS:": "rss", "VmSize:": "size", "VmData:": "data"}
    try:
        for line in Path(status).read_text().splitlines():
            f = line.split()
            if f and f[0] in keys and len(f) >= 2 and f[1].isdigit():
                out[keys[f[0]]] = int(f[1]) * 1024
    except OSError:
        pass
    return out


def kv_cache_bytes(cfg: dict, itemsize: int, tokens: int = DEFAULT_KV_TOKENS) -> int:
    """Keys and values of ``tokens`` tokens at batch 1, from a config.json dict (the arithmetic is
    :func:`zipmoe.runtime.engine.kvsize.kv_cache_bytes`'s; not clamped to the model's limit)."""
    return _kv_bytes(cfg, context=int(tokens), itemsize=int(itemsize), clamp=False)


def check(budget: int, kv_bytes: int, *, force: bool = False, proc_cgroup: str = "/proc/self/cgroup",
          root: str = "/sys/fs/cgroup", status: str = "/proc/self/status", kv_tokens: int = DEFAULT_KV_TOKENS) -> dict:
    """Refuse (BudgetError, one line) when a memory limit is below what serving needs; returns
    the figures (``{"limit", "kind", "where", "baseline", "need"}``, ``limit`` None when none
    applies). ``force``: only return the figures."""
    mem = process_memory(status)
    worst = None
    for limit, kind, where in limits(proc_cgroup, root):
        base = {"RLIMIT_AS": mem["size"], "RLIMIT_DATA": mem["data"]}.get(kind, mem["rss"])
        need = base + int(budget) + int(kv_bytes)
        short = need - limit
        if worst is None or short > worst[0]:
            worst = (short, limit, kind, where, base, need)
    if worst is None:
        return {"limit": None, "baseline": mem["rss"], "need": mem["rss"] + int(budget) + int(kv_bytes)}
    short, limit, kind, where, base, need = worst
    figures = {"limit": limit, "kind": kind, "where": where, "baseline": base, "need": need}
    if short > 0 and not force:
        what = "address space" if kind == "RLIMIT_AS" else "memory"
        room = limit - base - int(kv_bytes)
        hint = f"lower --budget to at most {format_size(room)}, " if room > 0 else ""
        raise BudgetError(
            f"this process may use {format_size(limit)} of {what} ({kind} {where}), but serving needs about "
            f"{format_size(need)}: {format_size(base)} already in use + budget {format_size(int(budget))} + KV cache "
            f"{format_size(int(kv_bytes))} ({kv_tokens} tokens); {hint}raise the limit, or pass --force to run anyway"
        )
    return figures
