"""The fetcher's cost model and simulator for one sparse layer (shared by the runtime's
fetcher, the planner and the simulator test).

Once the router of a sparse layer has chosen, every chosen expert tensor is in one cache
state, and its state decides its tasks (``R`` = read on the disk, ``D`` = decompress E on a
CPU worker, ``M`` = merge E and SM into bf16 on the device, ``C`` = the expert's compute on
the device)::

    full        C                                   (nothing to load)
    compressed  D -> M -> C                         Type II (SM cached; E cached compressed)
    sm_only     R(E) -> D -> M -> C                 Type II (SM cached)
    e_only      R(SM) -> D -> M -> C                Type I  (E cached compressed; the runtime
                                                            decompresses once the SM bytes are
                                                            in: its decode jobs also copy them to
                                                            the staging buffer)
    none        R(E+SM) -> D -> M -> C              Type I  (one read of the tensor's extent:
                                                            the container stores E and SM of a
                                                            tensor contiguously)

Resources: one I/O channel (the disk, as the runtime's reader threads reach it together), ``L``
CPU decode workers, and one device that runs merges and computes one after the other.

Decompression is split as the runtime splits it: with more than one worker, a tensor's
decompression is ``Task.chunks`` jobs (one per stored E chunk, each ``1/chunks`` of the work),
which the idle workers share, and the tensor is decompressed when its last job ends. (Until
30 Nov the model ran each tensor's decompression as one job and let an ``e_only`` tensor
decompress while its SM bytes were read; the runtime does neither, and the model overcharged
misses against ``e_only`` hits by about 2x on the GPU: docs/benchmarks.md §7.)

``Costs.merge_on_workers=True`` models the CPU runtime (runtime.engine.fetcher on a CPU device): the
worker that decompresses a tensor merges it in the same job (decompress+merge is one worker op,
at ``decomp_s + merge_s``), which starts once E *and* SM are in memory (so an ``e_only`` job
waits for its SM read), and the device only computes. An expert (all tensors sharing a
``Task.expert`` key) computes once, after all its tensors are whole.

Public API (exact signatures)::

    STATES = ("full", "compressed", "sm_only", "e_only", "none")
    Task(state: str, nbytes: int, e_bytes: int, sm_bytes: int | None = None,
         expert: Hashable | None = None, chunks: int = 1)
    Costs(disk_bw: float, disk_latency: float, decomp_bw_per_worker: float, merge_bw: float,
          compute_s_per_expert: float, decomp_overhead_s: float = 0.0,
          merge_overhead_s: float = 0.0, merge_on_workers: bool = False)
    durations(task: Task, costs: Costs) -> tuple[float, float, float]   # (read_s, decomp_s, merge_s)
    order(tasks: Sequence[Task]) -> list[int]          # priority list (indices into tasks)
    schedule(tasks, L: int, costs, window: int | None = None) -> Schedule   # every op's start/end
    simulate(tasks, L: int, costs, window: int | None = None) -> float     # makespan in seconds
    lower_bound(tasks, L: int, costs) -> float         # a lower bound on any schedule's makespan
    layer_tasks(counts: Mapping[str, int], tensors: Sequence[tuple[int, ...]]) -> list[Task]
    makespan_for_counts(counts, tensors, L, costs, window=None) -> float  (memoised simulate of layer_tasks)

What the numbers count (normative; runtime.plan.micro and runtime.plan.passes measure exactly these):

- ``Task.nbytes``: the tensor's decoded size in bf16 bytes (2 × numel).
  ``Task.e_bytes``: its stored (compressed) E chunks, bytes. ``Task.sm_bytes``: its stored SM
  chunk (numel bytes; default ``nbytes // 2``).
- ``Costs.disk_bw``: stored bytes per second of cold reads (O_DIRECT) at the runtime's queue
  depth: the one I/O channel here is the runtime's reader threads together, which share every
  read's pieces (runtime.engine.reads). ``Costs.disk_latency``: seconds added to every read
  request (plan/profile.py measures it at queue depth 1 and divides it by the readers, whose
  requests overlap). A read of ``n`` bytes takes ``disk_latency + n / disk_bw``.
- ``Costs.decomp_bw_per_worker``: bf16 bytes (``Task.nbytes``, as in DESIGN.md's codec table,
  not the exponent bytes written) decoded per second by one worker, decoding into a
  preallocated buffer. Plus ``decomp_overhead_s`` per decompression job.
- ``Costs.merge_bw``: bf16 bytes produced per second by the merge on the device (plus
  ``merge_overhead_s`` per merge).
- ``Costs.compute_s_per_expert``: seconds of one expert's forward (all its projections) for one
  decode step on the device.

The list-scheduling order (:func:`order`; every resource takes the ready op that comes first in
it): Type I before Type II, so that the disk starts with Type-I reads and stays busy, while the
workers, which Type-I work cannot use until its reads land, fill with Type-II decompressions::

    none (shortest read first) < e_only (shortest SM read first) < sm_only (shortest E read
    first) < compressed (largest decompression first) < full

The disk reads in that order; a free worker takes the first ready decompression in that order;
the free device takes a ready compute first (an expert computes as soon as its weights are
whole), else the first ready merge. No resource idles while it has a ready op (greedy).

Guarantee (tests/test_schedule_model.py checks it on random instances):
``simulate(...) <= (3 - 1/L) * lower_bound(...)``.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from zipmoe.runtime.engine.order import _READS, STATES, Task, order  # noqa: F401 (STATES, Task and order are re-exported for the planner)


@dataclass(frozen=True)
class Costs:
    """Measured hardware costs (see the module docstring for exactly what each counts)."""

    disk_bw: float  # stored bytes / s, cold, at the runtime's queue depth (its readers together)
    disk_latency: float  # s per read request
    decomp_bw_per_worker: float  # bf16 bytes / s / worker
    merge_bw: float  # bf16 bytes / s on the device
    compute_s_per_expert: float  # s per expert per decode step
    decomp_overhead_s: float = 0.0  # s per decompression job
    merge_overhead_s: float = 0.0  # s per merge
    merge_on_workers: bool = False  # True: the worker that decompresses also merges (the CPU runtime)

    def __post_init__(self) -> None:
        for name in ("disk_bw", "decomp_bw_per_worker", "merge_bw"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Costs.{name} must be positive")
        for name in ("disk_latency", "compute_s_per_expert", "decomp_overhead_s", "merge_overhead_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"Costs.{name} must not be negative")


def durations(task: Task, costs: Costs) -> tuple[float, float, float]:
    """``(read_s, decomp_s, merge_s)`` of one task; 0.0 for the ops its state does not have."""
    read = costs.disk_latency + task.read_bytes / costs.disk_bw if task.state in _READS else 0.0
    if task.state == "full":
        return 0.0, 0.0, 0.0
    decomp = costs.decomp_overhead_s + task.nbytes / costs.decomp_bw_per_worker
    merge = costs.merge_overhead_s + task.nbytes / costs.merge_bw
    return read, decomp, merge


@dataclass
class Schedule:
    """The simulated schedule: per task ``(start, end)`` of each op (None if it has none)."""

    makespan: float
    read: list[tuple[float, float] | None] = field(default_factory=list)
    decomp: list[tuple[float, float, int] | None] = field(default_factory=list)  # (first start, last end, worker of the last job)
    merge: list[tuple[float, float] | None] = field(default_factory=list)
    compute: dict[Hashable, tuple[float, float]] = field(default_factory=dict)
    jobs: list[tuple[float, float, int, int]] = field(default_factory=list)  # every decompression job: (start, end, worker, task)


def _group_keys(tasks: Sequence[Task]) -> list[Hashable]:
    return [("__task__", i) if t.expert is None else ("__expert__", t.expert) for i, t in enumerate(tasks)]


def schedule(tasks: Sequence[Task], L: int, costs: Costs, window: int | None = None) -> Schedule:
    """Run the greedy list schedule of :func:`order` as a discrete-event simulation.

    ``window``: at most this many experts that need loading are in flight at once (issued, not
    yet computed), as runtime.engine.core bounds its working buffers; experts are issued in priority
    order and the next one enters when one computes. None: no limit.
    """
    tasks = list(tasks)
    if L < 1:
        raise ValueError("L (decode workers) must be at least 1")
    n = len(tasks)
    sched = Schedule(0.0, [None] * n, [None] * n, [None] * n, {})
    if n == 0:
        return sched
    pri = order(tasks)
    rank = [0] * n
    for p, i in enumerate(pri):
        rank[i] = p
    dur = [durations(t, costs) for t in tasks]
    pieces = [_pieces(t, L) for t in tasks]
    left = list(pieces)  # decompression jobs of each task not yet finished
    gkeys = _group_keys(tasks)
    members: dict[Hashable, list[int]] = {}
    for i, g in enumerate(gkeys):
        members.setdefault(g, []).append(i)
    grank = {g: min(rank[i] for i in ms) for g, ms in members.items()}
    pending = {g: sum(1 for i in ms if tasks[i].state != "full") for g, ms in members.items()}

    disk_queue = [i for i in pri if tasks[i].state in ("none", "e_only", "sm_only")]
    ready_decomp: list[tuple[int, int]] = []  # heap of (rank, task)
    ready_merge: list[tuple[int, int]] = []
    ready_compute: list[tuple[int, int, Hashable]] = []
    decomp_done = [False] * n

    fused = costs.merge_on_workers  # decompress+merge is one worker job, needing E and SM
    if fused:
        dur = [(r, d + m, 0.0) for r, d, m in dur]
    job = [_job_s(dur[i][1], pieces[i], costs) for i in range(n)]

    def push_decomp(i: int) -> None:
        for _ in range(pieces[i]):
            heapq.heappush(ready_decomp, (rank[i], i))
    gid = {g: k for k, g in enumerate(members)}
    to_issue = sorted((g for g in members if pending[g] > 0), key=lambda g: grank[g])
    issued: set = set()
    slots = len(to_issue) if window is None else max(1, int(window))

    def issue_next() -> None:
        nonlocal slots
        while to_issue and slots > 0:
            g = to_issue.pop(0)
            slots -= 1
            issued.add(g)
            for i in sorted(members[g], key=lambda i: rank[i]):
                if tasks[i].state == "compressed":
                    push_decomp(i)

    issue_next()
    for g in members:
        if pending[g] == 0:
            heapq.heappush(ready_compute, (grank[g], gid[g], g))

    events: list[tuple[float, int, str, int, object]] = []  # (time, seq, kind, task, payload)
    seq = 0
    now = 0.0
    disk_free = True
    free_workers = list(range(L - 1, -1, -1))
    device_free = True
    end = 0.0

    def merge_ready(i: int) -> None:
        if decomp_done[i]:
            heapq.heappush(ready_merge, (rank[i], i))

    while True:
        # dispatch everything that can start now
        nxt = next((p for p, i in enumerate(disk_queue) if gkeys[i] in issued), None) if disk_free else None
        if nxt is not None:
            i = disk_queue.pop(nxt)
            d = dur[i][0]
            sched.read[i] = (now, now + d)
            heapq.heappush(events, (now + d, seq, "read", i, None))
            seq += 1
            disk_free = False
        while free_workers and ready_decomp:
            _, i = heapq.heappop(ready_decomp)
            w = free_workers.pop()
            d = job[i]
            first = sched.decomp[i][0] if sched.decomp[i] is not None else now
            sched.decomp[i] = (first, now + d, w)
            sched.jobs.append((now, now + d, w, i))
            heapq.heappush(events, (now + d, seq, "decomp", i, w))
            seq += 1
        if device_free and (ready_compute or ready_merge):
            if ready_compute:
                _, _, g = heapq.heappop(ready_compute)
                d = costs.compute_s_per_expert
                sched.compute[g] = (now, now + d)
                heapq.heappush(events, (now + d, seq, "compute", -1, g))
            else:
                _, i = heapq.heappop(ready_merge)
                d = dur[i][2]
                sched.merge[i] = (now, now + d)
                heapq.heappush(events, (now + d, seq, "merge", i, None))
            seq += 1
            device_free = False
        if not events:
            break
        # advance to the next completion; process every event at that instant
        now = events[0][0]
        while events and events[0][0] == now:
            _, _, kind, i, payload = heapq.heappop(events)
            end = max(end, now)
            if kind == "read":
                disk_free = True
                push_decomp(i)  # none, sm_only, e_only: the worker jobs can start
            elif kind == "decomp":
                free_workers.append(payload)  # type: ignore[arg-type]
                left[i] -= 1
                if left[i]:
                    continue
                decomp_done[i] = True
                if fused:  # merged too: the tensor is whole
                    sched.merge[i] = (now, now)
                    g = gkeys[i]
                    pending[g] -= 1
                    if pending[g] == 0:
                        heapq.heappush(ready_compute, (grank[g], gid[g], g))
                else:
                    merge_ready(i)
            elif kind == "merge":
                device_free = True
                g = gkeys[i]
                pending[g] -= 1
                if pending[g] == 0:
                    heapq.heappush(ready_compute, (grank[g], gid[g], g))
            else:  # compute
                device_free = True
                if payload in issued:
                    slots += 1
                    issue_next()
    sched.makespan = end
    return sched


def simulate(tasks: Sequence[Task], L: int, costs: Costs, window: int | None = None) -> float:
    """Makespan (seconds) of the list schedule of one sparse layer's tasks."""
    return schedule(tasks, L, costs, window).makespan


def _pieces(t: Task, L: int) -> int:
    """Decompression jobs of ``t``: its chunks when there is more than one worker (the runtime
    splits only then), else one."""
    return max(1, int(t.chunks)) if L > 1 and t.state != "full" else 1


def _job_s(decomp_s: float, pieces: int, costs: Costs) -> float:
    """One decompression job of a task split in ``pieces`` (each pays the per-job overhead)."""
    if pieces <= 1 or decomp_s <= 0:
        return decomp_s
    return (decomp_s - costs.decomp_overhead_s) / pieces + costs.decomp_overhead_s


def _fastest_decomp(t: Task, d: tuple[float, float, float], L: int, costs: Costs) -> float:
    """The least time ``t``'s decompression can take: its jobs spread over the workers."""
    p = _pieces(t, L)
    return _job_s(d[1], p, costs) * -(-p // L)


def _pre_merge(t: Task, d: tuple[float, float, float], L: int, costs: Costs) -> float:
    """Earliest time the task's merge can start (merged on the workers: its last job's end), alone:
    its read, then its decompression spread over the workers."""
    return d[0] + _fastest_decomp(t, d, L, costs)


def lower_bound(tasks: Sequence[Task], L: int, costs: Costs) -> float:
    """A lower bound on the makespan of any schedule of ``tasks``: the max of

    - total disk time (every read's latency + bytes / bw), and that plus the shortest tail any
      read leaves after it (decompression, merge, compute that must follow the last read);
    - total decode work / L;
    - total device work (merges + one compute per expert), and that plus the earliest moment any
      device op can be ready;
    - the longest single chain: per expert, max over its tensors of read/decompress/merge (the
      e_only read overlaps its decompression), or its earliest merge-ready time + all its merges
      (serial on the device), then its compute.

    The planner does not use it: it is the yardstick of the guarantee docs/planner.md states
    (``simulate <= (3 - 1/L) * lower_bound``, checked by tests/test_schedule_model.py), kept
    for whoever weighs a schedule against the best one possible.
    """
    tasks = list(tasks)
    if L < 1:
        raise ValueError("L (decode workers) must be at least 1")
    if not tasks:
        return 0.0
    dur = [durations(t, costs) for t in tasks]
    if costs.merge_on_workers:  # one worker job; e_only's starts after its SM read
        dur = [(r, d + m, 0.0) for r, d, m in dur]
    gkeys = _group_keys(tasks)
    c = costs.compute_s_per_expert
    groups: dict[Hashable, list[int]] = {}
    for i, g in enumerate(gkeys):
        groups.setdefault(g, []).append(i)

    disk = sum(dur[i][0] for i in range(len(tasks)))
    pieces = [_pieces(t, L) for t in tasks]
    decode = sum(p * _job_s(dur[i][1], p, costs) for i, p in enumerate(pieces)) / L  # each job pays its overhead
    device = sum(dur[i][2] for i in range(len(tasks))) + c * len(groups)

    chain = 0.0
    for ms in groups.values():
        loaded = [i for i in ms if tasks[i].state != "full"]
        if loaded:
            per = max(_pre_merge(tasks[i], dur[i], L, costs) + dur[i][2] for i in loaded)
            serial = min(_pre_merge(tasks[i], dur[i], L, costs) for i in loaded) + sum(dur[i][2] for i in loaded)
            chain = max(chain, max(per, serial) + c)
        else:
            chain = max(chain, c)

    bounds = [disk, decode, device, chain]
    readers = [i for i, t in enumerate(tasks) if t.state in ("none", "e_only", "sm_only")]
    if readers:
        tails = []
        for i in readers:
            _, _, m = dur[i]
            tails.append(_fastest_decomp(tasks[i], dur[i], L, costs) + m + c)
        bounds.append(disk + min(tails))
    loaded_all = [i for i, t in enumerate(tasks) if t.state != "full"]
    if loaded_all and len(loaded_all) == len(tasks):
        bounds.append(device + min(_pre_merge(tasks[i], dur[i], L, costs) for i in loaded_all))
    return max(bounds)


def layer_tasks(counts: Mapping[str, int], tensors: Sequence[tuple[int, ...]]) -> list[Task]:
    """The tasks of one sparse layer when ``counts[state]`` chosen experts are in each state.

    ``tensors`` describes one expert: ``(nbytes, e_bytes, sm_bytes[, chunks])`` per tensor (e.g.
    gate_up, down; ``chunks``: its stored E chunks, default 1). All tensors of an expert share its
    state (the planner assigns whole experts to a pool).
    """
    out: list[Task] = []
    e = 0
    for state in STATES:
        for _ in range(int(counts.get(state, 0))):
            for nb, eb, sb, *rest in tensors:
                out.append(Task(state, int(nb), int(eb), int(sb), expert=e, chunks=int(rest[0]) if rest else 1))
            e += 1
    return out


@lru_cache(maxsize=65536)
def _makespan_cached(counts: tuple[int, ...], tensors: tuple[tuple[int, ...], ...], L: int, costs: Costs,
                     window: int | None) -> float:
    return simulate(layer_tasks(dict(zip(STATES, counts)), tensors), L, costs, window)


def makespan_for_counts(counts: Mapping[str, int], tensors: Sequence[tuple[int, ...]], L: int, costs: Costs,
                        window: int | None = None) -> float:
    """Memoised :func:`simulate` of :func:`layer_tasks` (the planner calls this many times)."""
    key = tuple(int(counts.get(s, 0)) for s in STATES)
    return _makespan_cached(key, tuple(tuple(int(x) for x in t) for t in tensors), int(L), costs,
                            None if window is None else int(window))
