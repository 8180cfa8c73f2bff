"""The demo model's plans measured on the H200 box (its CPU and its GPU), predicted again under
three rules for what serving adds to the costs measured alone.

    python benchmarks/replan_demo_checks.py [DEMO.zmoe] [RESULTS_DIR]

DEMO.zmoe (default out/demo.zmoe, from `just demo`) gives the container layout: `zipmoe synth
demo` is deterministic, so the local container holds the tensors the runs served (the script
checks the sizes the planner uses). RESULTS_DIR (default benchmarks/results) holds the folders
2026-11-30-h200-demo-cpu (the H200 box's CPU, and a first GPU machine) and
2026-11-30-h200-demo-gpu2 (a second GPU machine, profiles with the compressed pass): each
run's profiles, plans, calibration trace and `plan.check --json-out` rows; a plan measured
in several runs is compared with its median.

The rules, each fitted to the profile's all-miss serving pass (every chosen expert read):

* ``all-miss``: the profile's rule before the compressed pass (runtime.plan.fits'
  ``_serving_overheads_all_miss``): the reads' extra time per read, the rest per fetched tensor;
* ``reads only``: everything serving adds charged to reads (a per-read latency), nothing per
  fetched tensor;
* ``split``: the per-tensor overhead fitted where experts are compressed hits, the reads slowed
  (bandwidth) until the all-miss layer fits: runtime.plan.fits' rule with a compressed pass. The
  second GPU machine's profiles have that pass; the first folder's runs predate it, so there the
  "compressed only" plan's measured layer (1.4-1.8 compressed hits per layer, the rest misses)
  stands in for it, and that plan's row is in-sample.

Only the predictions are redone; every measured figure is the runs' own. Used in
docs/benchmarks.md section 7.
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from zipmoe.codecs.reader import ContainerReader
from zipmoe.errors import ZipmoeError
from zipmoe.runtime.plan.layout import container_layout
from zipmoe.runtime.plan.planner import Planner
from zipmoe.runtime.plan.stats import from_traces
from zipmoe.runtime.plan.fits import _serving_overheads_all_miss, fit_increase, serving_overheads
from zipmoe.runtime.plan.profile import costs_of
from zipmoe.runtime.plan.simulate import makespan_for_counts

FIRST, SECOND = "2026-11-30-h200-demo-cpu", "2026-11-30-h200-demo-gpu2"
RUNS = [  # (label, folder, device, plan, profile, checks): the plans each check measured, and the profile they are predicted with
    ("CPU (8 cores), 750M", FIRST, "cpu", "demo-plan-750M.json", "demo-profile.json", "demo-check-*-750M.json"),
    ("CPU (8 cores), 600M", FIRST, "cpu", "demo-plan-600M.json", "demo-profile.json", "demo-check-*-600M.json"),
    ("GPU, first machine, 600M", FIRST, "cuda", "demo-gpu-plan-600M.json", "demo-gpu-profile.json", "demo-gpu-check-600M.json"),
    ("GPU, second machine, 600M, profile b (measured just before)", SECOND, "cuda", "gpu-plan-600M-b.json",
     "gpu-profile-b.json", "gpu-check-600M-b.json"),
    ("GPU, second machine, 600M, profile a (2 minutes earlier)", SECOND, "cuda", "gpu-plan-600M-b.json",
     "gpu-profile-a.json", "gpu-check-600M-b.json"),
]


def costs_by_rule(rule: str, prof: dict, layout, workers: int, window: int, comp=None) -> dict:
    """The profile with its serving costs made by ``rule`` (see the module doc)."""
    p = copy.deepcopy(prof)
    c, s = p["costs"], p["runtime"]["serving"]
    c.update(disk_latency=p["disk"]["latency_s"], disk_bw=p["disk"]["bw"], merge_overhead_s=0.0)
    k, target = int(round(s["experts_per_layer"])), s["layer_makespan_s"] - c.get("layer_overhead_s", 0.0)
    if rule == "all-miss":
        c.update(_serving_overheads_all_miss(costs_of(p), layout.tensors, s, workers, window, c.get("layer_overhead_s", 0.0)))
    elif rule == "reads only":
        base = costs_of(p)
        c["disk_latency"] += fit_increase(
            lambda x: makespan_for_counts({"none": k}, layout.tensors, workers, replace(base, disk_latency=base.disk_latency + x), window),
            target, 0.05)
    elif p["runtime"].get("serving_compressed"):  # split, with the profile's own compressed pass
        c.update(serving_overheads(costs_of(p), layout.tensors, s, workers, window, c.get("layer_overhead_s", 0.0),
                                   p["runtime"]["serving_compressed"]))
    else:  # split, the compressed-only plan standing in for the pass: alternate the two fits (it has misses too)
        stats, slots, measured = comp
        bw0 = c["disk_bw"]
        for _ in range(6):
            base = costs_of(p)
            c["disk_bw"] = bw0 / (1 + fit_increase(
                lambda x: makespan_for_counts({"none": k}, layout.tensors, workers, replace(base, disk_bw=bw0 / (1 + x)), window),
                target, 100.0, steps=50))

            def layer(x: float) -> float:
                c["merge_overhead_s"] = x
                return Planner(layout, stats, p, workers, window).describe(slots)["expected_layer_makespan_s"]

            c["merge_overhead_s"] = fit_increase(layer, measured, 0.01, steps=30)
    return p


def main(container: Path, results: Path) -> None:
    with ContainerReader(container) as reader:
        layouts = {d: container_layout(reader, "bfloat16", d) for d in ("cpu", "cuda")}
    for label, folder, device, plan_f, prof_f, checks in RUNS:
        where = results / folder
        plan = json.loads((where / plan_f).read_text())
        layout = layouts[device]
        # the second machine packed the same tensors into a container of another id (its index
        # differs): the sizes the planner uses must agree
        if plan["slots"]["slot_bytes"] != layout.slot_bytes:
            sys.exit(f"replan_demo_checks: {container} is not the demo container these runs served")
        prof = json.loads((where / prof_f).read_text())
        stats = from_traces([where / "demo-calib.jsonl"], container_id=None, num_experts=layout.num_experts,
                            top_k=layout.top_k, layers=layout.sparse_layers)
        rows: dict[str, list[dict]] = {}
        for f in sorted(where.glob(checks)):
            for r in json.loads(f.read_text())["rows"]:
                rows.setdefault(r["plan"], []).append(r)
        slots = {n: plan["slots"]["per_layer"] if n == "chosen" else plan["alternatives"][n]["slots"] for n in rows}
        comp = None
        if "compressed only" in rows:
            comp = (stats, slots["compressed only"], statistics.median(r["measured_layer_s"] for r in rows["compressed only"]))
        print(f"== demo, {label} ({plan['workers']} workers; runs per plan: "
              + ", ".join(f"{n} {len(v)}" for n, v in rows.items()) + ")")
        print("   rule         disk (serving)          per tensor | predicted / measured (median) = measured / predicted")
        for rule in ("all-miss", "reads only", "split"):
            if rule == "split" and comp is None and not prof["runtime"].get("serving_compressed"):
                continue
            p = costs_by_rule(rule, prof, layout, plan["workers"], plan["window"], comp)
            planner = Planner(layout, stats, p, plan["workers"], plan["window"])
            c = p["costs"]
            cells = []
            for name, rs in rows.items():
                pred = planner.describe(slots[name])["expected_tpot_s"]
                m = statistics.median(r["measured_tpot_s"] for r in rs)
                cells.append(f"{name.replace(' only', '')} {1e3 * pred:.0f}/{1e3 * m:.0f}={m / pred:.2f}")
            print(f"   {rule:10} {c['disk_bw'] / 1e9:4.2f} GB/s + {1e6 * c['disk_latency']:4.0f} us  {1e6 * c['merge_overhead_s']:5.0f} us | "
                  + "  ".join(cells))
        print()

if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    container = Path(sys.argv[1]) if len(sys.argv) > 1 else here.parent / "out" / "demo.zmoe"
    results = Path(sys.argv[2]) if len(sys.argv) > 2 else here / "results"
    try:
        main(container, results)
    except ZipmoeError as exc:  # the container
        sys.exit(f"replan_demo_checks: error: {exc} (build the demo container with `just demo`)")
    except (OSError, ValueError, KeyError) as exc:  # the results
        what = f"{exc.filename}: {exc.strerror}" if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}"
        sys.exit(f"replan_demo_checks: error: {what} (RESULTS_DIR must hold the folders {FIRST} and {SECOND})")
