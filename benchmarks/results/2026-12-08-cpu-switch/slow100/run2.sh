#!/usr/bin/env bash
# The same cap: compressed only (`zipmoe plan --only compressed`) against zipmoe-basic at 300M and
# 600M, two paired rounds (what the planner passed over, measured beside full tensors only).
set -x
Z=/work/main/.venv/bin/zipmoe; H=$(cd "$(dirname "$0")" && pwd); W=${W:-/tmp/swb}; D=$W/sw.zmoe
S="bash /work/main/benchmarks/slow_disk.sh -f $D ${RATE:-100M} --"
export HF_HUB_OFFLINE=1
cd $W
C="--runs 1 --rounds 2 --cold --workload corpus --device cpu --cgroup-slack 1G --profile $H/profile.json --batch 1 --new-tokens 128"
for B in ${BUDGETS:-300M 600M}; do
  $Z plan $D --budget $B --trace $H/../calib.jsonl --profile $H/profile.json --device cpu --only compressed -o $H/plan-$B-compressed.json
  $S $Z bench $D --engine zipmoe --engine zipmoe-basic --plan $H/plan-$B-compressed.json --budget $B $C --work-dir $W/s100c-$B --json $H/b1-$B-compressed.json
done
echo SLOW2-DONE
