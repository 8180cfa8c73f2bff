"""How the planner's choice for qwen1.5-moe-a2.7b moves with the disk rate it is given.

    python benchmarks/planner_sensitivity.py [RESULTS_DIR]

Rebuilds the planner's inputs from a GPU run's plan.json and profile (default:
benchmarks/results/2026-11-30-h200-qwen): the container layout from the plan's sizes, every
sparse layer with the trace's mean rank distribution, and re-plans at 8G and 16G with the
profile's disk bandwidth replaced by slower figures (what the runtime's reads reached while
serving). The 2.66 GiB/s row reproduces the plan made on the machine. Used in
docs/benchmarks.md section 9 (ablations).
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import numpy as np

from zipmoe.runtime.plan.layout import ContainerLayout
from zipmoe.runtime.plan.planner import make_plan
from zipmoe.runtime.plan.stats import ActivationStats


def main(results: Path) -> None:
    plan = json.loads((results / "qwen-plan-8G.json").read_text())
    prof = json.loads((results / "qwen-profile.json").read_text())
    p = np.array(plan["trace"]["mean_rank_p"])
    p = p / p.sum()
    layers = list(range(plan["trace"]["sparse_layers"]))
    experts, k = plan["trace"]["num_experts"], plan["trace"]["top_k"]
    e_slot = plan["pools"]["e_only"] // (plan["slots"]["per_layer"]["e_only"] * len(layers))  # E bytes of one expert
    # qwen1.5-moe-a2.7b experts: gate_up [2816, 2048] and down [2048, 1408], bf16
    units = [("gate_up", (2816, 2048), 2 * 2816 * 2048, e_slot * 2 // 3, 2816 * 2048),
             ("down", (2048, 1408), 2 * 2048 * 1408, e_slot - e_slot * 2 // 3, 2048 * 1408)]
    full = sum(u[2] for u in units)
    workers = plan["workers"]
    scratch = workers * 2 * 2816 * 2048
    working = plan["min_budget"] - plan["dense_bytes"] - scratch
    layout = ContainerLayout(path=plan["container"], container_id=plan["container_id"], file_size=0,
                             num_layers=len(layers), num_experts=experts, top_k=k, sparse_layers=layers,
                             dense_bytes=plan["dense_bytes"], dense_matmul_bytes=plan["dense_bytes"], units=units,
                             expert_full_bytes=full, expert_working=working, max_segment=2816 * 2048,
                             total_expert_full=len(layers) * experts * full)
    stats = ActivationStats(container_id=plan["container_id"], num_experts=experts, top_k=k, layers=layers,
                            rank_p={layer: p for layer in layers}, source="trace", tokens=plan["trace"]["tokens"])
    measured = prof["costs"]["disk_bw"] / 2**30
    print("budget  disk GiB/s  chosen F·C·S·E  predicted TPOT  full only  compressed only")
    for budget in (8, 16):
        for bw in (measured, 2.0, 1.75, 1.5, 1.3):
            pr = copy.deepcopy(prof)
            pr["costs"]["disk_bw"] = bw * 2**30
            d = make_plan(layout, budget << 30, stats, pr, workers=workers, device=plan["device"])
            s = d["slots"]["per_layer"]
            alt = d["alternatives"]
            print(f"{budget:4d}G  {bw:10.2f}  {s['full']:>5}·{s['compressed']}·{s['sm_only']}·{s['e_only']:<4}"
                  f"  {1e3 * d['expected_tpot_s']:11.1f} ms  {1e3 * alt['full only']['expected_tpot_s']:6.1f} ms"
                  f"  {1e3 * alt['compressed only']['expected_tpot_s']:9.1f} ms")


if __name__ == "__main__":
    where = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "results" / "2026-11-30-h200-qwen"
    try:
        main(where)
    except (OSError, ValueError, KeyError) as exc:  # a wrong folder or another run's files: one line
        what = f"{exc.filename}: {exc.strerror}" if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}"
        sys.exit(f"planner_sensitivity: error: {what} (give a folder with qwen-plan-8G.json and qwen-profile.json)")
