"""What the runtime counts: the numbers that `chat`, `plan` and `bench` read.

One :class:`Counters` per runtime (``model.zipmoe.counters``). Everything is cumulative since
load (or the last :meth:`Counters.reset`); take a :meth:`Counters.snapshot` before and after a
piece of work and subtract with :func:`delta` to measure it.

Fields (all plain numbers, JSON-serialisable through :meth:`Counters.snapshot`):

* ``bytes_read``: bytes of chunks read from the container (what the index says was needed)
* ``bytes_read_disk``: bytes actually transferred by the reads (4096-aligned for O_DIRECT)
* ``reads``: number of read calls (positional reads of chunk ranges)
* ``reads_by_state``: the same reads split by the cache state of the tensor they were for
  (``none``: a miss reads E and SM; ``e_only`` reads SM; ``sm_only`` reads E), each
  ``[reads, bytes transferred, seconds]``: the read rate of each kind of fetch while serving
* ``buffered_reads``: reads done without O_DIRECT (file system refused it, or ``direct_io=False``):
  the page cache may have served them, so their rate is not the disk's
* ``direct_fallbacks``: times the store fell back from O_DIRECT to buffered reads (at open or at
  the first refused read; 0 when O_DIRECT works or was not asked for)
* ``fresh_buffers``: reads that went into a newly mapped buffer instead of a reused one (each
  costs a page fault per 4 KiB: ``store.ReadBuffers``)
* ``hits``: per state of an expert tensor when a layer needed it: ``full``, ``compressed``,
  ``sm_only``, ``e_only`` and ``none`` (a miss). One count per *compute tensor* (for the fused
  families an expert has two: ``gate_up`` and ``down``), per layer call.
* ``expert_calls``: experts computed (one per chosen expert per layer call)
* ``layer_calls``: sparse-layer calls (one per sparse layer per forward)
* ``time_s``: seconds spent per stage, summed over the threads that did it: ``read`` (I/O
  thread), ``decode`` (decompression, workers), ``merge`` (E+SM -> bf16), ``compute`` (expert
  forward, serving thread), ``stage`` (serving thread queueing a decoded expert's copy to the
  device, and its device merge, on the copy stream: ``engine/staging.py``), ``wait`` (serving
  thread blocked on the pipeline), ``admit``
  (serving thread placing fetched tensors in the cache pools, copies included), ``host`` (the
  serving thread's own work in a sparse layer's fetch, neither compute nor wait: lookup,
  placement, issue, staging, admission, release, bookkeeping; ``admit`` and ``stage`` are in it;
  divided by the fetched tensors, the host work per fetched tensor)
* ``host_parts``: ``host`` taken apart (seconds, the serving thread's, in the fetch pipeline of
  ``Fetcher.run``): ``lookup`` (every chosen tensor's use, hit state and pin), ``issue`` (the
  fetches of an expert entering the window, demand and prefetch: read buffers, held bytes, the
  staging slot, queueing the jobs), ``report`` (handling a finished fetch), ``to_device`` (the
  compute stream's wait on the copy, the weights in the compute dtype), ``release`` (an
  expert's bytes, buffers and slot given back); ``admit`` is ``time_s["admit"]``; what
  ``host`` holds beyond these and ``admit`` is the loop's own bookkeeping (the issue order, the
  prefetch plan)
* ``layer_makespan_s``: per sparse layer (key: layer number as a string) ``[sum, count, max]`` of
  the wall time from the router's choice to the layer's output
* ``peak_held_bytes``: the largest number of weight bytes the runtime held at once (dense +
  cache pools + in-flight working buffers), to compare with the budget
* ``checksum_failures``: chunks whose checksum did not match (each one raised an error)
* ``prediction_by_layer``: per sparse layer (string key) ``[predicted, chosen, both]``: experts
  the prefetch predictor named for the layer, experts its router chose, and experts in both,
  summed over layer calls (precision = both / predicted, recall = both / chosen;
  :func:`prediction_quality`)
* ``prefetch``: expert fetches ``issued`` on a prediction, ``used`` (the layer chose them),
  ``dropped`` (it did not: read for nothing) and ``failed`` (a dropped one whose bytes were bad:
  never raised, the layer did not need it)
* ``staging_waits``: times the serving thread waited for a copy to the device to finish before
  it could reuse that staging slot (CUDA; ``engine/staging.py``): 0 when the ring never runs
  ahead of the copy stream
"""

from __future__ import annotations

import copy
import threading
from collections import deque
import time

from zipmoe.runtime.engine.states import STATES

__all__ = ["Counters", "delta", "DecodeClock", "STATES", "STAGES", "HOST_PARTS", "prediction_quality", "fetched_tensors",
           "host_work"]

STAGES = ("read", "decode", "merge", "stage", "compute", "wait", "admit", "predict", "host")
#: the parts of ``time_s["host"]`` measured apart (``Counters.host_parts``)
HOST_PARTS = ("lookup", "issue", "report", "to_device", "release")
#: sparse layer calls ``Counters.recent_calls`` keeps (the calibration of the qwen1.5-moe shape: 3072)
RECENT_CALLS = 3072


class Counters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.bytes_read = 0
        self.bytes_read_disk = 0
        self.reads = 0
        self.reads_by_state = {}
        self.buffered_reads = 0
        self.direct_fallbacks = getattr(self, "direct_fallbacks", 0)  # a property of the run: kept by reset
        self.fresh_buffers = 0
        self.hits = {s: 0 for s in STATES}
        self.expert_calls = 0
        self.layer_calls = 0
        self.time_s = {s: 0.0 for s in STAGES}
        self.host_parts = {s: 0.0 for s in HOST_PARTS}  # written by the serving thread alone
        self.layer_makespan_s: dict[str, list] = {}
        self.peak_held_bytes = getattr(self, "peak_held_bytes", 0)
        self.checksum_failures = 0
        self.prediction_by_layer: dict[str, list] = {}
        self.prefetch = {"issued": 0, "used": 0, "dropped": 0, "failed": 0}
        self.staging_waits = 0
        # every sparse layer call's experts: per layer, how often each expert was used (the
        # activation statistics the default plan refits from, runtime/plan/default.py), and,
        # while ``uses_log`` is a list, the calls themselves in order (layer, experts): the
        # trace bench's diagnostics replay (Belady's MIN) without the file trace, which would
        # turn the CUDA graphs off
        self.uses: dict[str, dict[int, int]] = {}
        self.uses_log: list | None = getattr(self, "uses_log", None)
        if self.uses_log is not None:
            self.uses_log = []
        # the most recent calls, always (bounded): what the default plan replays to judge a mixed
        # plan against full tensors only (runtime/plan/default.py, kept by record_usage)
        self.recent_calls: deque = deque(maxlen=RECENT_CALLS)

    # --- updates (thread-safe where called from several threads)
    def add_read(self, payload: int, disk: int, seconds: float, state: str | None = None,
                 buffered: bool = False) -> None:
        with self._lock:
            if buffered:
                self.buffered_reads += 1
            self.bytes_read += payload
            self.bytes_read_disk += disk
            self.reads += 1
            self.time_s["read"] += seconds
            if state is not None:
                rec = self.reads_by_state.setdefault(state, [0, 0, 0.0])
                rec[0] += 1
                rec[1] += disk
                rec[2] += seconds

    def note_direct_fallback(self) -> None:
        with self._lock:
            self.direct_fallbacks += 1

    def add_fresh_buffer(self) -> None:
        with self._lock:
            self.fresh_buffers += 1

    def add_time(self, stage: str, seconds: float) -> None:
        with self._lock:
            self.time_s[stage] += seconds

    def add_hit(self, state: str | None, n: int = 1) -> None:
        self.hits[state or "none"] += n

    def add_layer(self, layer, seconds: float, experts) -> None:
        """One sparse layer call: its wall time and its experts (a list of ids, or their count)."""
        key = str(layer)
        if not isinstance(experts, int):
            ids = list(experts)
            per = self.uses.get(key)
            if per is None:
                per = self.uses[key] = {}
            for e in ids:
                per[int(e)] = per.get(int(e), 0) + 1
            call = (layer, tuple(int(e) for e in ids))
            self.recent_calls.append(call)
            if self.uses_log is not None:
                self.uses_log.append(call)
            experts = len(ids)
        rec = self.layer_makespan_s.get(key)
        if rec is None:
            rec = self.layer_makespan_s[key] = [0.0, 0, 0.0]
        rec[0] += seconds
        rec[1] += 1
        rec[2] = max(rec[2], seconds)
        self.layer_calls += 1
        self.expert_calls += experts

    def add_prediction(self, layer, predicted, chosen) -> None:
        p, c = set(predicted), set(chosen)
        rec = self.prediction_by_layer.setdefault(str(layer), [0, 0, 0])
        rec[0] += len(p)
        rec[1] += len(c)
        rec[2] += len(p & c)

    def add_prefetch(self, what: str, n: int = 1) -> None:
        self.prefetch[what] += n

    def note_held(self, held: int) -> None:
        if held > self.peak_held_bytes:
            self.peak_held_bytes = held

    # --- reading
    def snapshot(self) -> dict:
        with self._lock:
            return {
                "bytes_read": self.bytes_read,
                "bytes_read_disk": self.bytes_read_disk,
                "reads": self.reads,
                "reads_by_state": copy.deepcopy(self.reads_by_state),
                "buffered_reads": self.buffered_reads,
                "direct_fallbacks": self.direct_fallbacks,
                "fresh_buffers": self.fresh_buffers,
                "hits": dict(self.hits),
                "expert_calls": self.expert_calls,
                "layer_calls": self.layer_calls,
                "time_s": dict(self.time_s),
                "host_parts": dict(self.host_parts),
                "layer_makespan_s": copy.deepcopy(self.layer_makespan_s),
                "peak_held_bytes": self.peak_held_bytes,
                "checksum_failures": self.checksum_failures,
                "prediction_by_layer": copy.deepcopy(self.prediction_by_layer),
                "prefetch": dict(self.prefetch),
                "staging_waits": self.staging_waits,
                "uses": {k: dict(v) for k, v in self.uses.items()},
            }

    def log_uses(self, on: bool = True) -> list | None:
        """Start (a fresh list) or stop keeping every layer call's experts in ``uses_log``;
        returns the log kept so far."""
        with self._lock:
            old = self.uses_log
            self.uses_log = [] if on else None
            return old


def delta(after: dict, before: dict) -> dict:
    """``after - before`` of two snapshots (peak_held_bytes and direct_fallbacks are taken from ``after``)."""
    out = {}
    for k, v in after.items():
        b = before.get(k)
        if k in ("peak_held_bytes", "direct_fallbacks"):
            out[k] = v
        elif k == "reads_by_state":
            b = b or {}
            out[k] = {st: [x - y for x, y in zip(rec, b.get(st, [0, 0, 0.0]))] for st, rec in v.items()
                      if rec[0] - b.get(st, [0])[0]}
        elif k == "layer_makespan_s":
            d = {}
            for layer, (s, c, m) in v.items():
                bs, bc, _ = b.get(layer, [0.0, 0, 0.0])
                if c - bc:
                    d[layer] = [s - bs, c - bc, m]
            out[k] = d
        elif k == "prediction_by_layer":
            b = b or {}
            out[k] = {layer: [x - y for x, y in zip(rec, b.get(layer, [0, 0, 0]))] for layer, rec in v.items()
                      if rec[1] - b.get(layer, [0, 0, 0])[1]}
        elif k == "uses":
            b = b or {}
            d = {}
            for layer, per in v.items():
                bl = b.get(layer, {})
                dl = {e: n - bl.get(e, 0) for e, n in per.items() if n - bl.get(e, 0)}
                if dl:
                    d[layer] = dl
            out[k] = d
        elif isinstance(v, dict):
            out[k] = {kk: vv - b.get(kk, 0) for kk, vv in v.items()}
        else:
            out[k] = v - (b or 0)
    return out


def fetched_tensors(snapshot: dict) -> int:
    """The compute tensors a snapshot's (or delta's) layers fetched: every use that was not a
    full-pool hit (what "per fetched tensor" divides by)."""
    return sum(v for k, v in (snapshot.get("hits") or {}).items() if k != "full" and isinstance(v, (int, float)))


#: the serving thread's stages :func:`host_work` gives per fetched tensor
HOST_WORK_STAGES = ("host", "admit", "predict", "wait")


def host_work(deltas: list) -> dict | None:
    """The serving thread's work per fetched tensor over one or more counters deltas together,
    in µs: ``host``, ``admit`` (part of it), ``predict`` and ``wait`` (beside it), ``decode`` (the
    decode workers' time, summed over them: not the serving thread's), ``fetched``
    (per delta), and ``parts`` (``host_parts``, plus ``other``: the rest of ``host`` beyond them
    and ``admit``) where the deltas have that split. None when nothing was fetched."""
    deltas = [d for d in deltas if isinstance(d, dict) and isinstance(d.get("time_s"), dict)]
    fetched = sum(fetched_tensors(d) for d in deltas)
    if not fetched:
        return None
    out = {k: 1e6 * sum(d["time_s"].get(k) or 0.0 for d in deltas) / fetched for k in HOST_WORK_STAGES}
    out["fetched"] = fetched / len(deltas)
    # the decode workers' decompression beside it, summed over the workers: how fast the cores ran the
    # same work (two runs of one configuration on an H100 VM, docs/benchmarks.md §27c: 8.0 and 12.3 ms)
    out["decode"] = 1e6 * sum(d["time_s"].get("decode") or 0.0 for d in deltas) / fetched
    split = [d["host_parts"] for d in deltas if isinstance(d.get("host_parts"), dict)]
    if split:
        parts = {k: 1e6 * sum(p.get(k) or 0.0 for p in split) / fetched for k in sorted({k for p in split for k in p})}
        parts["other"] = out["host"] - out["admit"] - sum(parts.values())
        out["parts"] = parts
    return out


def prediction_quality(snapshot: dict) -> dict:
    """``{layer: {"precision", "recall"}}`` and ``"all"`` from a snapshot's (or delta's)
    ``prediction_by_layer`` (None where nothing was predicted / chosen)."""
    out = {}
    tot = [0, 0, 0]
    for layer, (p, c, both) in (snapshot.get("prediction_by_layer") or {}).items():
        out[layer] = {"precision": both / p if p else None, "recall": both / c if c else None}
        tot = [tot[0] + p, tot[1] + c, tot[2] + both]
    if tot[1]:
        out["all"] = {"precision": tot[2] / tot[0] if tot[0] else None, "recall": tot[2] / tot[1]}
    return out


class DecodeClock:
    """A ``model.generate`` streamer that times the decode steps alone.

    ``put()`` gets the prompt, then each new token; the counters are snapshotted at the second
    put (the prefill's token), so :meth:`steps` and :meth:`delta` cover the decode steps only.
    ``between_steps`` (optional) runs at every put, i.e. between two forward steps.
    """

    def __init__(self, counters: Counters, between_steps=None) -> None:
        self.counters = counters
        self.between_steps = between_steps
        self.stamps: list[float] = []
        self.start: dict | None = None

    def put(self, _value) -> None:
        if self.between_steps is not None:
            self.between_steps()
        self.stamps.append(time.perf_counter())
        if len(self.stamps) == 2:
            self.start = self.counters.snapshot()

    def end(self) -> None:
        pass

    def steps(self) -> list[float]:
        """Seconds of each decode step."""
        return [b - a for a, b in zip(self.stamps[1:], self.stamps[2:])]

    def delta(self) -> dict:
        """The counters of the decode steps (since the prefill's token)."""
        return delta(self.counters.snapshot(), self.start)
