#!/usr/bin/env bash
# The paper's tables on the CPU box (issue 17), the demo at 800M: throughput at batch 1, 4, 16
# and the ablation (32 new tokens), end-to-end latency for 32 / 128 / 512 new tokens (batch 1),
# zipmoe's engines beside llama.cpp. Run it alone on an otherwise idle machine:
#   bash benchmarks/cpu_tables.sh DEMO.zmoe DEMO_SOURCE_DIR [OUTDIR] [BUDGET]
# EXTRA: more bench options for every engine (the recorded run: EXTRA="--cgroup-slack 512M --context 1024")
set -uo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH" HF_HUB_OFFLINE=1
Z=$1; SRC=$2; O=${3:-out/cpu-tables}; B=${4:-800M}
mkdir -p "$O"
echo "== plan at $B (calibrated on benchmarks/prompts4.txt)  $(date -u +%H:%M:%S)"
zipmoe plan "$Z" --budget "$B" --calibrate benchmarks/prompts4.txt --calibrate-tokens 16 --device cpu -o "$O/plan-$B.json" | tail -4
common="--budget $B --runs 1 --cold --device cpu --source $SRC --plan $O/plan-$B.json --work-dir $O/work --time-limit 600 --json $O/demo-cpu.json --merge ${EXTRA:-}"
echo "== batch 1, 4, 16 x 32 new tokens: zipmoe, its ablations, llama.cpp  $(date -u +%H:%M:%S)"
zipmoe bench "$Z" --engine zipmoe --engine zipmoe-pools --engine zipmoe-basic --engine llama.cpp --batch 1,4,16 --new-tokens 32 $common 2>&1 | tail -25
echo "== batch 1 x 128, 512 new tokens: zipmoe, llama.cpp  $(date -u +%H:%M:%S)"
zipmoe bench "$Z" --engine zipmoe --engine llama.cpp --batch 1 --new-tokens 128,512 $common 2>&1 | tail -20
echo "== the paper's tables  $(date -u +%H:%M:%S)"
zipmoe bench --report "$O/demo-cpu.json" --paper --paper-json "$O/paper.json"
echo "== done $(date -u +%H:%M:%S)"
