"""Served passes: decode steps through the runtime itself, one cache state at a time.

What a micro-benchmark cannot give (plan/profile.py says how each figure is used). Every pass
feeds the same teacher-forced token stream (runtime/plan/workload.py: natural text, so the
routing does not fall into the loop greedy decoding of a random-weight model falls into) through
the runtime's own decode loop (runtime/engine/loop.py ``DecodeLoop``: prefill, then one
``step`` per token, the device synchronised after each; an encoder-decoder, which the loop does
not serve, through ``model.generate``: :func:`_generate_stream`) and reads the step times and the
runtime's counters:

* ``resident``: every expert in the full pool (when that fits), sparse blocks from their CUDA
  graphs where the runtime has them: the step time with every chosen expert a full hit,
  ``T_resident``, and what the counters say of the expert compute and the time outside the
  sparse layers;
* ``full_host``: the same with every sparse block on the host path (``Runtime.sparse_graphs``
  off; on the CPU there are no graphs and this is ``resident`` again): what a layer costs when one
  of its experts is not a full hit and it leaves its graph;
* ``compressed``, ``sm_only``, ``e_only``: a cache with only that pool (as large as the runtime's
  pools) swapped in, a warm pass of the stream to admit every expert it uses, then the stream
  again, timed: every chosen expert in that state;
* ``none``: the cache emptied before every step: every chosen expert a miss (read, decompress,
  merge), with the runtime's prefetch setting (so with prefetch on these are prefetched misses);
* ``served`` (without CUDA graphs): a run at capacity, from an empty cache whose full pool holds
  a quarter of the experts, LFU evicting: the misses' costs are scaled so that the cost model charges
  this run's own routing what it took, net of the first touch of the memory its cache newly holds
  (:func:`served_miss_scale`, :func:`first_touch_s`). The passes above drop experts
  read moments before; a run's misses are experts evicted long before, and on the CPU box they
  cost 1.4-2.0x more (docs/benchmarks.md §22e).

:func:`state_step_costs` turns them into the planner's per-state costs: the time a sparse layer
adds over the resident step per expert in each state (runtime/plan/model.py, ``StepCosts``).
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import numpy as np

__all__ = ["measure_runtime", "runtime_for_passes", "resident_budget", "holds_every_expert", "state_pass", "served_pass", "served_miss_scale", "served_beta_fit", "state_step_costs", "forced_stream", "STATE_PASSES"]

#: the passes :func:`measure_runtime` serves, in order (``full_host`` only where graphs exist)
STATE_PASSES = ("resident", "full_host", "compressed", "sm_only", "e_only", "none")


def _mem_available() -> int:
    """Memory available to a new process (psutil: MemAvailable on Linux)."""
    import psutil

    try:
        return int(psutil.virtual_memory().available)
    except (OSError, RuntimeError):
        return 4 << 30


def forced_stream(tok, config: dict, steps: int, prompt_tokens: int = 16):
    """``(prompt [1, p] LongTensor, forced: list of ``steps`` token ids)``: the first passage of the
    bundled corpus, teacher-forced (the same stream for every pass and every plan check)."""
    import torch

    from zipmoe.runtime.plan.workload import teacher_forced

    prompts, forced = teacher_forced(tok, config, rows=1, prompt_tokens=prompt_tokens, new_tokens=steps)
    return torch.tensor([prompts[0]], dtype=torch.long), [int(t) for t in forced[0]]


def _pass_loop(model, rt, need: int, batch: int = 1):
    """The passes' decode loop of ``batch`` rows (kept on the runtime), at least ``need`` positions long."""
    from zipmoe.runtime.engine.loop import DecodeLoop

    name = "plan-pass" if batch == 1 else f"plan-pass-b{batch}"
    loop = rt.loops.get(name)
    if loop is None or loop.context < need:
        loop = rt.loops[name] = DecodeLoop(model, context=max(64, -(-need // 64) * 64), batch=batch)
    return loop


class _GenerateSteps:
    """``model.generate``'s streamer for the passes of an encoder-decoder: what
    :func:`_run_stream` does around each decode-loop step, done between generate's steps.
    ``generate`` puts the decoder's start ids once the encoder has run, then each step's new
    token: the first decoder step (the "prefill", its token the prompt's answer) runs between
    the first two puts, timed step ``i`` between puts ``i + 2`` and ``i + 3``."""

    def __init__(self, rt, steps: int, between_steps=None, routing: list | None = None) -> None:
        self.rt, self.want, self.between, self.routing = rt, steps, between_steps, routing
        self.log = rt.counters.log_uses if routing is not None else (lambda on: None)
        self.cuda = rt.device.type == "cuda"
        self.puts, self.t0, self.times, self.before = 0, 0.0, [], None

    def put(self, _value) -> None:
        import torch

        self.puts += 1
        if self.puts > 1:  # a decoder step has just ended
            if self.cuda:
                torch.cuda.synchronize()
            now = time.perf_counter()
            if self.puts == 2:
                self.before = self.rt.counters.snapshot()
            else:
                self.times.append(now - self.t0)
            if self.routing is not None:
                self.routing.append(list(self.log(False) or []))
        if self.puts >= 2 and len(self.times) >= self.want:
            return  # (generate's last put: no step follows)
        if self.puts >= 2 and self.between is not None:
            self.between()
        self.log(True)
        self.t0 = time.perf_counter()

    def end(self) -> None:
        self.log(False)


def _generate_stream(model, rt, prompt, forced, *, between_steps=None, routing: list | None = None) -> tuple[list[float], dict]:
    """:func:`_run_stream` for an encoder-decoder, which serves through ``model.generate`` (the
    encoder once, then the decoder per token): ``forced[i]`` is made the token of decoder step
    ``i + 1`` (``ForcedTokens``), so step ``i + 2``, timed step ``i``, is fed ``forced[i]`` as
    the decode loop's step would be. ``between_steps`` runs before each timed step."""
    import torch

    from zipmoe.runtime.engine.counters import delta
    from zipmoe.runtime.engine.loop import generate_ids

    rows: list[list[int]] = [[] for _ in range(int(prompt.shape[0]))]
    for t in forced:  # per step: an int (one row) or one per row
        for r, v in enumerate(t if isinstance(t, (list, tuple)) else [t]):
            rows[r].append(int(v))
    rows = [r + r[-1:] for r in rows]  # (the last timed step's own token, never fed)
    n = len(rows[0])
    clock = _GenerateSteps(rt, len(forced), between_steps, routing)
    ids = prompt.to(rt.device)
    with torch.inference_mode():
        generate_ids(model, ids, attention_mask=ids.new_ones(ids.shape), max_new_tokens=n, min_new_tokens=n,
                     streamer=clock, forced=rows)
    if clock.before is None:
        raise RuntimeError("model.generate ran no decoder step")
    return clock.times, delta(rt.counters.snapshot(), clock.before)


def _run_stream(model, rt, prompt, forced, *, between_steps=None, routing: list | None = None) -> tuple[list[float], dict]:
    """Prefill ``prompt`` (``[rows, p]``), then feed ``forced`` one token per step (an int, or a
    list of one per row) through the runtime's decode loop of that many rows; returns each step's
    wall time (device synchronised) and the counters' delta of the steps.
    ``routing``: a list that receives, per token (the prefill first), its layer calls
    ``(layer, experts)`` as bench records them (the counters' ``log_uses``). An encoder-decoder
    is served through ``model.generate`` instead (:func:`_generate_stream`)."""
    import torch

    from zipmoe.runtime.engine.counters import delta

    if getattr(model.config, "is_encoder_decoder", False):
        return _generate_stream(model, rt, prompt, forced, between_steps=between_steps, routing=routing)
    loop = _pass_loop(model, rt, int(prompt.shape[1]) + len(forced) + 1, batch=int(prompt.shape[0]))
    cuda = rt.device.type == "cuda"
    log = rt.counters.log_uses if routing is not None else (lambda on: None)
    with torch.inference_mode():
        log(True)
        loop.prefill(prompt.to(rt.device))
        if cuda:
            torch.cuda.synchronize()
        if routing is not None:
            routing.append(list(log(False) or []))
        before = rt.counters.snapshot()
        times = []
        for t in forced:
            if between_steps is not None:
                between_steps()
            log(True)
            t0 = time.perf_counter()
            loop.step(torch.tensor(t if isinstance(t, (list, tuple)) else [t], dtype=torch.long))
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            if routing is not None:
                routing.append(list(log(False) or []))
    return times, delta(rt.counters.snapshot(), before)


def _layer_figures(d: dict) -> dict:
    """A pass's mean sparse-layer makespan and experts per layer, from its counters' delta."""
    lm = d["layer_makespan_s"]
    layer_calls = max(1, sum(v[1] for v in lm.values()))
    return {"layer_makespan_s": sum(v[0] for v in lm.values()) / layer_calls,
            "experts_per_layer": int(d["expert_calls"]) / layer_calls,
            "sparse_layers_per_step": layer_calls,
            # read buffers mapped afresh (a page fault per 4 KiB on the readers): the β pass's
            # compressed pool keeps its misses' buffers and returns the dropped ones only within
            # the idle room, so it maps some where serving at capacity reuses evicted ones
            "fresh_buffers": int(d.get("fresh_buffers", 0))}


def state_pass(model, rt, state: str, prompt, forced) -> dict:
    """Serve ``forced`` with every chosen expert in ``state`` (one of :data:`STATE_PASSES`);
    returns the median step, the layer figures, the share of expert uses in that state and, for
    ``none``, the misses' reads (count, bytes, seconds)."""
    from zipmoe.runtime.engine.cache import ExpertCache

    between, old, graphs = None, None, rt.sparse_graphs
    try:
        if state == "full_host":
            rt.sparse_graphs = False
            _run_stream(model, rt, prompt, forced)  # warm (every expert it uses admitted)
        elif state in ("compressed", "sm_only", "e_only"):
            old = rt.swap_cache(ExpertCache({state: rt.cache.capacity_bytes()}, demote=None))
            _run_stream(model, rt, prompt, forced)  # warm: admits what the stream uses
        elif state == "none":
            between = rt.cache.clear
        else:  # resident
            _run_stream(model, rt, prompt, forced)
        times, d = _run_stream(model, rt, prompt, forced, between_steps=between)
    finally:
        if old is not None:
            rt.swap_cache(old)
        rt.sparse_graphs = graphs
    steps = len(times)
    uses = max(1, sum(d["hits"].values()))
    want = "full" if state in ("resident", "full_host") else state
    out = {
        "state": state,
        "steps": steps,
        "step_s": float(np.median(times)) if times else None,
        "step_s_all": [float(t) for t in times],
        **_layer_figures(d),
        "state_share": d["hits"].get(want, 0) / uses,
        "hits": dict(d["hits"]),
        "compute_s_per_expert": float(d["time_s"]["compute"]) / max(1, int(d["expert_calls"])),
    }
    sparse = sum(v[0] for v in d["layer_makespan_s"].values())
    if times:  # the time outside the sparse layers, per step
        out["dense_s_per_token"] = max(0.0, out["step_s"] - sparse / steps)
    if state == "none":
        reads, read_bytes, read_s = d["reads_by_state"].get("none", [0, 0, 0.0])
        out.update(reads=int(reads), read_bytes=int(read_bytes), read_s=float(read_s),
                   admit_s=float(d["time_s"]["admit"]), fetched=int(d["hits"].get("none", 0)),
                   merge_s=float(d["time_s"]["merge"]))
    if state == "compressed":
        out["compressed_share"] = out["state_share"]
    return out


def admit_pass(model, rt, prompt, forced, miss: dict | None = None) -> dict:
    """Every chosen expert a miss and every fetched tensor's SM half copied into a host pool: a
    cache with one SM-only pool as large as the runtime's pools, emptied before each step. The
    serving thread's admission time (counters ``admit``) beyond the all-miss pass's per fetched
    tensor (``miss``: its misses are admitted to the full pool, which the miss's measured cost
    already includes, so what a host pool adds is the difference), per byte the pool took: the
    rate ``costs.admit_bw`` charges a plan's host-pool copies at (the SM-only and E-only pools'
    admissions and demotions; the compressed pool keeps the read buffers and copies nothing,
    engine/adopt.py; docs/planner.md, "Admission copies"). Measured while serving, it includes
    what a copy alone does not: the serving thread's wait for the GIL that the decode workers
    and the readers share (on the H100 box the copy alone ran at 7.5 GiB/s, §22l).

    ``free_s``: the time emptying the pool took between the steps, recorded and not charged. A
    run at capacity frees an evicted tensor's bytes inside each admission, which this pass, whose
    pool starts every step empty, does not time."""
    from zipmoe.runtime.engine.cache import ExpertCache

    cache = ExpertCache({"sm_only": rt.cache.capacity_bytes()}, demote=None)
    base: list = []
    freed = {"s": 0.0, "bytes": 0}

    def between() -> None:
        held, t0 = cache.pools["sm_only"].used, time.perf_counter()
        cache.clear()
        if not base:  # what the prefill admitted (and freeing it) is not the steps'
            base.append(cache.admitted["sm_only"])
            return
        freed["s"] += time.perf_counter() - t0
        freed["bytes"] += held

    old = rt.swap_cache(cache)
    try:
        times, d = _run_stream(model, rt, prompt, forced, between_steps=between)
    finally:
        rt.swap_cache(old)
    admitted = cache.admitted["sm_only"] - (base[0] if base else 0)
    fetched = int(d["hits"].get("none", 0))
    admit_s = float(d["time_s"]["admit"])
    book = 0.0
    if miss and miss.get("fetched"):
        book = float(miss.get("admit_s", 0.0)) * fetched / int(miss["fetched"])
    copy_s = max(0.0, admit_s - book)
    return {"state": "every fetch's SM half copied", "steps": len(times),
            "step_s": float(np.median(times)) if times else None, "fetched": fetched,
            "admitted_bytes": int(admitted), "admit_s": admit_s, "miss_admit_s": book,
            "admit_bw": admitted / copy_s if admitted and copy_s > 0 else None,
            "free_s": freed["s"], "freed_bytes": int(freed["bytes"]),
            "admit_and_free_bw": (admitted / (copy_s + freed["s"] * admitted / freed["bytes"])
                                  if admitted and freed["bytes"] and copy_s + freed["s"] > 0 else None)}


def routing_of(model, rt, prompt, forced) -> list[list[tuple]]:
    """Per decode step of the stream (one row or several), its sparse layers' ``(layer,
    experts)`` (the teacher-forced stream routes the same way every time it is fed: the logits
    are bit-identical)."""
    routing: list = []
    _run_stream(model, rt, prompt, forced, routing=routing)
    return routing[1:]  # the prefill's calls first


def lone_miss_pass(model, rt, prompt, forced, misses: int = 1, rest: str | None = None) -> dict:
    """Every sparse layer with exactly ``misses`` of its chosen experts a miss, the others full
    hits: before each step, those experts (the highest ids the step's routing chose, known from a
    first pass) are dropped from a cache that holds every expert. A layer's fetches then cannot
    overlap each other as the all-miss pass's do: the latency of a lone fetch, not its share of
    a layer's throughput. ``rest="compressed"``: the others compressed hits instead (a cache of
    one compressed pool as large as the runtime's pools, holding every expert the stream uses):
    what a compressed hit adds beside misses (:func:`state_step_costs`, β); ``"sm_only"``,
    ``"e_only"``: the same with that host pool."""
    from zipmoe.runtime.engine.cache import ExpertCache

    routing = routing_of(model, rt, prompt, forced)
    graphs = rt.sparse_graphs
    steps = iter(routing)
    old = None

    def drop() -> None:
        for layer, experts in next(steps, []):
            for e in sorted(experts)[-misses:]:
                for t in rt.expert_tensors.get((layer, e), ()):
                    rt.cache.drop(t.uid)

    adopter = rt.fetcher.adopter
    try:
        if rest in ("compressed", "sm_only", "e_only"):
            old = rt.swap_cache(ExpertCache({rest: rt.cache.capacity_bytes()}, demote=None))
            # the pool copies its misses (timed in admit, taken out by state_step_costs) instead of
            # keeping their read buffers: it never evicts, so adopted buffers would not come back
            # and its misses would read into fresh mappings, which serving at capacity does not
            # (CPU box: 104 of 240 misses; docs/benchmarks.md §22q)
            adopter.enabled = False
        elif rest is not None:
            raise ValueError(f"rest: None, 'compressed', 'sm_only' or 'e_only', got {rest!r}")
        _run_stream(model, rt, prompt, forced)  # warm: every expert the stream uses admitted again
        times, d = _run_stream(model, rt, prompt, forced, between_steps=drop)
    finally:
        adopter.enabled = True
        if old is not None:
            rt.swap_cache(old)
        rt.sparse_graphs = graphs
    uses = max(1, sum(d["hits"].values()))
    out = {"state": f"{misses} miss per layer" + (f", the rest {rest}" if rest else ""), "misses_per_layer": misses,
           "steps": len(times), "step_s": float(np.median(times)) if times else None,
           "step_s_all": [float(t) for t in times], **_layer_figures(d),
           "miss_share": d["hits"].get("none", 0) / uses, "hits": dict(d["hits"]),
           "admit_s": float(d["time_s"]["admit"])}
    if rest:
        out["rest"], out["rest_share"] = rest, d["hits"].get(rest, 0) / uses
    return out


def served_pass(model, rt, prompt, forced, capacity: int, pool: str = "full") -> dict:
    """Serve ``forced`` from an empty cache whose one pool, ``pool``, holds ``capacity`` bytes
    (LFU eviction at capacity, as in a run at a budget that holds a part of the experts): the step
    times and the routing of every token, for :func:`served_miss_scale` (``pool="full"``: the
    runtime's own kind of cache) and :func:`served_beta_fit` (``pool="compressed"``: a cache of
    one compressed pool, as a compressed-only plan serves). Where the runtime has CUDA graphs a
    swapped cache runs every layer on the host path, which a full-pool run does not (so
    :func:`measure_runtime` serves the full pool only without graphs); a compressed-only run has
    no full hits and runs every layer on the host path anyway. The compressed pool's cache is
    made apart from the runtime's device slots, which stay hooked to the runtime's own cache."""
    from zipmoe.runtime.engine.cache import ExpertCache

    routing: list = []
    if pool == "full" and rt.slots is not None:
        # its cache would take the device slots over (``Runtime._new_cache`` attaches them) and
        # write its admissions into them, under the tensors the runtime's own cache holds there
        raise ValueError("a full-pool served pass needs a runtime without device slots (measure_runtime runs it only without graphs)")
    if pool == "full":
        cache = rt._new_cache({"full": int(capacity)})
    else:
        cache = ExpertCache({pool: int(capacity)}, demote=None, age_every=rt.cache.age_every)
    old = rt.swap_cache(cache)  # (swapping back runs the graphs again where the slots are still old's)
    try:
        times, d = _run_stream(model, rt, prompt, forced, routing=routing)
    finally:
        rt.swap_cache(old)
    return {"state": "served at capacity", "pool": pool, "capacity": int(capacity), "steps": len(times),
            "mean_step_s": float(np.mean(times)) if times else None, "step_s_all": [float(t) for t in times],
            "hits": dict(d["hits"]), "fresh_buffers": int(d.get("fresh_buffers", 0)), "routing": routing,
            "merge_s": float(d["time_s"]["merge"]), "fetched": int(d["hits"].get("none", 0))}


class _PoolsView:
    """What ``replay.model_run`` reads of a runtime, for a served pass's swapped cache."""

    def __init__(self, rt, capacity: int, pool: str = "full") -> None:
        self.top_k, self.expert_tensors, self.slots = rt.top_k, rt.expert_tensors, None
        self.pools = {pool: int(capacity)}
        self.cache = rt.cache  # its aging period is the served cache's (``Runtime._new_cache``)


def first_touch_s(served: dict, merge_s_per_fetch: float | None, workers: int = 1) -> float:
    """Seconds per step the served run's merges took beyond the all-miss pass's per fetched tensor,
    spread over the decode workers: the first touch of memory the run's cache had not held yet.
    The served run starts from an empty cache that its steps do not fill, so every tensor it admits
    is written into memory the process never touched (on the CPU, where a full tensor is a fresh
    allocation; page faults, about 1 ms per MiB on the CPU box: merge 4.7-7.5 ms per 4.5 MiB tensor
    against 0.3-0.6 ms in the passes, whose dropped tensors' memory is reused at once). A run whose
    cache is full reuses what it evicts and does not pay it (docs/benchmarks.md §27d); 0 without
    the figures."""
    steps, fetched = int(served.get("steps") or 0), int(served.get("fetched") or 0)
    if merge_s_per_fetch is None or served.get("merge_s") is None or steps <= 0:
        return 0.0
    return max(0.0, float(served["merge_s"]) - fetched * float(merge_s_per_fetch)) / max(1, int(workers)) / steps


def served_miss_scale(sc: dict, served: dict, rt, merge_s_per_fetch: float | None = None) -> dict | None:
    """Fit the miss cost to a served run. The cost model (``StepTable`` over the per-state costs
    ``sc``) charged for the served pass's own routing, replayed through the same cache
    (runtime/plan/replay.py ``model_run``: its hits are the run's), against the pass's measured
    mean step net of the first touch of fresh memory (:func:`first_touch_s`, with the all-miss
    pass's merge time per fetched tensor ``merge_s_per_fetch``):
    ``scale = (measured - first touch - resident) / (model - resident)``, the factor the misses'
    costs (``per_expert_s["none"]`` and the miss curve) take so that the model charges the run
    what it took. The passes that drop experts read moments before (``none``, ``misses_j``)
    measure a miss cheaper than a run whose misses are experts evicted long before (docs/
    benchmarks.md §22e: 1.4-2.0x on the CPU box); the served run is the serving path at capacity.
    Its first touches are not the misses' cost: fitted into them (profile revision 9 and before)
    they scaled SwitchTransformers' misses 3x on the CPU box, where runs with a full cache paid
    the passes' cost, and the planner chose E-only slots that lost 1.14-1.21x (§27d).
    Returns ``{"scale", "measured_step_s", "first_touch_s", "model_step_s", "capacity", "steps"}``
    or None when the run had no misses to fit or the model charges it nothing."""
    from zipmoe.runtime.plan.replay import model_run

    if not served.get("mean_step_s") or not served.get("routing"):
        return None
    m = model_run(served["routing"], _PoolsView(rt, served["capacity"]), {"step_costs": sc}, prefill_steps=1)
    if m is None:
        return None
    base = float(sc["resident_step_s"])
    touch = first_touch_s(served, merge_s_per_fetch, rt.workers)
    extra_model = float(m["model_tpot_s"]) - base
    extra_run = float(served["mean_step_s"]) - touch - base
    if extra_model <= 0 or m["model_hits"].get("none", 0.0) <= 0:
        return None
    return {"scale": max(0.5, min(3.0, extra_run / extra_model)), "measured_step_s": float(served["mean_step_s"]),
            "first_touch_s": touch, "model_step_s": float(m["model_tpot_s"]), "capacity": int(served["capacity"]),
            "steps": int(served["steps"]), "misses_per_layer_call": float(m["model_hits"]["none"])}


def scale_misses(sc: dict, scale: float) -> dict:
    """``sc`` with a miss's cost and the miss curve times ``scale`` (the other states unchanged)."""
    out = dict(sc, per_expert_s=dict(sc["per_expert_s"]))
    out["per_expert_s"]["none"] = float(sc["per_expert_s"]["none"]) * scale
    if sc.get("miss_curve_s"):
        out["miss_curve_s"] = {j: float(v) * scale for j, v in sc["miss_curve_s"].items()}
    return out


def served_beta_fit(sc: dict, served: dict, rt) -> dict | None:
    """Fit β, what a compressed hit adds to a layer beside disk-reading fetches, to a served run
    of one compressed pool at capacity (:func:`served_pass` with ``pool="compressed"``). The β
    pass drops the step's misses from a pool that holds every expert and serves them moments
    later; on an H100 it measured 2.62 ms per compressed hit where compressed-only runs at 8G
    implied about 0.7 (docs/benchmarks.md §22q), so the planner predicted compressed only 1.2x
    too slow and kept full tensors only, which ran 1.13x slower. The cost model (``StepTable``
    over ``sc``) is linear in β in such layers, so for the served run's own routing, replayed
    through the same pool (``replay.model_run``): ``β = (measured - model at β=0) / (compressed
    hits beside disk fetches per step)``, kept within 0 and twice the larger of the pass's β and
    a lone compressed hit's cost.

    Returns ``{"beta_s", "passes_beta_s", "measured_step_s", "model_step_s" (at the pass's β),
    "model_step_s_fitted", "beside_per_step", "capacity", "steps", "clamped"}`` or None without β,
    a run, or compressed hits beside fetches in it."""
    from zipmoe.runtime.plan.replay import model_run

    beta = sc.get("compressed_beside_misses_s")
    if beta is None or not served.get("mean_step_s") or not served.get("routing"):
        return None
    view = _PoolsView(rt, served["capacity"], served.get("pool", "compressed"))
    probe = max(float(beta), 1e-3)

    def charged(b: float) -> float | None:
        m = model_run(served["routing"], view, {"step_costs": dict(sc, compressed_beside_misses_s=b)}, prefill_steps=1)
        return None if m is None else float(m["model_tpot_s"])

    m0, m1 = charged(0.0), charged(probe)
    if m0 is None or m1 is None or m1 <= m0:
        return None
    beside = (m1 - m0) / probe  # compressed hits in layers with disk-reading fetches, per step
    measured = float(served["mean_step_s"])
    hi = 2.0 * max(float(beta), float(sc["per_expert_s"].get("compressed", 0.0)))
    raw = (measured - m0) / beside
    fitted = min(max(0.0, raw), hi)
    return {"beta_s": fitted, "passes_beta_s": float(beta), "measured_step_s": measured,
            "model_step_s": m0 + beside * float(beta), "model_step_s_fitted": m0 + beside * fitted,
            "beside_per_step": beside, "capacity": int(served["capacity"]), "steps": int(served["steps"]),
            "clamped": fitted != raw}


def state_step_costs(passes: dict, top_k: int, sparse_layers: int) -> dict | None:
    """The planner's per-state costs from the passes: for each state, the seconds one expert in
    that state adds to a decode step over ``resident`` (every expert a full hit, graphed where
    graphs exist), charged per sparse layer and per chosen expert:
    ``(step_s[state] - step_s[resident]) / (sparse_layers * top_k)``, never below 0.
    ``full`` is the host path's cost of a full hit (0 where there are no graphs). None when the
    resident pass or the miss pass is missing."""
    res = passes.get("resident") or {}
    if not res.get("step_s") or not (passes.get("none") or {}).get("step_s"):
        return None
    base = float(res["step_s"])
    per = max(1.0, int(sparse_layers) * float(top_k))  # (a batch's passes: the experts a layer call chose)
    out = {"resident_step_s": base, "graphs": bool(passes.get("graphs")), "per_expert_s": {}, "measured_share": {}}
    for state, name in (("full", "full_host"), ("compressed", "compressed"), ("sm_only", "sm_only"),
                        ("e_only", "e_only"), ("none", "none")):
        p = passes.get(name)
        if name == "full_host" and p is None:
            out["per_expert_s"]["full"] = 0.0
            out["measured_share"]["full"] = 1.0
            continue
        if not p or p.get("step_s") is None:
            continue
        out["per_expert_s"][state] = max(0.0, (float(p["step_s"]) - base) / per)
        out["measured_share"][state] = float(p.get("state_share", 0.0))
    # what a sparse layer with j misses (the rest full hits) adds to the resident step, j = 1..k
    curve = {}
    for key, p in passes.items():
        if key.startswith("misses_") and p and p.get("step_s") is not None:
            curve[int(p["misses_per_layer"])] = max(0.0, (float(p["step_s"]) - base) / max(1, int(sparse_layers)))
    if curve:
        out["miss_curve_s"] = {str(j): curve[j] for j in sorted(curve)}
    # β: what one compressed hit adds to a layer beside j misses (the pass with j misses and the
    # rest compressed hits, over the curve's j misses and the rest full hits), per compressed hit.
    # That pass's misses are admitted into its compressed pool, a copy on the serving thread the
    # planner charges apart (admit_bw): the admission time it spent beyond the curve's pass is
    # taken out first
    mixed = passes.get("compressed_beside_misses")
    k, L = int(round(float(top_k))), max(1, int(sparse_layers))
    if mixed and mixed.get("step_s") is not None and curve:
        j = int(mixed["misses_per_layer"])
        lone = passes.get(f"misses_{j}") or {}
        if j in curve and 0 < j < k:
            def admit_per_layer(p):
                return float(p.get("admit_s") or 0.0) / max(1, int(p.get("steps") or 1)) / L
            extra_admit = max(0.0, admit_per_layer(mixed) - admit_per_layer(lone))
            layer = max(0.0, (float(mixed["step_s"]) - base) / L - extra_admit)
            out["compressed_beside_misses_s"] = max(0.0, (layer - curve[j]) / (k - j))
            out["compressed_beside_misses_at"] = j
            out["compressed_beside_misses_admit_s"] = extra_admit
    return out


def miss_counts(k: int) -> list[int]:
    """The misses per layer the profile serves: every count up to 8, else 1, 2, k/2 and k."""
    return list(range(1, k + 1)) if k <= 8 else sorted({1, 2, k // 2, k})


def resident_pass(model, rt, prompt, stream) -> dict:
    """The resident pass twice, the one with the shorter median step kept: the dense time is
    mostly the host launching kernels, which anything else on the machine slows."""
    return min((state_pass(model, rt, "resident", prompt, stream) for _ in range(2)), key=lambda p: p["step_s"])


def host_state_passes(model, rt, prompt, stream, graphs: bool) -> dict:
    """The passes after the resident one, in STATE_PASSES order: ``full_host`` where graphs
    exist, then each fetched state (compressed, SM only, E only, every expert a miss)."""
    passes = {"full_host": state_pass(model, rt, "full_host", prompt, stream)} if graphs else {}
    for state in STATE_PASSES[2:]:
        passes[state] = state_pass(model, rt, state, prompt, stream)
    return passes


def resident_budget(path, layout, device: str, workers: int) -> int:
    """The budget whose full pool holds every expert whole, by the runtime's own arithmetic
    (runtime/engine/loader.py ``requirements`` on ``device``), with one expert's working bytes to
    spare for the slot arenas' rounding; never less than the layout's estimate. The layout counts
    what the runtime counts on CUDA too (layout.container_layout); the loader adds what a layout
    cannot see, the modules the model class keeps in float32.

    The layout's estimate without CUDA's rounding left the pools of DeepSeek-V2-Lite's shapes
    (8 layers) about 14 MB short of every expert on the GPU: its shared experts are 11 MiB
    tensors, each rounded to 12 MiB, 21 of them. The runtime then split the budget 60/40 between
    the full and compressed pools, and every "resident" pass of docs/benchmarks.md §27 and §27b
    served compressed hits and misses (1210 full, 118 compressed, 16 misses on the H100): the
    resident step, the base of every per-state cost, measured 62.7 ms where the graphed step
    takes a few."""
    from zipmoe.runtime.engine.loader import requirements

    estimate = layout.min_budget(workers) + layout.total_expert_full + (workers + 2) * layout.expert_working
    req = requirements(path, workers=workers, device=device, dtype=layout.dtype)
    return int(max(estimate, req["budget_for"](1.0) + layout.expert_working))


def holds_every_expert(rt) -> bool:
    """Whether ``rt``'s cache is one full pool that holds every expert tensor (in its device
    slots where it has them): what the resident pass and the miss curve's passes need."""
    if any(v for k, v in rt.pools.items() if k != "full") or rt.pools.get("full", 0) < rt.expert_bytes_full:
        return False
    if rt.slots is not None:
        return sum(a.slots for a in rt.slots.arenas.values()) >= sum(len(ts) for ts in rt.expert_tensors.values())
    return True


@contextmanager
def runtime_for_passes(path, layout, device: str, workers: int, load_options: dict | None = None):
    """The model the served passes run on, loaded at the budget they need: every expert whole
    (:func:`resident_budget`) when that fits in a quarter of the free memory, else as much as
    does. Yields ``(model,
    tokenizer, budget, want)`` (``want``: the budget that holds every expert); closes its fetcher
    and restores torch's thread count after."""
    import torch

    from zipmoe.machine import torch_threads
    from zipmoe.runtime.engine.loader import load
    from zipmoe.runtime.plan.calibrate import load_kwargs

    want = resident_budget(path, layout, device, workers)
    budget = int(max(layout.min_budget(workers) * 1.5, min(want, _mem_available() // 4)))
    old = torch.get_num_threads()
    model, tok = load(path, budget=budget, device=device, workers=workers, threads=torch_threads(workers),
                      **load_kwargs(layout.dtype), **(load_options or {}))
    try:
        yield model, tok, budget, want
    finally:
        try:
            model.zipmoe.fetcher.close()
        except Exception:  # noqa: BLE001
            pass
        torch.set_num_threads(old)


def measure_runtime(path, layout, device: str = "cpu", workers: int = 1, tokens: int = 16, warmup: int = 8,
                    miss_tokens: int = 8, load_options: dict | None = None, served_tokens: int = 64,
                    served_share: float = 0.25) -> dict:
    """Serve the teacher-forced stream through the runtime, once per cache state, and read its counters.

    The budget holds every expert when that fits in a quarter of the free memory, else as much
    as does (the state passes then hold what the pools can; ``state_share`` says how much of a
    pass was in its state). Gives what a micro-benchmark cannot: the expert compute as the
    runtime's hook does it (``compute_s_per_expert``: counters' compute time per expert call, on
    the host path), everything that is not a sparse layer (``dense_s_per_token``), the layer's
    own overhead with every expert resident, and per cache state the step it makes
    (``states``). ``load_options``: more keyword arguments of ``load`` (``readers``,
    ``prefetch``, ``force``).

    Without CUDA graphs, one more pass serves ``served_tokens`` of the stream from an empty cache
    whose full pool holds ``served_share`` of the experts (:func:`served_pass`), and the misses'
    costs are fitted to it (:func:`served_miss_scale`, ``step_costs["served_fit"]``). With β
    measured (graphs or not), one more serves it from a cache of one compressed pool holding
    ``served_share`` of the experts compressed, and β is fitted to it (:func:`served_beta_fit`, ``step_costs["beta_fit"]``).
    ``served_tokens=0`` skips both.
    """
    import torch

    with runtime_for_passes(path, layout, device, workers, load_options) as (model, tok, budget, want):
        rt = model.zipmoe
        resident = holds_every_expert(rt)
        cfg = model.config.to_dict() if hasattr(model.config, "to_dict") else {}
        prompt, forced = forced_stream(tok, cfg, warmup + tokens + 1)
        warm, timed = forced[:warmup], forced[warmup:warmup + tokens]
        graphs = rt.device.type == "cuda" and rt.slots is not None
        # the warm-up: every expert the stream uses admitted, the graphs captured
        _run_stream(model, rt, prompt, warm)
        best = resident_pass(model, rt, prompt, timed)
        passes = {"resident": best, "graphs": graphs}
        lm, k = best["layer_makespan_s"], best["experts_per_layer"]
        out = {
            "budget": budget,
            # (the runtime's pools as loaded, not the budget's arithmetic: holds_every_expert)
            "all_experts_resident": resident,
            "tokens": best["steps"],
            "tpot_s": best["step_s"],
            "compute_s_per_expert": best["compute_s_per_expert"],
            "layer_makespan_s": lm,
            "sparse_s_per_step": best["step_s"] - best["dense_s_per_token"],
            "dense_s_per_token": best["dense_s_per_token"],
            "torch_threads": torch.get_num_threads(),
            "workload": "corpus (teacher-forced" + (", model.generate: encoder-decoder)"
                                                    if getattr(model.config, "is_encoder_decoder", False) else ")"),
        }
        if resident and best["sparse_layers_per_step"]:
            # every expert whole: a layer's makespan is its computes plus the runtime's own work
            # around them (routing bookkeeping, cache touches, the hook): the per-layer overhead
            out["layer_overhead_s"] = max(0.0, lm - k * out["compute_s_per_expert"])
        try:  # optional: a profile without them plans with the costs measured alone
            stream = timed[:miss_tokens]
            if graphs:  # (its figures kept before the fetched states run: a failing one leaves them)
                passes["full_host"] = host = state_pass(model, rt, "full_host", prompt, stream)
                out["compute_s_per_expert"] = host["compute_s_per_expert"]  # the host path's (graphs count none)
                out["layer_overhead_s"] = max(0.0, host["layer_makespan_s"] - host["experts_per_layer"] * host["compute_s_per_expert"])
            passes.update(host_state_passes(model, rt, prompt, stream, graphs=False))
            passes["admit"] = admit_pass(model, rt, prompt, stream, passes["none"])
            if resident:  # every expert resident: j misses per layer, the others full hits
                for j in miss_counts(layout.top_k):
                    passes[f"misses_{j}"] = lone_miss_pass(model, rt, prompt, stream, j)
                if layout.top_k > 1:  # half of them misses, the others compressed hits (β)
                    try:  # optional: without it the planner counts such layers as before revision 5
                        passes["compressed_beside_misses"] = lone_miss_pass(model, rt, prompt, stream,
                                                                            layout.top_k // 2, rest="compressed")
                    except Exception as exc:  # noqa: BLE001
                        out["beside_error"] = f"{type(exc).__name__}: {exc}"
            out["states"] = passes
            # the older fits (schedule model, runtime/plan/fits.py) read these two
            out["serving"] = passes["none"]
            out["serving_compressed"] = passes["compressed"]
            sc = state_step_costs(passes, layout.top_k, len(layout.decode_layers))
            if sc is not None and not graphs and served_tokens > 0:
                # a run at capacity: a quarter of the experts whole, the misses evicted long before
                cap = int(served_share * min(rt.cache.capacity_bytes(), layout.total_expert_full))
                s_prompt, s_forced = forced_stream(tok, cfg, served_tokens)
                served = served_pass(model, rt, s_prompt, s_forced, cap)
                passes["served"] = {k: v for k, v in served.items() if k != "routing"}
                none = passes["none"]
                fit = served_miss_scale(sc, served, rt, none["merge_s"] / none["fetched"] if none.get("fetched") else None)
                if fit is not None:
                    fit["passes_miss_s"] = float(sc["per_expert_s"]["none"])
                    sc = scale_misses(sc, fit["scale"])
                    sc["served_fit"] = fit
            if sc is not None and served_tokens > 0 and sc.get("compressed_beside_misses_s") is not None:
                # β fitted to a run of one compressed pool at capacity holding ``served_share`` of
                # the experts compressed: most of its compressed hits are beside misses, as in the
                # budgets where a compressed pool is worth having (a pool holding nearly every
                # expert would put the error of layers of compressed hits alone into β)
                every = layout.slot_bytes["compressed"] * layout.num_experts * len(layout.decode_layers)
                cap = int(served_share * min(rt.cache.capacity_bytes(), every))
                s_prompt, s_forced = forced_stream(tok, cfg, served_tokens)
                served_c = served_pass(model, rt, s_prompt, s_forced, cap, pool="compressed")
                passes["served_compressed"] = {k: v for k, v in served_c.items() if k != "routing"}
                fit = served_beta_fit(sc, served_c, rt)
                if fit is not None:
                    sc = dict(sc, compressed_beside_misses_s=fit["beta_s"], beta_fit=fit)
            if sc is not None:
                out["step_costs"] = sc
        except Exception as exc:  # noqa: BLE001
            out["serving_error"] = f"{type(exc).__name__}: {exc}"
        out["window"] = rt.window
        return out
