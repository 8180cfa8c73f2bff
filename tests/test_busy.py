"""The other processes' CPU use a profile records, and the warning it gives (runtime/plan/busy.py)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from zipmoe.runtime.plan import busy
from zipmoe.runtime.plan.busy import OtherLoad, busy_warning


def test_other_load_is_the_machines_busy_time_less_this_process_own(monkeypatch):
    machine, own, clock = iter([100.0, 103.0]), iter([10.0, 11.0]), iter([50.0, 52.0])
    monkeypatch.setattr(busy, "_machine_busy_s", lambda: next(machine))
    monkeypatch.setattr(busy, "_own_s", lambda: next(own))
    monkeypatch.setattr(busy.time, "monotonic", lambda: next(clock))
    with OtherLoad() as ol:
        pass
    # 3 busy CPU-seconds over 2 s of wall time, 1 of them this process's own: 1 core of others
    assert ol.result["others_cores"] == pytest.approx(1.0) and ol.result["wall_s"] == pytest.approx(2.0)
    assert ol.result["cores"] >= 1


def test_other_load_is_never_negative_and_an_unreadable_counter_is_an_error_not_a_crash(monkeypatch):
    machine, own = iter([100.0, 100.5]), iter([10.0, 11.0])
    monkeypatch.setattr(busy, "_machine_busy_s", lambda: next(machine))
    monkeypatch.setattr(busy, "_own_s", lambda: next(own))
    with OtherLoad() as ol:
        pass
    assert ol.result["others_cores"] == 0.0

    def boom():
        raise OSError("no /proc")

    monkeypatch.setattr(busy, "_machine_busy_s", boom)
    with OtherLoad() as ol:
        pass
    assert "no /proc" in ol.result["error"] and busy_warning({"load": ol.result}) is None


def test_a_busy_process_beside_is_counted():
    """A real process spinning on one core while the stopwatch runs: at least half a core of
    others (the rest of the machine can only add)."""
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time() + 3\nwhile time.time() < t: pass"])
    try:
        time.sleep(0.3)  # let it start spinning
        with OtherLoad() as ol:
            time.sleep(1.5)
    finally:
        child.kill()
        child.wait()
    assert ol.result["others_cores"] >= 0.5, ol.result


@pytest.mark.parametrize("others,cores,flagged", [(0.2, 2, False), (0.6, 2, True), (1.9, 16, False), (4.5, 16, True),
                                                  (None, 2, False)])
def test_the_warning_names_the_load_above_a_quarter_of_the_cores(others, cores, flagged):
    line = busy_warning({"load": {"others_cores": others, "cores": cores}})
    assert (line is not None) == flagged
    if flagged:
        assert f"{others:.1f} of {cores} cores" in line and "--remeasure" in line
    assert busy_warning({}) is None  # a profile measured before the load was recorded
