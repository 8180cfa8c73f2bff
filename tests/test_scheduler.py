"""The runtime's layer scheduler against the cost model (runtime/plan/simulate.py).

The real :class:`Fetcher` (its reader and decode threads, priority queues, window and cache states) runs
random layer instances whose reads, decode jobs and expert computes are replaced by sleeps of
the durations the cost model gives. Its measured makespan must stay within (3 - 1/L) of the
model's lower bound on any schedule (plus a small allowance for thread wake-ups), and it must
issue reads in the model's priority order.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from zipmoe.runtime.plan import simulate as sm
from zipmoe.runtime.engine.cache import ExpertCache
from zipmoe.runtime.engine.counters import Counters
from zipmoe.runtime.engine.decoder import Decoder
from zipmoe.runtime.engine.device_side import DeviceSide
from zipmoe.runtime.engine.fetch import expert_type, issue_order
from zipmoe.runtime.engine.fetcher import Fetcher
from zipmoe.runtime.engine.reader import Reader
from zipmoe.runtime.engine.reads import ExpertStore, ReadBuffers
from zipmoe.runtime.engine.tensors import ExpertTensor, Segment


class _FakeWorking:
    """The working set's interface, counting what is held."""

    window = 1 << 30

    def __init__(self) -> None:
        self.held = 0
        self.recycled = 0

    def bytes_of(self, t, bufs=None) -> int:
        return t.full_bytes

    def hold(self, n):
        self.held += n

    def release(self, n):
        self.held -= n

    def recycle(self, bufs):
        self.recycled += len(bufs)


class _FakeRuntime:
    """What a fetcher is built from: tensors, a cache with room everywhere, counters, a working set."""

    def __init__(self, tensors: dict, workers: int) -> None:
        self.expert_tensors = tensors
        self.cache = ExpertCache({"full": 1 << 40, "compressed": 1 << 40, "sm_only": 1 << 40, "e_only": 1 << 40})
        self.counters = Counters()
        self.working = _FakeWorking()
        self.workers = workers
        self.store = type("Store", (), {"buffers": ReadBuffers(), "buffer_size": staticmethod(ExpertStore.buffer_size)})()

    @property
    def _held(self) -> int:
        return self.working.held


def _fetcher(rt: _FakeRuntime, workers: int) -> Fetcher:
    """A fetcher over the fake runtime's parts: one reader, ``workers`` decode threads, the CPU."""
    return Fetcher(expert_tensors=rt.expert_tensors, cache=rt.cache, counters=rt.counters, working=rt.working,
                   reader=Reader(rt.store, 1), decoder=Decoder(workers, rt.counters.add_time),
                   device=DeviceSide("cpu", torch.bfloat16, counters=rt.counters))


def _tensor(uid, layer, expert, name, numel, e_bytes):
    t = ExpertTensor(uid, layer, expert, name, (numel // 8, 8))
    t.segments.append(Segment(f"x.{expert}.{name}", 0, numel, [], None, (0, e_bytes), (0, numel)))
    return t


def _instance(rng: random.Random, L: int):
    n_exp = rng.randint(1, 8)
    tensors, states, tasks = {}, {}, []
    uid = 0
    for e in range(n_exp):
        ts, st = [], []
        state = rng.choice(sm.STATES)
        for name in ("gate_up", "down"):
            numel = rng.choice([1, 2, 3, 4]) * 1000 * 8
            e_bytes = numel // rng.choice([3, 4, 5])
            t = _tensor(uid, 0, e, name, numel, e_bytes)
            uid += 1
            ts.append(t)
            st.append(state)
            tasks.append(sm.Task(state, t.full_bytes, t.e_bytes, t.sm_bytes, expert=e))
        tensors[(0, e)] = ts
        states[e] = st
    return tensors, states, tasks


def _place(rt, tensors, states):
    for (layer, e), ts in tensors.items():
        for t, st in zip(ts, states[e]):
            if st == "full":
                rt.cache.put(t.uid, "full", t.full_bytes, torch.zeros(t.shape, dtype=torch.bfloat16))
            elif st == "compressed":
                rt.cache.put(t.uid, "compressed", t.stored_bytes, ([None], [None]))
            elif st == "sm_only":
                rt.cache.put(t.uid, "sm_only", t.sm_bytes, [None])
            elif st == "e_only":
                rt.cache.put(t.uid, "e_only", t.e_bytes, [None])


def _patch(sched: Fetcher, costs: sm.Costs, reads: list):
    lock = threading.Lock()

    def read(f, need_e, need_sm):
        t = f.tensor
        n = (t.e_bytes if need_e else 0) + (t.sm_bytes if need_sm else 0)
        with lock:
            reads.append(f.tensor.uid)
        time.sleep(costs.disk_latency + n / costs.disk_bw)
        f.e_parts = f.e_parts or [None]
        f.sm_parts = f.sm_parts or [None]

    def decode(f, verify_e, verify_sm):
        _, d, m = sm.durations(sm.Task("compressed", f.tensor.full_bytes, f.tensor.e_bytes), costs)
        time.sleep(d + m)

    sched.reader._read = read
    sched.decoder._decode = decode
    sched._admit = lambda fl: None


@pytest.mark.parametrize("seed", range(12))
def test_makespan_within_3_minus_1_over_L_of_the_lower_bound(seed):
    rng = random.Random(seed)
    L = rng.randint(1, 3)
    # durations of a few to a few tens of milliseconds
    costs = sm.Costs(disk_bw=4e6, disk_latency=0.002, decomp_bw_per_worker=8e6, merge_bw=3e7,
                     compute_s_per_expert=rng.choice([0.001, 0.005, 0.01]), merge_on_workers=True)
    tensors, states, tasks = _instance(rng, L)
    lb = sm.lower_bound(tasks, L, costs)
    bound = (3 - 1 / L) * lb
    assert sm.simulate(tasks, L, costs) <= bound + 1e-12

    def compute(e, weights):
        assert all(w is not None for w in weights)
        time.sleep(costs.compute_s_per_expert)

    def one_run() -> float:
        rt = _FakeRuntime(tensors, L)
        _place(rt, tensors, states)
        sched = _fetcher(rt, L)
        _patch(sched, costs, [])
        try:
            t0 = time.perf_counter()
            sched.run(0, sorted(states), compute)
            took = time.perf_counter() - t0
        finally:
            sched.close()
        assert rt._held == 0
        return took

    # allowance: sleep overshoot and thread wake-ups on a loaded machine; a second run where the first
    # was over it (a clean-clone CI run saw one 0.44 s stall against a 0.15 s bound that 72 reruns,
    # 24 of them beside three busy loops, never showed): a schedule that is too slow is slow both times
    allowance = bound * 1.15 + 0.03 + 0.002 * len(tasks)
    took = one_run()
    if took > allowance:
        took = min(took, one_run())
    assert took <= allowance, (took, lb, L)


def test_reads_follow_the_model_priority_order():
    rng = random.Random(7)
    tensors, states, tasks = {}, {}, []
    uid = 0
    plan = ["sm_only", "none", "e_only", "none", "compressed", "full", "sm_only"]
    for e, state in enumerate(plan):
        ts = []
        for name in ("gate_up", "down"):
            numel = rng.choice([1, 2, 3]) * 800 * 8
            ts.append(_tensor(uid, 0, e, name, numel, numel // 4))
            uid += 1
        tensors[(0, e)] = ts
        states[e] = [state, state]
    costs = sm.Costs(disk_bw=2e7, disk_latency=0.001, decomp_bw_per_worker=5e7, merge_bw=1e8,
                     compute_s_per_expert=0.0, merge_on_workers=True)
    rt = _FakeRuntime(tensors, 1)
    _place(rt, tensors, states)
    sched = _fetcher(rt, 1)
    reads: list = []
    _patch(sched, costs, reads)
    done = []
    try:
        sched.run(0, sorted(states), lambda e, w: done.append(e))
    finally:
        sched.close()
    assert sorted(done) == sorted(states)
    need, rank = issue_order(sorted(states), states, {e: tensors[(0, e)] for e in states})
    want = [u for u in sorted(rank, key=rank.get)
            if states[next(e for e in states if any(t.uid == u for t in tensors[(0, e)]))][0] in ("none", "e_only", "sm_only")]
    assert reads == want
    # all Type-I reads before any Type-II read
    kinds = [states[next(e for e in states if any(t.uid == u for t in tensors[(0, e)]))][0] for u in reads]
    assert kinds.index("sm_only") > max(i for i, k in enumerate(kinds) if k in ("none", "e_only"))
    assert expert_type(["full", "full"]) == "full" and expert_type(["full", None]) == "I"
    assert expert_type(["compressed", "sm_only"]) == "II"


def test_priority_workers_run_the_lowest_rank_first_and_finish_their_queue_at_shutdown():
    """The reader and decode pools take the queued job of lowest rank (ties: first queued),
    whichever thread takes it; shutdown runs what is queued before the threads stop."""
    from zipmoe.runtime.engine.workers import PriorityWorkers

    gate, ran = threading.Event(), []
    pool = PriorityWorkers(1, "test-pool")
    pool.submit(0, gate.wait, 5.0)  # holds the one thread while the rest queue up
    for rank, tag in ((5, "e"), (1, "b"), (3, "d"), (1, "c"), (0, "a")):
        pool.submit(rank, ran.append, tag)
    gate.set()
    pool.shutdown()
    assert ran == ["a", "b", "c", "d", "e"]
    assert not any(th.is_alive() for th in pool._threads)
    pool.check()  # no failure, no thread lost while not stopping
