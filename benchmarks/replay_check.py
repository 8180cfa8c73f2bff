"""How well each hit model predicts a cold run: serve the corpus stream from load under a plan and
set the run's misses beside the replays' and the rank model's (docs/benchmarks.md §22d).

    .venv/bin/python benchmarks/replay_check.py FILE.zmoe --plan PLAN.json --trace CALIB.jsonl [--tokens 128]
        [--device cpu] [--workers 1] [--prefetch]

One process: ``zipmoe.load(FILE, plan=PLAN)``, the first corpus passage teacher-forced for
``--tokens`` decode steps with the runtime's layer calls logged; then the runtime's hit counters
against a replay of those very calls with its pools (runtime/plan/replay.py: they should agree),
and chosen experts per decode layer call in each state: the run's (from the replay of its own
routing, which reproduces its counters), the calibration's replay from an empty cache and a
second time (warm), and the plan's rank model (plan.json ``rank_model``, or its
``expected_hits`` for a plan made without a replay).
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("container")
    ap.add_argument("--plan", required=True)
    ap.add_argument("--trace", required=True, help="the calibration trace the plan was made from")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--prefetch", action="store_true")
    a = ap.parse_args(argv)

    from zipmoe.machine import torch_threads
    from zipmoe.runtime.engine.loader import load
    from zipmoe.runtime.engine.states import STATES
    from zipmoe.runtime.plan import replay as R
    from zipmoe.runtime.plan.passes import _run_stream, forced_stream

    plan = json.load(open(a.plan, encoding="utf-8"))
    model, tok = load(a.container, budget=plan["budget"], device=a.device, plan=plan, workers=a.workers,
                      threads=torch_threads(a.workers), prefetch=a.prefetch, dtype=plan.get("dtype", "bfloat16"))
    rt = model.zipmoe
    prompt, forced = forced_stream(tok, model.config.to_dict(), a.tokens, prompt_tokens=32)
    rt.counters.log_uses(True)
    times, _ = _run_stream(model, rt, prompt, forced)
    log = rt.counters.log_uses(False)
    n = len(rt.sparse_layers)
    calls = [R.LayerCall(int(layer), tuple(sorted(ex)), i >= n) for i, (layer, ex) in enumerate(log)]
    slots = {k: ar.slots for k, ar in rt.slots.arenas.items()} if rt.slots is not None else False
    own = R.replay(calls, rt.expert_tensors, rt.pools, age_every=rt.cache.age_every, slots=slots)
    print(f"run: {a.tokens} steps, median {1e3 * float(np.median(times)):.1f} ms, mean {1e3 * float(np.mean(times)):.1f} ms")
    print("tensor hits, the runtime's counters:", dict(rt.counters.hits))
    print("tensor hits, the replay of its calls:", dict(zip(STATES, own.tensor_hits.sum(axis=0).tolist())))
    cal = R.layer_calls_from_trace([a.trace], layers=rt.sparse_layers)
    both = R.replay(cal + cal, rt.expert_tensors, plan["pools"], age_every=rt.cache.age_every,
                    slots=bool(slots))
    m = len(cal)
    rows = [("the run (its own routing replayed)", own.hits_per_layer(True)),
            ("the calibration replayed, cold", both.counts[:m][both.decode[:m]].mean(axis=0)),
            ("the calibration replayed, warm", both.counts[m:][both.decode[m:]].mean(axis=0))]
    rank = (plan.get("rank_model") or plan).get("expected_hits") or {}
    rows.append(("the rank model (steady state)", np.array([rank.get(s, 0.0) for s in STATES])))
    print("chosen experts per decode layer call, " + " · ".join(STATES))
    for name, h in rows:
        print(f"  {name:36s} " + " · ".join(f"{x:.2f}" for x in h))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
