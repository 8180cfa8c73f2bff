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


def test_the_host_counter_taken_apart_adds_up_and_a_tree_without_the_split_says_so(bench_script):
    pf = bench_script("profile_fetch")
    d = {"hits": {"full": 4, "none": 10}, "time_s": {"host": 0.004, "admit": 0.001, "wait": 0.0, "compute": 0.0},
         "layer_makespan_s": {"0": [0.01, 2, 0.006]},
         "host_parts": {"lookup": 0.0002, "issue": 0.001, "report": 0.0003, "to_device": 0.0001, "release": 0.0004}}
    m = pf.per_tensor(d)
    assert m["host:issue"] == pytest.approx(100.0) and m["host_counter"] == pytest.approx(400.0)
    text = pf.parts_table({"after": m, "before": {"host_counter": 380.0}})
    after = next(line for line in text.splitlines() if line.startswith("after"))
    # lookup 20, issue 100, report 30, to_device 10, release 40, admit 100: 300 of 400 -> other 100
    assert after.split()[-2:] == ["100.0", "400.0"]
    assert "(no split in this tree)" in text
    assert pf.parts_table({"before": {"host_counter": 380.0}}) == ""
