"""The H200 sitting's 8G plan made again on the CPU box, from the sitting's profile and calibration
(work/qwen-profile.json, work/qwen-calib.jsonl) and the same seeded synth container packed here
(`zipmoe synth qwen2_moe --preset qwen1.5-moe-a2.7b --layout fused`, `zipmoe pack`: the same
weights and sizes; its container id differs, since the id hashes the index and the index names the
source folder, `qwen-src` there, so the trace is read under this file's id), with the planner as it is now. `python replan.py QWEN.zmoe [BUDGET]`: prints the
choice, the single-pool plans and the arithmetic, and writes plan-8G-replanned.json beside it."""

import json
import sys
from pathlib import Path

from zipmoe.codecs.reader import ContainerReader
from zipmoe.runtime.plan.calibrate import read_recall
from zipmoe.runtime.plan.layout import container_layout, expert_tensors
from zipmoe.runtime.plan.planner import make_plan
from zipmoe.runtime.plan.replay import layer_calls_from_trace
from zipmoe.runtime.plan.stats import from_traces
from zipmoe.units import parse_size

here = Path(__file__).resolve().parent
path, budget = sys.argv[1], parse_size(sys.argv[2] if len(sys.argv) > 2 else "8G")
prof = json.loads((here / "work" / "qwen-profile.json").read_text())
trace = str(here / "work" / "qwen-calib.jsonl")
with ContainerReader(path) as reader:
    layout = container_layout(reader, prof.get("dtype", "bfloat16"), "cuda")
    ets = expert_tensors(reader, compute_itemsize=layout.compute_itemsize)
    cid = reader.container_id
if cid != prof["container"]["container_id"]:  # the trace's header names the sitting's container
    import tempfile

    lines = Path(trace).read_text().splitlines(keepends=True)
    head = json.loads(lines[0])
    head["container_id"] = cid
    tmp = tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False)
    tmp.write(json.dumps(head) + "\n" + "".join(lines[1:]))
    tmp.close()
    trace = tmp.name
    for ext in (".prefetch.json",):  # the calibration's prefetch recall, beside the trace
        side = here / "work" / ("qwen-calib.jsonl" + ext)
        if side.exists():
            Path(trace + ext).write_text(side.read_text())
stats = from_traces([trace], container_id=cid, num_experts=layout.num_experts, top_k=layout.top_k,
                    layers=layout.sparse_layers)
plan = make_plan(layout, budget, stats, prof, workers=int(prof["workers"]), device="cuda", profile_source="file",
                 prefetch_recall=read_recall([trace]), replay=(layer_calls_from_trace([trace], layers=layout.sparse_layers), ets))
print("chosen slots per layer:", {k: round(float(v), 2) for k, v in plan["slots"]["per_layer"].items()},
      f"predicted {1e3 * plan['expected_tpot_s']:.2f} ms")
for k, v in plan["alternatives"].items():
    print(f"  {k:18s} {1e3 * v['expected_tpot_s']:.2f} ms")
print("\n".join(plan["explain"]))
(here / f"plan-{sys.argv[2] if len(sys.argv) > 2 else '8G'}-replanned.json").write_text(json.dumps(plan, indent=2) + "\n")
