"""benchmarks/step_fit.py: the line through the runs' mean step against their missed tensors."""

from __future__ import annotations

import pytest


def test_the_line_recovers_a_known_step_and_miss_cost(bench_script):
    fit = bench_script("step_fit")
    runs = [{"misses_per_step": m, "mean_step_s": 0.09 + 0.003 * m, "tensors_per_expert": 2} for m in (80, 55, 38)]
    f = fit.line(runs)
    assert f["intercept_s"] == pytest.approx(0.09) and f["per_miss_tensor_s"] == pytest.approx(0.003)
    assert f["per_miss_expert_s"] == pytest.approx(0.006)
    assert fit.line(runs[:1]) is None  # one budget: no spread to fit
