#!/usr/bin/env bash
# β fitted to a served run of one compressed pool (profile revision 7) on the CPU box: the demo
# (float32), a fresh profile measured alone, one calibration at 500M, the plan and `--only
# compressed`, then both against full tensors only, 128 tokens of the corpus, cold, batch 1.
set -x
Z=/work/main/.venv/bin/zipmoe; D=/work/main/out/demo.zmoe; H=$(cd "$(dirname "$0")" && pwd); W=${W:-/tmp/cpubeta}
export HF_HUB_OFFLINE=1
mkdir -p $W; cd $W
$Z plan $D --profile-only --profile $H/profile.json --remeasure
$Z plan $D --budget 500M --calibrate builtin --calibrate-tokens 16 --profile $H/profile.json -o $H/plan-500M.json
T=$(python3 -c "import json;print(json.load(open('$H/plan-500M.json'))['trace']['files'][-1])"); cp $T $H/calib.jsonl
$Z plan $D --budget 500M --trace $H/calib.jsonl --profile $H/profile.json --only compressed -o $H/plan-500M-compressed.json
C="--runs 1 --cold --workload corpus --device cpu --cgroup-slack 1G --profile $H/profile.json --batch 1 --new-tokens 128"
$Z bench $D --engine zipmoe --engine zipmoe-basic --plan $H/plan-500M-compressed.json --budget 500M $C --work-dir $W/wc --json $H/b1-500M-compressed.json
echo BETAFIT-DONE
