"""Fits of what serving adds to the costs measured alone (plan/micro.py), from the served passes
(plan/passes.py): the per-tensor overhead of the runtime's own work, the disk as it reads while
serving, and the per-read latency. The bisection they share is :func:`fit_increase`.
"""

from __future__ import annotations

from dataclasses import replace

from zipmoe.runtime.plan.simulate import Costs, makespan_for_counts

__all__ = ["serving_overheads", "serving_read_latency", "fit_increase"]


def serving_overheads(costs: Costs, tensors, serving: dict, workers: int, window: int | None,
                      layer_overhead: float = 0.0, compressed: dict | None = None) -> dict:
    """What the runtime adds, while serving, to the costs measured alone.

    With ``compressed`` (``_compressed_pass``'s figures, at least 90% compressed hits) the two
    passes split it:

    * ``merge_overhead_s``: per fetched tensor, what makes the schedule model's layer of
      compressed hits take as long as the measured one (the serving thread's work per tensor:
      staging buffers, copies and kernel launches, hand-offs between threads, admission);
    * ``disk_bw``: then lowered so that the model's all-miss layer takes as long as the
      measured one: reads while serving go slower than alone (``disk_latency`` stays as
      measured alone).

    This is what the H200 box's CPU and GPU showed on the demo model (docs/benchmarks.md §7):
    per expert, a layer cost grew with the bytes it read (misses, then E-only, then SM-only
    hits), and compressed hits cost far less than the all-miss fit charged them.

    Without ``compressed`` (profiles measured before it, or a pass that could not keep the
    experts compressed), the older rule from the all-miss pass alone (``_miss_pass``):
    ``disk_latency`` gets what the runtime's reads took beyond ``latency + bytes / bw`` on
    average, and the rest of the layer's time becomes ``merge_overhead_s``, charged to every
    fetched tensor (which overcharges compressed hits).
    """
    k = int(round(serving.get("experts_per_layer", 0)))
    kc = int(round((compressed or {}).get("experts_per_layer", 0)))
    if (compressed and compressed.get("compressed_share", 0.0) >= 0.9 and kc >= 1 and k >= 1
            and compressed.get("layer_makespan_s") and serving.get("layer_makespan_s")):
        merge = _fit_merge_overhead(costs, {"compressed": kc}, tensors, workers, window,
                                    compressed["layer_makespan_s"] - layer_overhead)
        c = replace(costs, merge_overhead_s=merge)

        def miss(slower: float) -> float:
            return makespan_for_counts({"none": k}, tensors, workers, replace(c, disk_bw=costs.disk_bw / (1 + slower)), window)

        slower = fit_increase(miss, serving["layer_makespan_s"] - layer_overhead, 100.0, steps=50)
        return {"disk_latency": costs.disk_latency, "disk_bw": costs.disk_bw / (1 + slower), "merge_overhead_s": merge}
    return _serving_overheads_all_miss(costs, tensors, serving, workers, window, layer_overhead)


def _serving_overheads_all_miss(costs: Costs, tensors, serving: dict, workers: int, window: int | None,
                                layer_overhead: float = 0.0) -> dict:
    """The rule for a profile without a compressed pass (``serving_overheads``), from the
    all-miss pass's counters alone:

    * ``disk_latency``: per read, the O_DIRECT latency plus what the runtime's reads took beyond
      ``latency + bytes / bw`` on average;
    * ``merge_overhead_s``: per fetched tensor, the overhead that makes the schedule model's
      layer (every chosen expert a miss) take as long as the measured one.
    """
    out = {"disk_latency": serving_read_latency(costs, serving.get("reads", 0), serving.get("read_bytes", 0),
                                                serving.get("read_s", 0.0)),
           "merge_overhead_s": costs.merge_overhead_s}
    k = int(round(serving.get("experts_per_layer", 0)))
    if k >= 1 and serving.get("layer_makespan_s"):
        out["merge_overhead_s"] = _fit_merge_overhead(replace(costs, disk_latency=out["disk_latency"]), {"none": k},
                                                      tensors, workers, window, serving["layer_makespan_s"] - layer_overhead)
    return out


def _fit_merge_overhead(costs: Costs, counts: dict, tensors, workers: int, window: int | None, target: float) -> float:
    """``costs.merge_overhead_s`` plus the per-tensor overhead that makes the schedule model's
    layer of ``counts`` take ``target`` seconds (bisection; nothing added when it already does)."""
    def layer(extra: float) -> float:
        return makespan_for_counts(counts, tensors, workers, replace(costs, merge_overhead_s=costs.merge_overhead_s + extra), window)

    # the makespan grows with the per-tensor overhead, by at least the overhead itself
    return costs.merge_overhead_s + fit_increase(layer, target, max(0.0, target - layer(0.0)))


def serving_read_latency(costs: Costs, reads: int, read_bytes: int, read_s: float) -> float:
    """The per-read latency to plan with: the measured one plus what ``reads`` reads of
    ``read_bytes`` took, on average, beyond ``latency + bytes / bw`` (never less)."""
    if not reads:
        return costs.disk_latency
    alone = reads * costs.disk_latency + read_bytes / costs.disk_bw
    return costs.disk_latency + max(0.0, (read_s - alone) / reads)


def fit_increase(f, target: float, hi: float, steps: int = 40) -> float:
    """The ``x`` in ``[0, hi]`` where the increasing ``f(x)`` reaches ``target`` (bisection); 0 when
    ``f(0)`` already does."""
    lo = 0.0
    if f(0.0) >= target:
        return 0.0
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
    return (lo + hi) / 2
