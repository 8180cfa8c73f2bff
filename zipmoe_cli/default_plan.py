"""The plan a serving command uses without ``--plan`` (runtime/plan/default.py), and keeping the
run's activation statistics for the next one."""

from __future__ import annotations

from pathlib import Path

from zipmoe_cli.env import cache_dir


def resolve(file: Path, plan, budget_bytes: int, device: str, workers: int, engine_options: dict,
            dtype: str = "bfloat16", say=None):
    """``plan`` as given, or the default plan fitted at load (its one line passed to ``say``)."""
    if plan is not None:
        return plan
    from zipmoe.machine import resolve_device
    from zipmoe.runtime.plan.default import default_plan

    readers = engine_options.get("readers")
    fitted, line = default_plan(file, budget_bytes, resolve_device(device), workers, cache_dir(),
                                readers=readers, dtype=dtype or "bfloat16")
    if say is not None and line:
        for part in line.splitlines():
            say(part)
    return fitted


def keep_usage(rt) -> None:
    """Add what this run's router chose to the container's kept statistics (best effort)."""
    from zipmoe.runtime.plan.default import record_usage

    try:
        snap = rt.counters.snapshot()
        layers = max(1, len(rt.sparse_layers))
        record_usage(cache_dir(), rt.container_id, snap.get("uses") or {}, snap.get("layer_calls", 0) // layers,
                     routing=list(rt.counters.recent_calls))
    except Exception:  # noqa: BLE001 - statistics never fail a run
        pass
