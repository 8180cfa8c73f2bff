#!/usr/bin/env bash
# the demo on the CPU box: profile, one calibration, plans at three budgets, then every bench right after
set -x
Z=/work/main/.venv/bin/zipmoe; D=/work/main/out/demo.zmoe; W=/tmp/cpu3
cd $W
$Z plan $D --profile-only --profile $W/profile.json --remeasure --dtype bfloat16
$Z plan $D --budget 400M --calibrate builtin --calibrate-tokens 16 --profile $W/profile.json --dtype bfloat16 -o $W/plan-400M.json
T=$(python3 -c "import json;print(json.load(open('$W/plan-400M.json'))['trace']['files'][-1])"); cp $T $W/calib.jsonl
for B in 600M 800M; do $Z plan $D --budget $B --trace $W/calib.jsonl --profile $W/profile.json --dtype bfloat16 -o $W/plan-$B.json; done
for B in 400M 600M 800M; do
  $Z bench $D --engine zipmoe --engine zipmoe-basic --engine zipmoe-pools --plan $W/plan-$B.json --budget $B --batch 1 --new-tokens 128 \
     --runs 1 --cold --workload corpus --device cpu --cgroup-slack 1G --profile $W/profile.json --json $W/bench.json --merge
done
$Z bench --report $W/bench.json
