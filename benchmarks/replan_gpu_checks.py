"""The planner's predictions for the plans measured on the GPU, made again with today's model.

    python benchmarks/replan_gpu_checks.py [RESULTS_DIR]

For each model of a GPU planner run (default: benchmarks/results/2026-11-30-h200-planner/machineD,
qwen1.5-moe-a2.7b at 8G and olmoe-1b-7b at 4G), from the files that run kept: the plan.json
(its sizes, budget and the profile measured there), the calibration trace and the
`plan.check --json-out` rows (measured TPOT and hits of the chosen plan and of "full
only"). The container layout is rebuilt from the plan's sizes and the presets' shapes (the
containers themselves stay on the lent machine), the activation statistics come from the trace
with the current `plan.stats` rules, and the planner then

1. predicts again each plan that was measured (same slots), to compare with the measurement;
2. plans again at the same budget, to show what it would choose now;
3. cross-checks what the profile's serving pass adds (``runtime.plan.fits.serving_overheads``,
   which these runs predate): the per-read and per-tensor overheads are fitted on one measured
   plan's counters and layer time, and the *other* plan is predicted with them.

Only the prediction is redone; every measured figure is the run's own. Used in
docs/benchmarks.md section 7.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

from zipmoe.runtime.plan.layout import ContainerLayout
from zipmoe.runtime.plan.planner import Planner, make_plan
from zipmoe.runtime.plan.stats import from_traces
from zipmoe.runtime.plan.fits import fit_increase, serving_overheads, serving_read_latency
from zipmoe.runtime.plan.profile import costs_of
from zipmoe.runtime.engine.states import STATES

KEY = "merge_overhead_s"  # the cost the serving figure is fitted into (runtime.plan.fits.serving_overheads)
SHARD = 1 << 20  # exponent bytes per stored E chunk (pack's default shard size, one byte per value)
# compute tensors of one expert (rows, cols) of the synth presets the GPU runs used
SHAPES = {
    "qwen": {"gate_up": (2 * 1408, 2048), "down": (2048, 1408)},  # qwen1.5-moe-a2.7b
    "olmoe": {"gate_up": (2 * 1024, 2048), "down": (2048, 1024)},  # olmoe-1b-7b
}


def layout_of(plan: dict, shapes: dict) -> ContainerLayout:
    sl = plan["slots"]
    layers = list(range(sl["sparse_layers"]))
    numel = {n: r * c for n, (r, c) in shapes.items()}
    total = sum(numel.values())
    e_slot = sl["slot_bytes"]["e_only"]  # E bytes of one expert, as stored
    units, e_left = [], e_slot
    for i, (name, shape) in enumerate(shapes.items()):
        e = e_left if i == len(shapes) - 1 else e_slot * numel[name] // total
        e_left -= e
        units.append((name, shape, 2 * numel[name], e, numel[name]))
    scratch = plan["workers"] * 2 * max(numel.values())
    chunks = [-(-numel[n] // SHARD) for n in shapes]  # `zipmoe pack` stores E in 1 MiB shards
    return ContainerLayout(chunks=chunks, path=plan["container"], container_id=plan["container_id"], file_size=0,
                           num_layers=len(layers), num_experts=sl["experts_per_layer"], top_k=sl["top_k"],
                           sparse_layers=layers, dense_bytes=plan["dense_bytes"], dense_matmul_bytes=plan["dense_bytes"],
                           units=units, expert_full_bytes=2 * total,
                           expert_working=plan["min_budget"] - plan["dense_bytes"] - scratch,
                           max_segment=max(numel.values()), total_expert_full=len(layers) * sl["experts_per_layer"] * 2 * total)


def fit_serving(layout, stats, prof: dict, plan: dict, row: dict, slots: dict) -> dict:
    """The profile with the serving figures fitted to one measured plan, by the rule of the
    profile's serving pass (``runtime.plan.fits.serving_overheads``): ``disk_latency`` from its
    reads' time beyond latency + bytes / bw, then ``merge_overhead_s``, per fetched tensor
    (bisection), so that the predicted layer makespan is the measured one."""
    reads = row["counters"]["reads_by_state"].values()
    out = copy.deepcopy(prof)
    out["costs"]["disk_latency"] = serving_read_latency(costs_of(prof), *(sum(r[i] for r in reads) for i in range(3)))

    def layer(x: float) -> float:
        out["costs"][KEY] = x
        return Planner(layout, stats, out, plan["workers"], plan["window"]).describe(slots)["expected_layer_makespan_s"]

    out["costs"][KEY] = fit_increase(layer, row["measured_layer_s"], 0.02, steps=25)
    return out


def load_run(results: Path, tag: str, budget: str):
    """A run's plan, profile and planner-check rows, the layout rebuilt, the trace's statistics."""
    plan = json.loads((results / f"{tag}-plan-{budget}.json").read_text())
    prof = json.loads((results / f"{tag}-profile.json").read_text())
    check = json.loads(next(results.glob(f"{tag}-planner-check*-{budget}.json")).read_text())
    layout = layout_of(plan, SHAPES[tag])
    stats = from_traces([results / f"{tag}-calib-trace.jsonl"], container_id=plan["container_id"],
                        num_experts=layout.num_experts, top_k=layout.top_k, layers=layout.sparse_layers)
    return plan, prof, check, layout, stats


def slots_of(plan: dict, name: str) -> dict:
    """The slots of the plan a planner-check row measured (the chosen one or an alternative)."""
    return plan["slots"]["per_layer"] if name == "chosen" else plan["alternatives"][name]["slots"]


def compare(planner: Planner, plan: dict, check: dict) -> None:
    """Each measured plan: the run's prediction, today's, the measurement, and the hits."""
    print(f"{'plan':10} {'F·C·S·E':>9}  {'run predicted':>13}  {'now predicted':>13}  {'measured':>9}  {'meas/now':>8}"
          f"  hits F·C·S·E·miss: run predicted | now predicted | measured")
    for row in check["rows"]:
        slots = slots_of(plan, row["plan"])
        now = planner.describe(slots)
        m = row["measured_tpot_s"]
        print(f"{row['plan']:10} {'·'.join(str(slots[p]) for p in STATES[:4]):>9}  {1e3 * row['predicted_tpot_s']:10.1f} ms"
              f"  {1e3 * now['expected_tpot_s']:10.1f} ms  {1e3 * m:6.1f} ms  {m / now['expected_tpot_s']:8.2f}"
              f"  {hits(row['predicted_hits'])} | {hits(now['expected_hits'])} | {hits(row['measured_hits'])}")


def replan(label: str, layout, stats, prof: dict, plan: dict) -> None:
    """Plan again at the run's budget with ``prof``; print the choice against the best single pool."""
    d = make_plan(layout, plan["budget"], stats, prof, workers=plan["workers"], device=plan["device"])
    s = d["slots"]["per_layer"]
    singles = {k: v["expected_tpot_s"] for k, v in d["alternatives"].items() if k != "no cache"}
    best = min(singles, key=singles.get)
    print(f"{label}: {'·'.join(str(s[p]) for p in STATES[:4])}, predicted {1e3 * d['expected_tpot_s']:.1f} ms; "
          f"best single pool {best} {1e3 * singles[best]:.1f} ms ({singles[best] / d['expected_tpot_s']:.2f}x)")


def hits(h: dict) -> str:
    return "·".join(f"{h[s]:.2f}" for s in STATES)


def fresh_run(results: Path) -> None:
    """The run made with the serving pass (machine E): its profile's serving figures turned into
    costs by today's rule, the measured plans predicted again, and the budget planned again."""
    plan, prof, check, layout, stats = load_run(results, "olmoe", "4G")
    prof["costs"]["disk_latency"] = prof["disk"]["latency_s"]  # as measured alone
    prof["costs"].pop("merge_overhead_s", None)
    prof["costs"].update(serving_overheads(costs_of(prof), layout.tensors, prof["runtime"]["serving"], plan["workers"],
                                           prof["runtime"].get("window"), prof["costs"].get("layer_overhead_s", 0.0)))
    planner = Planner(layout, stats, prof, plan["workers"], plan["window"])
    print(f"== olmoe at 4G, fresh run (serving pass by today's rule: +{1e6 * (prof['costs']['disk_latency'] - prof['disk']['latency_s']):.0f} us"
          f" per read, {1e6 * prof['costs']['merge_overhead_s']:.0f} us per fetched tensor)")
    compare(planner, plan, check)
    replan("re-planned", layout, stats, prof, plan)
    for name, alt in plan["alternatives"].items():
        print(f"  {name:16} {1e3 * planner.describe(alt['slots'])['expected_tpot_s']:7.1f} ms now (the run predicted {1e3 * alt['expected_tpot_s']:.1f} ms)")


def main(results: Path) -> None:
    for tag, budget in (("qwen", "8G"), ("olmoe", "4G")):
        plan, prof, check, layout, stats = load_run(results, tag, budget)
        planner = Planner(layout, stats, prof, plan["workers"], plan["window"])
        print(f"== {tag} at {budget} (statistics: {stats.basis}, {stats.decode_steps} decode steps; "
              f"dense {1e3 * planner.dense_s:.1f} ms per token as profiled)")
        compare(planner, plan, check)
        replan("re-planned", layout, stats, prof, plan)
        rows = {r["plan"]: r for r in check["rows"]}
        for fit, other in ((a, b) for a in rows for b in rows if a != b):
            fp = fit_serving(layout, stats, prof, plan, rows[fit], slots_of(plan, fit))
            pred = Planner(layout, stats, fp, plan["workers"], plan["window"]).describe(slots_of(plan, other))
            m = rows[other]["measured_tpot_s"]
            print(f"serving figures fitted on {fit!r} (+{1e6 * (fp['costs']['disk_latency'] - prof['costs']['disk_latency']):.0f} us"
                  f" per read, {1e6 * fp['costs'][KEY]:.0f} us per fetched tensor): {other!r} predicted"
                  f" {1e3 * pred['expected_tpot_s']:.1f} ms, measured {1e3 * m:.1f} ms ({m / pred['expected_tpot_s']:.2f})")
            replan("  re-planned with them", layout, stats, fp, plan)
        print()


if __name__ == "__main__":
    base = Path(__file__).parent / "results" / "2026-11-30-h200-planner"
    where = Path(sys.argv[1]) if len(sys.argv) > 1 else base / "machineD"
    try:
        main(where)
        if len(sys.argv) == 1:
            fresh_run(base / "machineE")
    except (OSError, ValueError, KeyError, StopIteration) as exc:  # a wrong folder: one line
        what = f"{exc.filename}: {exc.strerror}" if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}"
        sys.exit(f"replan_gpu_checks: error: {what} (give a folder with <model>-plan-<budget>.json, "
                 "<model>-profile.json, <model>-calib-trace.jsonl and the planner-check JSON)")
