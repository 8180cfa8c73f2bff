#!/usr/bin/env bash
# The CPU figures of docs/benchmarks.md, in one run on an otherwise idle machine.
#   bash benchmarks/cpu_figures.sh [OUTDIR]       (expects out/demo and out/demo.zmoe from `just demo`)
set -uo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH" HF_HUB_OFFLINE=1
O=${1:-out/figures}; mkdir -p "$O"
Q="What is the capital of France?"

echo "== runtime: demo model at budgets holding 100%, 50%, 20% of the experts"
for f in 1.0 0.5 0.2; do
  b=$(python -c "from zipmoe.runtime.engine.loader import requirements as r; print(r('out/demo.zmoe', dtype='auto')['budget_for']($f))")
  zipmoe chat out/demo.zmoe --budget "$b" --greedy --max-new-tokens 32 --prompt "$Q" --json > "$O/chat-$f.json"
  python - "$O/chat-$f.json" "$f" "$b" <<'PY'
import json, sys
d = json.load(open(sys.argv[1])); s = d["stats"]
print(f"fraction {sys.argv[2]} budget {int(sys.argv[3])/2**20:.0f} MiB: ttft {s['ttft_s']:.2f} s, tpot {s['tpot_s']*1e3:.0f} ms, "
      f"{s['tokens_per_s']:.2f} tok/s, read {s['bytes_read']/2**20:.1f} MiB, hits {s.get('hits')}, text {d['text'][:60]!r}")
PY
done

echo "== plan vs single-pool plans on the demo (measured against predicted)"
zipmoe plan out/demo.zmoe --budget 900M --calibrate builtin -o "$O/plan-900M.json" | tail -25
timeout 900 python -m zipmoe.runtime.plan.check out/demo.zmoe --plan "$O/plan-900M.json" --prompts builtin --alternatives | tail -25

echo "== bench: zipmoe vs accelerate vs uncompressed on the demo at 400M"
zipmoe bench out/demo.zmoe --baseline accelerate --baseline uncompressed --budget 400M --source out/demo \
  --new-tokens 16 --runs 1 --cold --json "$O/bench-demo.json" 2>&1 | tail -30

echo "== codecs on this machine (64 Mi values)"
python benchmarks/codecs.py --values 64M --repeat 3 | tail -18
