#!/usr/bin/env bash
# The demo (float32) on the CPU box after profile revision 10 (the served fit net of first touches,
# docs/benchmarks.md §27d): was the demo's plan choice of §22p kept? A fresh profile measured alone,
# one calibration, the plan at 300M, 500M and 800M, then at each the plan against full tensors only
# (zipmoe-basic), 128 tokens of the corpus, cold, batch 1, two paired rounds (bench --rounds 2).
set -x
Z=/work/main/.venv/bin/zipmoe; D=/work/main/out/demo.zmoe; H=$(cd "$(dirname "$0")" && pwd); W=${W:-/tmp/demorev10}
export HF_HUB_OFFLINE=1
mkdir -p $W; cd $W
$Z plan $D --profile-only --profile $H/profile.json --remeasure
$Z plan $D --budget 500M --calibrate builtin --calibrate-tokens 16 --profile $H/profile.json -o $H/plan-500M.json
T=$(python3 -c "import json;print(json.load(open('$H/plan-500M.json'))['trace']['files'][-1])"); cp $T $H/calib.jsonl
for B in 300M 800M; do
  $Z plan $D --budget $B --trace $H/calib.jsonl --profile $H/profile.json -o $H/plan-$B.json
done
[ -n "$PLANS_ONLY" ] && exit 0
C="--runs 1 --rounds 2 --cold --workload corpus --device cpu --cgroup-slack 1G --profile $H/profile.json --batch 1 --new-tokens 128"
for B in 300M 500M 800M; do
  $Z bench $D --engine zipmoe --engine zipmoe-basic --plan $H/plan-$B.json --budget $B $C --work-dir $W/w-$B --json $H/b1-$B.json
done
echo DEMO-DONE
