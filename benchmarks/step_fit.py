"""What a served step costs, fitted on a real run, beside what the profile says it costs.

    .venv/bin/python benchmarks/step_fit.py out/demo.zmoe --budget 600M --budget 900M --budget 1200M
        [--profile profile.json] [--tokens 128] [--json FILE]

At each ``--budget``, one process each, one pool of full tensors (what the planner chose on
the CPU box), loaded as chat loads (its decode workers and torch threads, ``dtype="auto"``),
prefetch off: the bundled corpus teacher-forced (``--tokens`` decode steps) from a cold cache.
Per run: the mean step and the expert tensors missed per step (the runtime's hit counters).
Across the budgets, a least-squares line ``step = intercept + per_miss * misses``: what a step
costs with nothing to fetch and what each missed tensor adds, measured on the serving path
over whole runs. (Within one run the misses per step vary too little for a fit: the budgets
give the spread.) Beside it, the profile's figures (``--profile``: a ``zipmoe plan --profile``
file): the resident step its served pass measured, a miss per expert in its all-miss pass and
its miss curve. Where the two disagree the planner's predictions are off by as much
(docs/benchmarks.md §22e).
"""

from __future__ import annotations

import argparse
import json
import os


def run(path, budget, tokens: int = 128) -> dict:
    """One cold run at ``budget``: its mean step and missed tensors per step."""
    import numpy as np

    import zipmoe
    from zipmoe.machine import decode_workers, torch_threads
    from zipmoe.runtime.bench.engines import engine_plan
    from zipmoe.runtime.bench.engines import container_id as container_id_of
    from zipmoe.runtime.plan.passes import _run_stream, forced_stream

    w = decode_workers()
    plan = engine_plan("zipmoe-basic", None, container_id_of(path))  # bench's one pool of full tensors
    model, tok = zipmoe.load(path, budget=budget, device="cpu", plan=plan, workers=w, threads=torch_threads(w),
                             dtype="auto", prefetch=False)
    rt = model.zipmoe
    try:
        prompt, forced = forced_stream(tok, model.config.to_dict(), tokens)
        before = rt.counters.snapshot()["hits"]["none"]
        times, _ = _run_stream(model, rt, prompt, forced)
        misses = rt.counters.snapshot()["hits"]["none"] - before
        per_expert = max(1, len(next(iter(rt.expert_tensors.values()))))
    finally:
        rt.close()
    return {"budget": budget, "steps": len(times), "mean_step_s": float(np.mean(times)),
            "misses_per_step": misses / max(1, len(times)), "tensors_per_expert": per_expert}


def line(runs: list[dict]) -> dict | None:
    """Least squares ``mean step = intercept + per_miss * missed tensors per step`` over the runs."""
    import numpy as np

    if len(runs) < 2:
        return None
    x = np.array([r["misses_per_step"] for r in runs])
    y = np.array([r["mean_step_s"] for r in runs])
    slope, intercept = np.polyfit(x, y, 1)
    return {"intercept_s": float(intercept), "per_miss_tensor_s": float(slope),
            "per_miss_expert_s": float(slope) * runs[0]["tensors_per_expert"]}


def main() -> None:
    import subprocess
    import sys

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("container")
    ap.add_argument("--budget", action="append", required=True, help="repeat: one run per budget")
    ap.add_argument("--profile", default=None)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--json", default=None)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: one budget, JSON out
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.one:
        print(json.dumps(run(args.container, args.budget[0], args.tokens)))
        return
    runs = []
    for b in args.budget:  # each run in a fresh process (a cold cache, the memory given back)
        out = subprocess.run([sys.executable, __file__, args.container, "--budget", b, "--tokens", str(args.tokens), "--one"],
                             capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        runs.append(r)
        print(f"{b}: mean step {r['mean_step_s'] * 1e3:.1f} ms, {r['misses_per_step']:.1f} missed tensors per step")
    doc = {"runs": runs, "fit": line(runs)}
    if doc["fit"]:
        f = doc["fit"]
        print(f"fit over the budgets: {f['intercept_s'] * 1e3:.1f} ms with nothing to fetch + "
              f"{f['per_miss_tensor_s'] * 1e3:.2f} ms per missed tensor ({f['per_miss_expert_s'] * 1e3:.2f} ms per missed expert)")
    if args.profile:
        sc = json.load(open(args.profile)).get("step_costs") or {}
        doc["profile"] = sc
        if sc:
            curve = ", ".join(f"{j}: {v * 1e3:.2f}" for j, v in (sc.get("miss_curve_s") or {}).items())
            print(f"profile: resident step {sc['resident_step_s'] * 1e3:.1f} ms, a miss {sc['per_expert_s']['none'] * 1e3:.2f} "
                  f"ms per expert (all-miss pass), miss curve per layer {{{curve}}} ms")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=2)


if __name__ == "__main__":
    main()
