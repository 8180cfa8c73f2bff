"""What the host pools' admission copies cost, from a GPU sitting's files, on a copy of its container.

    .venv/bin/python benchmarks/admission_check.py FILE.zmoe RESULTS_DIR [--budget 8G] [--admit-bw GiB/s ...]

The container is rebuilt here (synth is seeded and pack deterministic: the same container id
as on the lent machine), so the replay has the sitting's real tensor sizes. From RESULTS_DIR/work
(drive.sh's cache suite): the profile, the calibration trace and the bench JSON.

1. **Re-plan** at ``--budget`` with the sitting's profile and calibration, with the host pools'
   admissions charged at each ``--admit-bw`` (0: not charged, as before profile revision 4):
   the chosen plan, its prediction and the best mix found beside full tensors only.
2. **The served admission rate, estimated**: for every bench run with host pools, the
   calibration's routing replayed through a cache with that run's pools (and its slot arenas)
   gives the bytes admitted per decode step; the run's ``admit`` time beyond full tensors only's
   per fetched tensor, over those bytes times its decode steps, is the rate serving reached. An
   estimate: the run's own routing is not kept, the calibration's stands for it.

Only predictions and replays are made here; every measured figure is the sitting's own.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import numpy as np

from zipmoe.runtime.engine.counters import fetched_tensors

GiB = 1 << 30
MiB = 1 << 20


def _load(p: Path):
    return json.loads(p.read_text())


def main(argv=None) -> int:
    from zipmoe.codecs.reader import ContainerReader
    from zipmoe.runtime.engine.cache import aging_period
    from zipmoe.runtime.engine.settings import DEFAULT_AGE_TOKENS
    from zipmoe.runtime.plan.layout import container_layout, expert_tensors
    from zipmoe.runtime.plan.planner import make_plan
    from zipmoe.runtime.plan.replay import layer_calls_from_trace, replay
    from zipmoe.runtime.plan.stats import from_traces
    from zipmoe.units import parse_size

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("container")
    ap.add_argument("results")
    ap.add_argument("--budget", default="8G")
    ap.add_argument("--admit-bw", type=float, action="append", default=None, help="GiB/s (repeat; 0: not charged)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--other-container", action="store_true",
                    help="accept a container whose id differs (packed elsewhere from the same seeded synth: the same "
                         "tensors, sizes within bytes); the figures are then labelled as such")
    a = ap.parse_args(argv)
    work = Path(a.results) / "work"
    prof = _load(work / "qwen-profile.json")
    trace = str(work / "qwen-calib.jsonl")
    budget = parse_size(a.budget)
    with ContainerReader(a.container) as r:
        layout = container_layout(r, prof.get("dtype", "bfloat16"), a.device)
        cid = r.container_id
        ets = expert_tensors(r, compute_itemsize=layout.compute_itemsize)
    if cid != prof["container"]["container_id"] and a.other_container:
        print(f"# container {cid} packed here stands for the sitting's {prof['container']['container_id']} "
              f"({Path(a.container).stat().st_size} against {prof['container']['size']} bytes)")
        cid = prof["container"]["container_id"]
    elif cid != prof["container"]["container_id"]:
        raise SystemExit(f"{a.container} is not the sitting's container ({cid}, the profile's is "
                         f"{prof['container']['container_id']})")
    stats = from_traces([trace], container_id=cid, num_experts=layout.num_experts, top_k=layout.top_k,
                        layers=layout.sparse_layers)
    calls = layer_calls_from_trace([trace], layers=layout.sparse_layers)
    workers = int(prof.get("workers", 8))
    print(f"# {Path(a.results).name}: {a.budget}, {len(calls)} layer calls of calibration routing")

    # 1. re-plan with the admissions charged at each rate
    for bw in a.admit_bw if a.admit_bw is not None else [0.0, prof["costs"].get("admit_bw", 0.0) / GiB]:
        p = copy.deepcopy(prof)
        p["costs"]["admit_bw"] = bw * GiB
        plan = make_plan(layout, budget, stats, p, workers=workers, device=a.device, replay=(calls, ets))
        full = plan["alternatives"]["full only"]
        slots = {k: round(float(v), 2) for k, v in plan["slots"]["per_layer"].items() if float(v)}
        print(f"admit {bw:.2f} GiB/s: chosen {slots} predicted {1e3 * plan['expected_tpot_s']:.1f} ms "
              f"(admits {plan.get('expected_admit_bytes_per_token', 0) / MiB:.1f} MiB/token, "
              f"{1e3 * plan.get('expected_admit_s_per_token', 0):.2f} ms); full only {1e3 * full['expected_tpot_s']:.1f} ms")
        for line in plan["explain"]:
            if "mix" in line or "admit" in line or "predicted" in line:
                print("    " + line)

    # 2. the admission rate the bench runs with host pools reached (estimated on the calibration's routing)
    bench = _load(work / "qwen.json")
    base = None  # full tensors only's admit time per fetched tensor: the bookkeeping every offer costs
    runs = []
    for res in bench["results"]:
        for run in res["runs"]:
            c = run["counters"]
            fetched = fetched_tensors(c)
            rt = (res.get("load_info") or {}).get("runtime") or {}
            runs.append((res["engine"], run, c, fetched, rt))
            if res["engine"] == "zipmoe-basic":
                base = c["time_s"]["admit"] / max(1, fetched)
    age = aging_period(DEFAULT_AGE_TOKENS, layout.top_k, len(layout.units), len(layout.sparse_layers))
    for engine, run, c, fetched, rt in runs:
        pools = rt.get("pools") or {}
        if not any(int(pools.get(p, 0)) for p in ("compressed", "sm_only", "e_only")):
            continue
        arenas = {}
        for key, n in (rt.get("slots") or {}).items():  # "down [2048, 1408]": 148
            name, shape = key.split(" ", 1)
            arenas[(name, tuple(json.loads(shape)))] = int(n)
        res = replay(calls, ets, {k: int(v) for k, v in pools.items()}, age_every=age, slots=arenas or False)
        dec = res.decode
        per_step = float(res.admitted[dec].sum()) / max(1, dec.sum()) * len(layout.decode_layers)
        steps = int(run.get("generated", 0))
        extra = c["time_s"]["admit"] - (base or 0.0) * fetched
        prompts = max(1, int((~dec).sum()) // max(1, len(layout.sparse_layers)))
        total = per_step * steps + float(res.admitted[~dec].sum()) / prompts  # + what one prefill admits
        print(f"{engine}: admit {c['time_s']['admit']:.2f} s over {steps} tokens ({1e6 * c['time_s']['admit'] / max(1, fetched):.0f} us "
              f"per fetched tensor; full only {1e6 * (base or 0):.0f}); the calibration's routing with its pools admits "
              f"{per_step / MiB:.1f} MiB per decode step, so about {total / GiB:.2f} GiB in the run: "
              f"{total / max(1e-9, extra) / GiB:.2f} GiB/s served (estimate)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
