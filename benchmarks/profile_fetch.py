"""Host work per fetched expert tensor: where a fetched tensor's wall time goes besides the real work.

    .venv/bin/python benchmarks/profile_fetch.py [--work /tmp/pf] [--preset small] [--layers N]
        [--experts N] [--device cpu|cuda] [--workers 1] [--threads 1] [--steps 8] [--repeat 3]
        [--staged] [--served F] [--profile] [--json FILE]
    .venv/bin/python benchmarks/profile_fetch.py --compare-with /tmp/zmoe_before/site --rounds 3 [--after-path DIR] [...]

Builds (once, in ``--work``) a synthetic qwen2_moe checkpoint (``--preset``, fused layout; with
``--layers`` / ``--experts`` the preset's shapes with that many layers / experts), packs it
(zstd), loads it with a budget that holds every expert (``requirements(...)["budget_for"](1.0)``,
prefetch off, CUDA graphs off) and decodes ``--steps`` teacher-forced one-token steps (fixed random
ids) in two passes, as the planner's served passes do (runtime/plan/passes.py):

* ``compressed``: the runtime serves from a cache with only a compressed pool (``swap_cache``),
  warmed by one sweep of the same steps, so every chosen tensor is a compressed hit
  (decompress E, merge, compute, no read);
* ``miss``: the runtime's own cache cleared before every step: every chosen tensor is read,
  decompressed, merged, computed and admitted.
* ``served`` (``--served F``, e.g. 0.3): a second load whose only pool is a full pool holding the
  fraction F of the experts (a full-tensors-only plan; ``--served full=0.1,e_only=0.4``: a mix of
  pools, each this fraction of the experts' bf16 bytes), prefetch on, fresh random tokens every
  sweep after one sweep to fill the pool: misses, evictions, prefetches used and dropped, as in
  a served run whose disk binds (the host work bench's counters report, docs/benchmarks.md §22l).

Per fetched tensor (a compute tensor that was not a full-pool hit), from the runtime's counters
(``model.zipmoe.counters``, the delta over the timed steps; medians over ``--repeat`` sweeps):

* ``read``, ``decode``, ``merge`` (worker threads), ``compute`` (serving thread), ``wait``
  (serving thread blocked on the pipeline), ``admit`` (serving thread placing tensors in the pools);
* ``host``: the serving thread's own time in the fetch pipeline that is neither compute nor wait
  (lookup, placement, issue, admission, release, bookkeeping): ``layer makespans - wait -
  compute``; the counters' ``host`` stage, where the runtime has it, is the fetcher's direct
  measurement of the same thing (it leaves out the layer's trace and prediction);
* ``rest``: ``layer makespans - (read + decode + merge + compute)``, the planner's catch-all
  (``merge_overhead_s``: what the cost model lacks), host work plus hand-offs between threads
  and waits not covered by work (on a one-worker CPU run the work is mostly serial, so ``rest``
  is close to ``host`` + hand-off latency; with overlapping workers it can go below ``host``).

* ``host_counter`` taken apart (a second table): the runtime's ``counters.host_parts``
  (``lookup``, ``issue``, ``report``, ``to_device``, ``release``), ``admit`` and ``other`` (the
  rest of ``host_counter``: the loop's bookkeeping), where the tree has that split.

* ``host_cpu``: the serving thread's CPU time in ``Fetcher.run`` minus its CPU time in the
  compute (``time.thread_time``: waits for the GIL, a core or the pipeline cost nothing but the
  wake-ups; the steadiest figure on a shared machine).

``--staged`` (CPU only): the CUDA layout forced on the CPU, as tests/test_staging.py does: the
staging ring, the device merge at stage time and the full pool's slots, so that the serving
thread's share of them can be measured without a GPU.

``--profile``: one more sweep of each pass under cProfile and the top functions by self time
(``--sort cumtime``: by cumulative time; below Python 3.12 cProfile follows the thread that enables it, the serving thread; from 3.12 on
it sees every thread).

``--compare-with DIR``: run this script ``--rounds`` times alternately with ``PYTHONPATH=DIR``
(a copy of the package before a change: ``DIR/zipmoe/...``) and without (the installed tree),
in fresh processes, and print both medians side by side (the box is noisy: trust medians). The
order alternates by round (before first, then after first, ...): with an even ``--rounds`` each
side runs second as often as first.

CUDA (``--device cuda``): the same passes with ``torch.cuda.synchronize()`` around the timed
steps; the staging ring, the copy stream and the device merge are then in the figures.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from pathlib import Path

CATEGORIES = ("read", "decode", "merge", "compute", "wait", "admit", "host", "host_cpu", "rest")


def build(work: Path, preset: str, layers: int | None, experts: int | None) -> Path:
    from zipmoe.codecs.writer import pack
    from zipmoe.runtime import synth
    from zipmoe.runtime.synth.family import Preset
    from zipmoe.runtime.synth.registry import get_family

    fam = get_family("qwen2_moe")
    base = fam.presets[preset]
    name = preset
    cfg = dict(base.config)
    if layers:
        cfg["num_hidden_layers"] = layers
        name += f"-{layers}L"
    if experts:
        cfg["num_experts"] = experts
        name += f"-{experts}E"
    if name != preset:
        fam.presets[name] = Preset(name, cfg, f"{preset}, {layers or 'all'} layers, {experts or 'all'} experts")
    src, out = work / f"{name}-src", work / f"{name}.zmoe"
    if not out.exists():
        work.mkdir(parents=True, exist_ok=True)
        t = time.time()
        synth.write("qwen2_moe", src, preset=name, layout="fused", force=True, progress=False)
        print(f"synth {name}: {time.time() - t:.1f} s", file=sys.stderr, flush=True)
        t = time.time()
        tmp = out.with_suffix(".tmp.zmoe")
        pack(src, tmp, force=True)
        os.replace(tmp, out)
        print(f"pack (zstd): {time.time() - t:.1f} s", file=sys.stderr, flush=True)
    return out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _sweep(loop, first, tokens, before_step=None, device="cpu") -> None:
    """Prefill one token, then one step per token (teacher-forced: the same experts every sweep)."""
    loop.prefill(first)
    for t in tokens:
        if before_step is not None:
            before_step()
        loop.step(t)
    _sync(device)


def _timed(rt, loop, first, tokens, before_step, device, prof=None) -> dict:
    """The counters' delta over the decode steps of one sweep (the prefill left out)."""
    from zipmoe.runtime.engine.counters import delta

    loop.prefill(first)
    _sync(device)
    c0 = rt.counters.snapshot()
    cpu0 = (CPU.run, CPU.compute)
    t0 = time.perf_counter()
    if prof is not None:
        prof.enable()
    for t in tokens:
        if before_step is not None:
            before_step()
        loop.step(t)
    _sync(device)
    if prof is not None:
        prof.disable()
    d = delta(rt.counters.snapshot(), c0)
    d["wall_s"] = time.perf_counter() - t0
    d["_host_cpu_s"] = (CPU.run - cpu0[0]) - (CPU.compute - cpu0[1])
    return d


def per_tensor(d: dict) -> dict:
    """Microseconds per fetched tensor by category (module doc) from one counters delta."""
    fetched = sum(v for k, v in d["hits"].items() if k != "full")
    ts = d["time_s"]
    makespan = sum(v[0] for v in d["layer_makespan_s"].values())
    n = max(1, fetched)
    out = {k: 1e6 * ts.get(k, 0.0) / n for k in ("read", "decode", "merge", "compute", "wait", "admit", "stage")}
    out["host"] = 1e6 * (makespan - ts.get("wait", 0.0) - ts.get("compute", 0.0)) / n
    out["rest"] = 1e6 * (makespan - sum(ts.get(k, 0.0) for k in ("read", "decode", "merge", "compute"))) / n
    if "host" in ts:
        out["host_counter"] = 1e6 * ts["host"] / n
    # the runtime's own split of host_counter (counters.host_work computes the same, but this
    # script also runs against trees from before it: --compare-with)
    for k, v in (d.get("host_parts") or {}).items():
        out[f"host:{k}"] = 1e6 * v / n
    if "_host_cpu_s" in d:
        out["host_cpu"] = 1e6 * d["_host_cpu_s"] / n
    out["makespan"] = 1e6 * makespan / n
    out["fetched_per_step"] = fetched / max(1, d.get("_steps", 1))
    out["fetched"] = fetched
    out["fresh_buffers"] = d.get("fresh_buffers", 0)  # read buffers newly mapped (each unmapped again later)
    out["hits"] = dict(d["hits"])
    return out


class _ThreadCPU:
    """The serving thread's CPU seconds inside ``Fetcher.run`` and inside the experts' compute
    (``time.thread_time``: a thread waiting for the pipeline, for the GIL or for a core costs none,
    so the difference is the host work itself, whatever else runs on the machine)."""

    def __init__(self) -> None:
        self.run = 0.0
        self.compute = 0.0

    def install(self) -> None:
        from zipmoe.runtime.engine.fetcher import Fetcher

        orig = Fetcher.run
        me = self

        def run(fetcher, layer, experts, compute, predict=None):
            def timed_compute(e, w):
                t0 = time.thread_time()
                try:
                    return compute(e, w)
                finally:
                    me.compute += time.thread_time() - t0

            t0 = time.thread_time()
            try:
                return orig(fetcher, layer, experts, timed_compute, predict)
            finally:
                me.run += time.thread_time() - t0

        Fetcher.run = run


CPU = _ThreadCPU()


def _top(prof, n: int = 25, sort: str = "tottime") -> str:
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats(sort).print_stats(n)
    return s.getvalue()


def _force_staged(rt) -> None:
    """The CUDA layout on the CPU (as tests/test_staging.py forces it): the staging ring, the
    group's one buffer, the merge at stage time (synchronous here), and the working set counting
    as on CUDA (a fetch's own bytes without its bf16 output, the ring's bytes out of the window's
    idle room for read buffers: otherwise nearly every read maps a fresh buffer, which CUDA's
    full-tensors-only runs never do)."""
    from zipmoe.runtime.engine.staging import StagingRing

    rt.fetcher.device = rt.device_side(StagingRing(rt.window, rt.staging_slot_bytes, pin=False), device_merge=True)
    w = rt.working
    w.staged = True
    w.ring_bytes = rt.window * rt.staging_slot_bytes
    w.expert_working = rt.expert_working + rt.staging_slot_bytes  # as engine/core.py _sizes on CUDA
    w._bytes.clear()


def measure(a) -> dict:
    import torch

    import zipmoe
    from zipmoe.runtime.engine.cache import ExpertCache
    from zipmoe.runtime.engine.loader import requirements
    from zipmoe.runtime.engine.loop import DecodeLoop

    device = a.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    path = build(Path(a.work), a.preset, a.layers, a.experts)
    CPU.install()
    req = requirements(path, workers=a.workers, device=device)
    budget = req["budget_for"](1.0)
    extra = {"slots": True} if a.staged and not device.startswith("cuda") else {}  # the full pool in device slots, as on CUDA
    model, _ = zipmoe.load(path, budget=budget, device=device, workers=a.workers, threads=a.threads,
                           prefetch=False, **extra)
    rt = model.zipmoe
    if a.staged and not device.startswith("cuda"):
        # the CUDA layout on the CPU (as tests/test_staging.py forces it): the staging ring, the
        # group's one buffer, the merge at stage time (synchronous here)
        _force_staged(rt)
    loop = DecodeLoop(model, context=a.steps + 8, graphs="off")
    g = torch.Generator().manual_seed(a.seed)
    ids = torch.randint(0, model.config.vocab_size, (a.steps + 1,), generator=g)
    first = ids[:1][None].to(device)
    tokens = [ids[i : i + 1].to(device) for i in range(1, a.steps + 1)]
    result = {"device": device, "workers": a.workers, "threads": torch.get_num_threads(), "readers": rt.readers,
              "window": rt.window, "budget": budget, "path": str(path), "steps": a.steps, "passes": {},
              "engine": str(Path(sys.modules["zipmoe.runtime.engine.fetcher"].__file__).parent)}
    profiles = {}

    def measure(name: str, between) -> None:
        """``a.repeat`` timed passes (per-tensor figures), then one under cProfile with --profile."""
        runs = []
        for _ in range(a.repeat):
            d = _timed(rt, loop, first, tokens, between, device)
            d["_steps"] = a.steps
            runs.append(per_tensor(d))
        result["passes"][name] = runs
        if a.profile:
            prof = cProfile.Profile()
            _timed(rt, loop, first, tokens, between, device, prof)
            profiles[name] = _top(prof, a.top, a.sort)

    with torch.inference_mode():
        # compressed: a cache with only a compressed pool, warmed by one sweep of the same steps
        old = rt.swap_cache(ExpertCache({"compressed": rt.cache.capacity_bytes()}, demote=None))
        try:
            _sweep(loop, first, tokens, device=device)
            measure("compressed", None)
        finally:
            rt.swap_cache(old)
        # miss: the runtime's cache cleared before every step
        clear = rt.cache.clear
        _sweep(loop, first, tokens, clear, device)
        measure("miss", clear)
    rt.close()
    if a.served:
        measure_served(a, path, budget, extra, result, profiles)
    result["profiles"] = profiles
    return result


def served_pools(spec) -> dict:
    """``--served``: ``F`` (a full pool holding the fraction F of the experts' bf16 bytes, nothing
    else) or ``POOL=F,...`` (e.g. ``full=0.1,sm_only=0.1,e_only=0.4``: a mixed plan)."""
    pools = {"full": 0.0, "compressed": 0.0, "sm_only": 0.0, "e_only": 0.0}
    spec = str(spec)
    if "=" not in spec:
        pools["full"] = float(spec)
        return pools
    for part in spec.split(","):
        k, _, v = part.partition("=")
        if k.strip() not in pools:
            raise SystemExit(f"--served: unknown pool {k.strip()!r} (full, compressed, sm_only, e_only)")
        pools[k.strip()] = float(v)
    return pools


def measure_served(a, path, budget, extra, result, profiles) -> None:
    """The ``served`` pass: the full pool holding ``a.served`` of the experts' bf16 bytes (no
    other pool, as a full-tensors-only plan), prefetch on, fresh random tokens every sweep
    (after one sweep of others to fill the pool): admissions evict, prefetches are used and
    dropped, as in a served run whose disk binds (docs/benchmarks.md §22l)."""
    import torch

    import zipmoe
    from zipmoe.runtime.engine.loop import DecodeLoop

    probe, _ = zipmoe.load(path, budget=budget, device=a.device, workers=a.workers, threads=a.threads,
                           prefetch=False, **extra)
    full = probe.zipmoe.expert_bytes_full
    probe.zipmoe.close()
    del probe
    from zipmoe.codecs.reader import ContainerReader

    with ContainerReader(path) as r:
        cid = r.container_id
    plan = {"container_id": cid, "pools": {k: int(f * full) for k, f in served_pools(a.served).items()}}
    model, _ = zipmoe.load(path, budget=budget, device=a.device, workers=a.workers, threads=a.threads,
                           prefetch=True, plan=plan, **extra)
    rt = model.zipmoe
    if a.staged and not a.device.startswith("cuda"):
        _force_staged(rt)
    loop = DecodeLoop(model, context=a.steps + 8, graphs="off")
    g = torch.Generator().manual_seed(a.seed + 1)

    def fresh():
        ids = torch.randint(0, model.config.vocab_size, (a.steps + 1,), generator=g)
        return ids[:1][None].to(a.device), [ids[i : i + 1].to(a.device) for i in range(1, a.steps + 1)]

    runs = []
    with torch.inference_mode():
        _sweep(loop, *fresh(), device=a.device)
        for _ in range(a.repeat):
            d = _timed(rt, loop, *fresh(), None, a.device)
            d["_steps"] = a.steps
            runs.append(per_tensor(d))
        if a.profile:
            prof = cProfile.Profile()
            _timed(rt, loop, *fresh(), None, a.device, prof)
            profiles["served"] = _top(prof, a.top, a.sort)
    result["passes"]["served"] = runs
    result["served_fraction"] = a.served
    rt.close()


def medians(runs: list) -> dict:
    keys = [k for k in runs[0] if isinstance(runs[0][k], (int, float))]
    return {k: statistics.median(r[k] for r in runs if k in r) for k in keys}


def parts_table(rows: dict) -> str:
    """The runtime's split of ``host_counter`` (``counters.host_parts``, and ``admit``), µs per
    fetched tensor; ``other``: the rest of it (the loop's bookkeeping). Empty where the runtime
    has no such split (a tree before it)."""
    names = sorted({k.split(":", 1)[1] for m in rows.values() for k in m if k.startswith("host:")})
    if not names:
        return ""
    cols = names + ["admit", "other", "host_counter"]
    w = max(len(k) for k in rows) + 2
    head = "host_counter, taken apart".ljust(w) + "".join(c.rjust(13) for c in cols)
    lines = [head, "-" * len(head)]
    for label, m in rows.items():
        if not any(k.startswith("host:") for k in m):
            lines.append(label.ljust(w) + "  (no split in this tree)")
            continue
        known = sum(m.get(f"host:{c}", 0.0) for c in names) + m.get("admit", 0.0)
        vals = [m.get(f"host:{c}", 0.0) for c in names] + [m.get("admit", 0.0), m.get("host_counter", 0.0) - known,
                                                           m.get("host_counter", 0.0)]
        lines.append(label.ljust(w) + "".join(f"{v:13.1f}" for v in vals))
    return "\n".join(lines)


def table(rows: dict) -> str:
    """``rows``: {label: medians}; one line per label, µs per fetched tensor."""
    cols = list(CATEGORIES) + ["makespan"]
    have_hc = any("host_counter" in m for m in rows.values())
    if have_hc:
        cols.insert(cols.index("rest"), "host_counter")
    w = max(len(k) for k in rows) + 2
    head = "µs / fetched tensor".ljust(w) + "".join(c.rjust(10) for c in cols) + "  tensors/step"
    lines = [head, "-" * len(head)]
    for label, m in rows.items():
        cells = "".join((f"{m[c]:10.1f}" if c in m else " " * 9 + "-") for c in cols)
        lines.append(label.ljust(w) + cells + f"  {m.get('fetched_per_step', 0):.1f}")
    return "\n".join(lines)


def rounds_order(r: int) -> tuple:
    """Round ``r``'s order of the two sides: before first in even rounds, after first in odd ones."""
    return ("before", "after") if r % 2 == 0 else ("after", "before")


def compare(a, argv: list) -> int:
    """Alternate fresh processes: before (PYTHONPATH=--compare-with) and after (this tree)."""
    base = [a for a in argv if True]
    # drop the compare options from what the children get
    child, skip = [], False
    for x in base:
        if skip:
            skip = False
            continue
        if x in ("--compare-with", "--rounds", "--json", "--after-path"):
            skip = True
            continue
        if x.startswith(("--compare-with=", "--rounds=", "--json=", "--after-path=")):
            continue
        child.append(x)
    build(Path(a.work), a.preset, a.layers, a.experts)  # once, before any timing
    got = {"before": [], "after": []}
    profiles = {}
    for r in range(a.rounds):
        # ABBA: each side runs first in every other round, so that what the second process of a
        # round meets (on the H200 of docs/benchmarks.md §22m the unchanged compute was 4-20% slower
        # in the second process of each round) falls on both sides
        for label in rounds_order(r):
            env = dict(os.environ)
            rest = env.pop("PYTHONPATH", "")
            side = a.compare_with if label == "before" else a.after_path
            if side:
                env["PYTHONPATH"] = side + (os.pathsep + rest if rest else "")
            elif rest:
                env["PYTHONPATH"] = rest
            out = Path(a.work) / f"_{label}.json"
            cmd = [sys.executable, os.path.abspath(__file__), *child, "--json", str(out), "--quiet"]
            if a.profile and r > 0:
                cmd.remove("--profile")
            subprocess.run(cmd, check=True, env=env, cwd="/")
            res = json.loads(out.read_text())
            got[label].append(res)
            if res.get("profiles"):
                profiles[label] = res["profiles"]
            print(f"round {r + 1} {label}: " + ", ".join(
                f"{p} host {medians(v)['host']:.0f} host_cpu {medians(v)['host_cpu']:.0f} rest {medians(v)['rest']:.0f} µs"
                for p, v in res["passes"].items()), file=sys.stderr, flush=True)
    summary = {}
    for label, results in got.items():
        for p in results[0]["passes"]:
            runs = [x for res in results for x in res["passes"][p]]
            summary[f"{p} {label}"] = medians(runs)
    first = got["after"][0]
    print(f"device {first['device']}, workers {first['workers']}, torch threads {first['threads']}, "
          f"readers {first['readers']}, window {first['window']}, {first['steps']} steps x {a.repeat} sweeps "
          f"x {a.rounds} rounds per side; {first['path']}")
    print(table(summary))
    if parts_table(summary):
        print()
        print(parts_table(summary))
    for label, pr in profiles.items():
        for p, text in pr.items():
            print(f"\n--- serving thread, {p} pass, {label}: top functions by self time")
            print("\n".join(text.strip().splitlines()[:a.top + 8]))
    if a.json:
        Path(a.json).write_text(json.dumps({"summary": summary, "runs": got}, indent=1))
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default="/tmp/pf")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--experts", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--staged", action="store_true", help="on the CPU: the staging ring, the device merge and the full pool's slots as on CUDA")
    ap.add_argument("--served", default=None,
                    help="also the served pass: F (a full pool holding this fraction of the experts) or POOL=F,... "
                         "(a mix), prefetch on, fresh tokens")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--sort", default="tottime", choices=("tottime", "cumtime"),
                    help="--profile's order: self time (default) or cumulative time")
    ap.add_argument("--json", default=None)
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--compare-with", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--after-path", default=None, help="with --compare-with: PYTHONPATH of the 'after' side "
                    "(default: the environment's own, i.e. the installed tree)")
    a = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if a.compare_with:
        return compare(a, argv)
    res = measure(a)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    if a.quiet:
        return 0
    print(f"device {res['device']}, workers {res['workers']}, torch threads {res['threads']}, readers "
          f"{res['readers']}, window {res['window']}, {res['steps']} steps x {a.repeat} sweeps; engine {res['engine']}")
    rows = {p: medians(runs) for p, runs in res["passes"].items()}
    print(table(rows))
    if parts_table(rows):
        print()
        print(parts_table(rows))
    for p, text in res["profiles"].items():
        print(f"\n--- serving thread, {p} pass: top functions by self time")
        print("\n".join(text.strip().splitlines()[: a.top + 8]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
