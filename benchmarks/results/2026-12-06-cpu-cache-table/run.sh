#!/usr/bin/env bash
# Issue 22's table on the CPU box: the demo (float32) at 400M and 800M, every zipmoe engine and
# uncompressed at batch 1 (128 tokens, two rounds in opposite engine order), the plan and full
# tensors only at batch 4 and at 512 tokens; the profile and one calibration first (this code)
set -x
Z=/work/main/.venv/bin/zipmoe; D=/work/main/out/demo.zmoe; S=/work/main/out/demo; W=${W:-/tmp/cput6}
export HF_HUB_OFFLINE=1
mkdir -p $W; cd $W
$Z plan $D --profile-only --profile $W/profile.json --remeasure
$Z plan $D --budget 800M --calibrate builtin --calibrate-tokens 16 --profile $W/profile.json -o $W/plan-800M.json
T=$(python3 -c "import json;print(json.load(open('$W/plan-800M.json'))['trace']['files'][-1])"); cp $T $W/calib.jsonl
$Z plan $D --budget 400M --trace $W/calib.jsonl --profile $W/profile.json -o $W/plan-400M.json
C="--runs 1 --cold --workload corpus --device cpu --cgroup-slack 1G --profile $W/profile.json --work-dir $W/work"
for B in 400M 800M; do
  $Z bench $D --engine zipmoe --engine zipmoe-basic --engine zipmoe-pools --engine zipmoe-default --engine uncompressed \
     --source $S --plan $W/plan-$B.json --budget $B --batch 1 --new-tokens 128 $C --json $W/b1.json --merge
done
for B in 400M 800M; do
  $Z bench $D --engine zipmoe-default --engine zipmoe-pools --engine zipmoe-basic --engine zipmoe \
     --plan $W/plan-$B.json --budget $B --batch 1 --new-tokens 128 $C --json $W/b1-r2.json --merge
done
for B in 400M 800M; do
  $Z bench $D --engine zipmoe --engine zipmoe-basic --plan $W/plan-$B.json --budget $B --batch 4 --new-tokens 128 $C --json $W/b4.json --merge
  $Z bench $D --engine zipmoe --engine zipmoe-basic --plan $W/plan-$B.json --budget $B --batch 1 --new-tokens 512 $C --json $W/n512.json --merge
done
for f in b1 b1-r2 b4 n512; do $Z bench --report $W/$f.json; done
echo CPUT6-DONE
