#!/usr/bin/env bash
# the demo on the CPU box, float32: the profile with its served pass (misses fitted at capacity), one calibration, plans at three budgets, then the benches right after
set -x
Z=/work/main/.venv/bin/zipmoe; D=/work/main/out/demo.zmoe; W=${W:-/tmp/cpu5}  # round 2: W=/tmp/cpu5b bash run.sh (results in round2/)
export HF_HUB_OFFLINE=1
mkdir -p $W; cd $W
$Z plan $D --profile-only --profile $W/profile.json --remeasure
$Z plan $D --budget 600M --calibrate builtin --calibrate-tokens 16 --profile $W/profile.json -o $W/plan-600M.json
T=$(python3 -c "import json;print(json.load(open('$W/plan-600M.json'))['trace']['files'][-1])"); cp $T $W/calib.jsonl
for B in 900M 1200M; do $Z plan $D --budget $B --trace $W/calib.jsonl --profile $W/profile.json -o $W/plan-$B.json; done
for B in 600M 900M 1200M; do
  $Z bench $D --engine zipmoe --engine zipmoe-basic --plan $W/plan-$B.json --budget $B --batch 1 --new-tokens 128 \
     --runs 1 --cold --workload corpus --device cpu --cgroup-slack 1G --profile $W/profile.json --json $W/bench.json --merge
done
$Z bench --report $W/bench.json
echo CPU4-DONE
