"""How busy the rest of the machine was while a profile was measured.

A profile's costs are what this machine's disk, cores and device did while it was measured. When
other processes kept cores busy (tests, a build, another model), decompression and the serving
thread ran slower than they will later, and every plan is predicted too slow: on the CPU box a
profile measured beside the test suite predicted every plan 1.26-1.49x off (docs/benchmarks.md
§22o). Nothing in the costs themselves shows it, so the profile records the other processes' CPU
time over its measurement, and ``zipmoe plan`` and the default plan's line say so when it was
high.

Other processes' CPU = the machine's busy CPU time (user, nice, system, irq, softirq and steal:
a hypervisor's other guests count too) less this process's own (its threads and waited-for
children), over the wall time.
"""

from __future__ import annotations

import time

#: the share of the cores other processes may keep busy before a profile is flagged, and the
#: least absolute load flagged (one busy core of two is flagged; a laptop's background is not)
BUSY_SHARE = 0.25
BUSY_MIN_CORES = 0.5

__all__ = ["OtherLoad", "busy_warning", "BUSY_SHARE", "BUSY_MIN_CORES"]


def _machine_busy_s() -> float:
    import psutil

    t = psutil.cpu_times()
    # guest time is already in user on Linux; idle and iowait are not busy
    return sum(float(getattr(t, k, 0.0)) for k in ("user", "nice", "system", "irq", "softirq", "steal"))


def _own_s() -> float:
    import psutil

    t = psutil.Process().cpu_times()
    return float(t.user + t.system + getattr(t, "children_user", 0.0) + getattr(t, "children_system", 0.0))


class OtherLoad:
    """A stopwatch of other processes' CPU use: ``with OtherLoad() as ol: ...``, then ``ol.result``
    (``{"others_cores", "cores", "wall_s"}``, or ``{"error": ...}`` where psutil cannot tell)."""

    def __init__(self) -> None:
        self.result: dict | None = None
        self._t0 = self._busy0 = self._own0 = None

    def __enter__(self) -> "OtherLoad":
        try:
            self._busy0, self._own0 = _machine_busy_s(), _own_s()
        except Exception as exc:  # noqa: BLE001 - a platform without these counters
            self.result = {"error": f"{type(exc).__name__}: {exc}"}
        self._t0 = time.monotonic()
        return self

    def __exit__(self, *exc) -> None:
        if self.result is not None:
            return
        wall = time.monotonic() - self._t0
        try:
            import psutil

            busy, own = _machine_busy_s() - self._busy0, _own_s() - self._own0
            cores = psutil.cpu_count() or 1
        except Exception as exc:  # noqa: BLE001
            self.result = {"error": f"{type(exc).__name__}: {exc}"}
            return
        others = max(0.0, busy - own) / wall if wall > 0 else 0.0
        self.result = {"others_cores": round(min(others, float(cores)), 3), "cores": int(cores), "wall_s": round(wall, 3)}


def busy_warning(profile: dict) -> str | None:
    """One line when ``profile`` was measured while other processes kept the machine busy, else
    None (also for profiles measured before this was recorded)."""
    load = profile.get("load") or {}
    others, cores = load.get("others_cores"), load.get("cores")
    if others is None or not cores:
        return None
    if others < max(BUSY_MIN_CORES, BUSY_SHARE * cores):
        return None
    return (f"warning: the profile was measured while other processes kept {others:.1f} of {cores} cores busy; "
            "its costs are likely too high and so are the predictions: measure it again on a quiet machine "
            "(`zipmoe plan FILE --profile-only --remeasure`)")
