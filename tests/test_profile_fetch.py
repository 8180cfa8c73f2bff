"""benchmarks/profile_fetch.py's options: the before/after order by round, the served pass's pools."""

from __future__ import annotations

import pytest


def test_each_side_runs_second_in_every_other_round(bench_script):
    pf = bench_script("profile_fetch")
    orders = [pf.rounds_order(r) for r in range(4)]
    assert all(sorted(o) == ["after", "before"] for o in orders)
    seconds = [o[1] for o in orders]
    assert seconds.count("before") == seconds.count("after") == 2


def test_served_pools_a_fraction_or_a_mix_and_one_line_for_a_pool_that_is_not_one(bench_script):
    pf = bench_script("profile_fetch")
    assert pf.served_pools("0.3") == {"full": 0.3, "compressed": 0.0, "sm_only": 0.0, "e_only": 0.0}
    assert pf.served_pools("full=0.1,sm_only=0.1,e_only=0.4")["e_only"] == 0.4
    with pytest.raises(SystemExit, match="unknown pool 'fulll'"):
        pf.served_pools("fulll=0.1")
