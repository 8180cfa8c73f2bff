"""The scheduler's cost model: the list schedule stays within (3 - 1/L) of the lower bound."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zipmoe.runtime.plan.simulate import (
    STATES,
    Costs,
    Task,
    durations,
    layer_tasks,
    lower_bound,
    makespan_for_counts,
    order,
    schedule,
    simulate,
)

COSTS = Costs(disk_bw=1e9, disk_latency=1e-4, decomp_bw_per_worker=2e9, merge_bw=4e9, compute_s_per_expert=1e-3)

costs_st = st.builds(
    Costs,
    disk_bw=st.floats(1e5, 1e10),
    disk_latency=st.one_of(st.just(0.0), st.floats(1e-6, 1e-2)),
    decomp_bw_per_worker=st.floats(1e5, 1e10),
    merge_bw=st.floats(1e5, 1e10),
    compute_s_per_expert=st.one_of(st.just(0.0), st.floats(1e-6, 1e-1)),
    decomp_overhead_s=st.one_of(st.just(0.0), st.floats(0, 1e-3)),
    merge_overhead_s=st.one_of(st.just(0.0), st.floats(0, 1e-3)),
    merge_on_workers=st.booleans(),
)


@st.composite
def layer_instance(draw):
    """What the runtime meets: k chosen experts in random states, one tensor layout per layer."""
    k = draw(st.integers(1, 10))
    states = draw(st.lists(st.sampled_from(STATES), min_size=k, max_size=k))
    counts = {s: states.count(s) for s in STATES}
    tensors = []
    for _ in range(draw(st.integers(1, 3))):
        numel = draw(st.integers(1, 1 << 22))
        ratio = draw(st.floats(0.05, 1.0))
        tensors.append((2 * numel, int(numel * ratio), numel, draw(st.integers(1, 8))))  # chunks as stored
    return layer_tasks(counts, tensors), draw(st.integers(1, 8)), draw(costs_st)


@st.composite
def any_instance(draw):
    """Arbitrary tensors: sizes unrelated to each other, experts grouped at random."""
    n = draw(st.integers(1, 12))
    tasks = [
        Task(
            draw(st.sampled_from(STATES)),
            draw(st.integers(0, 1 << 22)),
            draw(st.integers(0, 1 << 22)),
            draw(st.integers(0, 1 << 22)),
            expert=draw(st.one_of(st.none(), st.integers(0, 3))),
        )
        for _ in range(n)
    ]
    return tasks, draw(st.integers(1, 8)), draw(costs_st)


def _check_feasible(tasks, L, costs, s):
    """The simulated schedule respects every precedence and resource constraint."""
    eps = 1e-12
    reads = sorted(r for r in s.read if r is not None)
    for a, b in zip(reads, reads[1:]):
        assert b[0] >= a[1] - eps  # one I/O channel
    merges = [] if costs.merge_on_workers else [m for m in s.merge if m is not None]
    dev = sorted(merges + list(s.compute.values()))
    for a, b in zip(dev, dev[1:]):
        assert b[0] >= a[1] - eps  # one device, serial
    by_worker = {}
    for d in s.jobs:  # every decompression job: one worker runs one at a time
        by_worker.setdefault(d[2], []).append(d)
    assert len(by_worker) <= L
    for ds in by_worker.values():
        ds.sort()
        for a, b in zip(ds, ds[1:]):
            assert b[0] >= a[1] - eps
    for i, t in enumerate(tasks):
        r, d, m = s.read[i], s.decomp[i], s.merge[i]
        if t.state == "full":
            assert r is None and d is None and m is None
            continue
        assert d is not None and m is not None
        assert m[0] >= d[1] - eps
        if t.state in ("none", "sm_only", "e_only"):  # the runtime decompresses after the read
            assert d[0] >= r[1] - eps
        if t.state == "e_only":
            assert m[0] >= r[1] - eps
            if costs.merge_on_workers:  # one worker job: decompress+merge after the SM read
                assert d[0] >= r[1] - eps and m[0] == d[1]
        if t.state == "compressed":
            assert r is None
    for i, t in enumerate(tasks):
        g = ("__task__", i) if t.expert is None else ("__expert__", t.expert)
        if s.merge[i] is not None:
            assert s.compute[g][0] >= s.merge[i][1] - eps
    assert math.isclose(s.makespan, max([0.0] + [x[1] for x in reads] + [x[1] for x in dev] + [d[1] for d in s.decomp if d]), rel_tol=1e-12, abs_tol=1e-15)


@settings(max_examples=400, deadline=None)
@given(layer_instance())
def test_makespan_within_3_minus_1_over_L_of_lower_bound(inst):
    tasks, L, costs = inst
    s = schedule(tasks, L, costs)
    lb = lower_bound(tasks, L, costs)
    _check_feasible(tasks, L, costs, s)
    assert s.makespan >= lb * (1 - 1e-9)
    assert s.makespan <= (3 - 1 / L) * lb * (1 + 1e-9)


@settings(max_examples=300, deadline=None)
@given(any_instance())
def test_arbitrary_instances_feasible_and_within_proved_bound(inst):
    # For arbitrary, unrelated tensor sizes the list order is only proved within (4 - 1/L):
    # a Type-II read with a short read and a long tail can wait behind every Type-I read
    # (e.g. L=1 gives 2.05x; see docs/planner.md). Layer instances stay within (3 - 1/L).
    tasks, L, costs = inst
    s = schedule(tasks, L, costs)
    lb = lower_bound(tasks, L, costs)
    _check_feasible(tasks, L, costs, s)
    assert lb * (1 - 1e-9) <= s.makespan <= (4 - 1 / L) * lb * (1 + 1e-9)


def test_order_type_one_reads_first_type_two_fills_workers():
    tasks = layer_tasks({"compressed": 1, "sm_only": 1, "e_only": 1, "none": 1, "full": 1}, [(2000, 300, 1000)])
    states = [tasks[i].state for i in order(tasks)]
    assert states == ["none", "e_only", "sm_only", "compressed", "full"]
    s = schedule(tasks, 2, COSTS)
    first_read = min((r for r in s.read if r), key=lambda r: r[0])
    assert tasks[s.read.index(first_read)].state == "none"
    # at t=0 only the compressed decompression needs no read (the runtime decompresses an
    # e_only tensor once its SM bytes are in)
    started = sorted(tasks[i].state for i, d in enumerate(s.decomp) if d and d[0] == 0.0)
    assert started == ["compressed"]


def test_simple_cases_exact():
    c = Costs(disk_bw=1e6, disk_latency=0.0, decomp_bw_per_worker=1e6, merge_bw=1e6, compute_s_per_expert=0.5)
    assert simulate([], 2, c) == 0.0
    assert simulate([Task("full", 10**6, 0)], 1, c) == pytest.approx(0.5)
    # none: read 1.5 MB (1.5 s) -> decompress 2 MB (2 s) -> merge (2 s) -> compute 0.5 s
    t = Task("none", 2 * 10**6, 5 * 10**5)
    assert durations(t, c) == pytest.approx((1.5, 2.0, 2.0))
    assert simulate([t], 1, c) == pytest.approx(6.0)
    assert lower_bound([t], 1, c) == pytest.approx(6.0)
    # e_only: SM read (1 s), then the decompression (2 s), merge (2 s), compute
    assert simulate([Task("e_only", 2 * 10**6, 5 * 10**5)], 1, c) == pytest.approx(5.5)
    # two compressed tensors of one expert on two workers: decompress in parallel, merge serially
    two = [Task("compressed", 2 * 10**6, 0, expert=0), Task("compressed", 2 * 10**6, 0, expert=0)]
    assert simulate(two, 2, c) == pytest.approx(2 + 2 + 2 + 0.5)
    assert simulate(two, 1, c) == pytest.approx(2 + 2 + 2 + 0.5)  # second decomp hides under first merge


def test_decompression_split_in_chunks_as_the_runtime_splits_it():
    c = Costs(disk_bw=1e6, disk_latency=0.0, decomp_bw_per_worker=1e6, merge_bw=1e6, compute_s_per_expert=0.5)
    t = Task("none", 2 * 10**6, 5 * 10**5, chunks=4)
    # four workers share the 2 s of decompression: 1.5 s read, 0.5 s decode, 2 s merge, 0.5 s compute
    s = schedule([t], 4, c)
    assert s.makespan == pytest.approx(4.5) and len(s.jobs) == 4 and {j[2] for j in s.jobs} == {0, 1, 2, 3}
    assert lower_bound([t], 4, c) == pytest.approx(4.5)
    assert simulate([t], 2, c) == pytest.approx(1.5 + 1 + 2 + 0.5)  # two jobs each on two workers
    assert simulate([t], 1, c) == pytest.approx(6.0)  # one worker: the runtime does not split
    # the miss's decode latency after its read drops with more workers; a compressed hit's too
    tensors = [(2 << 20, 300 << 10, 1 << 20, 3)] * 2
    for state in ("none", "e_only", "compressed"):
        times = [makespan_for_counts({state: 1}, tensors, L, COSTS) for L in (1, 2, 4)]
        assert times[0] > times[1] > times[2]
    with pytest.raises(ValueError):
        Task("none", 1, 1, chunks=0)


def test_more_workers_never_hurt_layer_instances():
    tensors = [(2 << 20, 300 << 10, 1 << 20)] * 3
    counts = {"compressed": 4, "none": 2, "sm_only": 2}
    times = [makespan_for_counts(counts, tensors, L, COSTS) for L in (1, 2, 4, 8)]
    assert all(b <= a + 1e-12 for a, b in zip(times, times[1:]))


def test_bad_arguments():
    with pytest.raises(ValueError):
        Task("cached", 1, 1)
    with pytest.raises(ValueError):
        Costs(0, 0, 1, 1, 0)
    with pytest.raises(ValueError):
        simulate([Task("full", 1, 1)], 0, COSTS)


def test_merge_on_workers_models_the_cpu_runtime():
    c = Costs(disk_bw=1e6, disk_latency=0.0, decomp_bw_per_worker=1e6, merge_bw=1e6, compute_s_per_expert=0.5,
              merge_on_workers=True)
    # e_only: the worker job (decompress 2 s + merge 2 s) starts after the SM read (1 s)
    assert simulate([Task("e_only", 2 * 10**6, 5 * 10**5)], 1, c) == pytest.approx(1 + 4 + 0.5)
    # two compressed experts on two workers: both jobs in parallel, computes serial on the device
    two = [Task("compressed", 2 * 10**6, 0, expert=0), Task("compressed", 2 * 10**6, 0, expert=1)]
    assert simulate(two, 2, c) == pytest.approx(4 + 0.5 + 0.5)
    assert lower_bound(two, 2, c) == pytest.approx(5.0)  # tight: the device waits 4 s for the first job


@settings(max_examples=150, deadline=None)
@given(layer_instance(), st.integers(1, 4))
def test_window_bounds_experts_in_flight(inst, window):
    tasks, L, costs = inst
    s = schedule(tasks, L, costs, window)
    _check_feasible(tasks, L, costs, s)
    assert s.makespan >= lower_bound(tasks, L, costs) * (1 - 1e-9)
    # an expert is in flight from its first op to the end of its compute
    spans = {}
    for i, t in enumerate(tasks):
        if t.state == "full":
            continue
        starts = [x[0] for x in (s.read[i], s.decomp[i], s.merge[i]) if x is not None]
        g = ("__expert__", t.expert)
        a = min(starts)
        spans[g] = (min(a, spans.get(g, (a, 0))[0]), s.compute[g][1])
    for a, _ in spans.values():
        live = sum(1 for b, e in spans.values() if b <= a < e)
        assert live <= window
    assert schedule(tasks, L, costs, 10**6).makespan == pytest.approx(s.makespan if window >= len(spans) else schedule(tasks, L, costs).makespan)
