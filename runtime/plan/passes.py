"""Served passes: a few greedy tokens through the runtime, read from its counters.

What a micro-benchmark cannot give (plan/profile.py says how each figure is used):
:func:`measure_runtime` serves with every expert resident when that fits (the expert compute as
the hook does it, the time per token outside the sparse layers, a layer's own overhead), then
two passes that fetch every chosen expert: :func:`miss_pass` (every one a miss: read,
decompress, merge) and :func:`compressed_pass` (every one a compressed hit: decompress and merge
only).
"""

from __future__ import annotations

import numpy as np

__all__ = ["measure_runtime", "miss_pass", "compressed_pass"]


def _mem_available() -> int:
    """Memory available to a new process (psutil: MemAvailable on Linux)."""
    import psutil

    try:
        return int(psutil.virtual_memory().available)
    except (OSError, RuntimeError):
        return 4 << 30


def miss_pass(model, rt, prompt, tokens: int) -> dict:
    """Decode ``tokens`` steps with the cache emptied before each: every chosen expert is read,
    decompressed and merged as serving does it. Returns the runtime's counters of those steps
    (mean layer makespan, experts per layer, reads of misses: count, bytes, seconds)."""
    import torch

    from zipmoe.runtime.engine.counters import DecodeClock
    from zipmoe.runtime.engine.loop import generate_ids

    # between two forward steps, forget every cached expert
    clock = DecodeClock(rt.counters, between_steps=rt.cache.clear)
    with torch.inference_mode():
        generate_ids(model, prompt, attention_mask=torch.ones_like(prompt), do_sample=False, min_new_tokens=tokens + 1,
                      max_new_tokens=tokens + 1, streamer=clock)
    d = clock.delta()
    reads, read_bytes, read_s = d["reads_by_state"].get("none", [0, 0, 0.0])
    steps = clock.steps()
    sparse = sum(v[0] for v in d["layer_makespan_s"].values())
    # the time outside the sparse layers while every expert is fetched: on few cores the decode
    # workers share them with the dense part's threads
    dense = float(np.median(steps)) - sparse / max(1, len(steps)) if steps else None
    return {
        "steps": tokens,
        "dense_s_per_token": None if dense is None else max(0.0, dense),
        **_layer_figures(d),
        "reads": int(reads), "read_bytes": int(read_bytes), "read_s": float(read_s),
    }


def _layer_figures(d: dict) -> dict:
    """A pass's mean sparse-layer makespan and experts per layer, from its counters' delta."""
    lm = d["layer_makespan_s"]
    layer_calls = max(1, sum(v[1] for v in lm.values()))
    return {"layer_makespan_s": sum(v[0] for v in lm.values()) / layer_calls,
            "experts_per_layer": int(d["expert_calls"]) / layer_calls}


def compressed_pass(model, rt, prompt, tokens: int) -> dict:
    """Decode ``tokens`` steps with every chosen expert a compressed hit: a warm pass admits the
    experts it reads to a cache that has only a compressed pool (as large as the runtime's
    pools), then the same greedy steps again are timed. Returns the layer makespan, experts per
    layer and the share of fetched tensors that were compressed hits."""
    import torch

    from zipmoe.runtime.engine.cache import ExpertCache
    from zipmoe.runtime.engine.counters import DecodeClock
    from zipmoe.runtime.engine.loop import generate_ids

    old = rt.swap_cache(ExpertCache({"compressed": rt.cache.capacity_bytes()}, demote=None))
    try:
        kw = dict(attention_mask=torch.ones_like(prompt), do_sample=False, min_new_tokens=tokens + 1,
                  max_new_tokens=tokens + 1)
        with torch.inference_mode():
            generate_ids(model, prompt, **kw)
            clock = DecodeClock(rt.counters)
            generate_ids(model, prompt, streamer=clock, **kw)
    finally:
        rt.swap_cache(old)
    d = clock.delta()
    fetched = sum(v for k, v in d["hits"].items() if k != "full")
    return {"steps": tokens, **_layer_figures(d), "compressed_share": d["hits"].get("compressed", 0) / max(1, fetched)}


def measure_runtime(path, layout, device: str = "cpu", workers: int = 1, tokens: int = 16, warmup: int = 8,
                    miss_tokens: int = 6, load_options: dict | None = None) -> dict:
    """Serve a few greedy tokens through the runtime and read its counters.

    Gives what a micro-benchmark cannot: the expert compute as the runtime's hook does it
    (``compute_s_per_expert``: counters' compute time per expert call) and everything that is
    not a sparse layer (``dense_s_per_token``: time per decode step minus the sparse layers'
    makespans: attention, norms, router, the Python around them). The budget holds every expert
    when that fits in a quarter of the free memory, else as much as does. ``load_options``: more
    keyword arguments of ``load`` (``readers``, ``prefetch``, ``force``).
    """
    import torch

    from zipmoe.machine import torch_threads
    from zipmoe.runtime.plan.calibrate import load_kwargs
    from zipmoe.runtime.engine.counters import DecodeClock
    from zipmoe.runtime.engine.loop import generate_ids
    from zipmoe.runtime.engine.loader import load

    want = layout.min_budget(workers) + layout.total_expert_full + (workers + 2) * layout.expert_working
    budget = int(max(layout.min_budget(workers) * 1.5, min(want, _mem_available() // 4)))
    old = torch.get_num_threads()
    model, tok = load(path, budget=budget, device=device, workers=workers, threads=torch_threads(workers),
                      **load_kwargs(layout.dtype), **(load_options or {}))
    try:
        rt = model.zipmoe
        prompt = torch.arange(1, 9, dtype=torch.long).unsqueeze(0)
        if tok is not None:
            prompt = tok("The quick brown fox jumps over the lazy dog.", return_tensors="pt")["input_ids"][:, :16]
        prompt = prompt.to(model.device)
        with torch.inference_mode():
            kw = dict(attention_mask=torch.ones_like(prompt), do_sample=False, min_new_tokens=warmup, max_new_tokens=warmup)
            generate_ids(model, prompt, **kw)
            # two timed passes, the one with the shorter median step kept: the dense time is
            # mostly the host launching kernels, which anything else on the machine slows
            best = None
            for _ in range(2):
                clock = DecodeClock(rt.counters)
                generate_ids(model, prompt, attention_mask=torch.ones_like(prompt), do_sample=False, min_new_tokens=tokens + 1,
                              max_new_tokens=tokens + 1, streamer=clock)
                steps = clock.steps()
                if steps and (best is None or np.median(steps) < np.median(best[0])):
                    best = (steps, clock.delta())
        steps, d = best
        calls = max(1, int(d["expert_calls"]))
        lm = d["layer_makespan_s"]
        sparse_total = sum(v[0] for v in lm.values())
        layer_calls = sum(v[1] for v in lm.values())
        tpot = float(np.median(steps)) if steps else 0.0
        sparse_per_step = sparse_total / max(1, len(steps))
        out = {
            "budget": budget,
            "all_experts_resident": budget >= want,
            "tokens": len(steps),
            "tpot_s": tpot,
            "compute_s_per_expert": float(d["time_s"]["compute"]) / calls,
            "layer_makespan_s": sparse_total / max(1, layer_calls),
            "sparse_s_per_step": sparse_per_step,
            "dense_s_per_token": max(0.0, tpot - sparse_per_step),
            "torch_threads": torch.get_num_threads(),
        }
        if budget >= want and layer_calls:
            # every expert whole: a layer's makespan is its computes plus the runtime's own work
            # around them (routing bookkeeping, cache touches, the hook): the per-layer overhead
            per_layer_experts = int(d["expert_calls"]) / layer_calls
            out["layer_overhead_s"] = max(0.0, out["layer_makespan_s"] - per_layer_experts * out["compute_s_per_expert"])
        try:  # optional: a profile without it plans with the costs measured alone
            # each pass twice, the faster kept: on a shared machine anything else only slows them
            # (the CPU box measured the all-miss layer at 14 and at 18 ms in two profiles)
            out["serving"] = min((miss_pass(model, rt, prompt, tokens=miss_tokens) for _ in range(2)),
                                 key=lambda p: p["layer_makespan_s"])
            out["serving_compressed"] = min((compressed_pass(model, rt, prompt, tokens=miss_tokens) for _ in range(2)),
                                            key=lambda p: p["layer_makespan_s"])
        except Exception as exc:  # noqa: BLE001
            out["serving_error"] = f"{type(exc).__name__}: {exc}"
        out["window"] = rt.window
        return out
    finally:
        try:
            model.zipmoe.fetcher.close()
        except Exception:  # noqa: BLE001
            pass
        torch.set_num_threads(old)
