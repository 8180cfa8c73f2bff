#!/usr/bin/env bash
# Issue 22 items 3 and 5 on the CPU box with the cost model as it lands (profile revision 5, its
# load recorded): the demo (float32) at three budgets, 300M, 500M and 800M. A fresh profile
# measured alone, one calibration, then at each budget the chosen plan against full tensors only
# (zipmoe-basic) and against compressed only (`zipmoe plan --only compressed`), 128 tokens of the
# corpus, cold, batch 1, two paired rounds (bench --rounds 2), predicted beside measured.
set -x
Z=/work/main/.venv/bin/zipmoe; D=/work/main/out/demo.zmoe; H=$(cd "$(dirname "$0")" && pwd); W=${W:-/tmp/cputhree}
export HF_HUB_OFFLINE=1
mkdir -p $W; cd $W
$Z plan $D --profile-only --profile $H/profile.json --remeasure
$Z plan $D --budget 500M --calibrate builtin --calibrate-tokens 16 --profile $H/profile.json -o $H/plan-500M.json
T=$(python3 -c "import json;print(json.load(open('$H/plan-500M.json'))['trace']['files'][-1])"); cp $T $H/calib.jsonl
for B in 300M 800M; do
  $Z plan $D --budget $B --trace $H/calib.jsonl --profile $H/profile.json -o $H/plan-$B.json
done
for B in 300M 500M 800M; do
  $Z plan $D --budget $B --trace $H/calib.jsonl --profile $H/profile.json --only compressed -o $H/plan-$B-compressed.json
done
C="--runs 1 --rounds 2 --cold --workload corpus --device cpu --cgroup-slack 1G --profile $H/profile.json --batch 1 --new-tokens 128"
for B in 300M 500M 800M; do
  $Z bench $D --engine zipmoe --engine zipmoe-basic --plan $H/plan-$B.json --budget $B $C --work-dir $W/w-$B --json $H/b1-$B.json
  $Z bench $D --engine zipmoe --engine zipmoe-basic --plan $H/plan-$B-compressed.json --budget $B $C --work-dir $W/wc-$B --json $H/b1-$B-compressed.json
done
echo THREE-DONE
