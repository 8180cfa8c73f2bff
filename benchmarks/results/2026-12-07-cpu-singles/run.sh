#!/usr/bin/env bash
# Item 5 of issue 22 on the CPU box: the chosen plan against every single-pool plan the planner
# passed over (`zipmoe plan --only POOL`), the demo (float32) at 400M, 128 tokens of the corpus,
# cold, batch 1; three rounds, the order rotated each round. The profile and one calibration first.
set -x
Z=/work/main/.venv/bin/zipmoe; D=/work/main/out/demo.zmoe; W=${W:-/tmp/cpusingles}; B=${B:-400M}
export HF_HUB_OFFLINE=1
mkdir -p $W; cd $W
$Z plan $D --profile-only --profile $W/profile.json --remeasure
$Z plan $D --budget $B --calibrate builtin --calibrate-tokens 16 --profile $W/profile.json -o $W/plan-chosen.json
T=$(python3 -c "import json;print(json.load(open('$W/plan-chosen.json'))['trace']['files'][-1])"); cp $T $W/calib.jsonl
for P in full compressed sm_only e_only; do
  $Z plan $D --budget $B --trace $W/calib.jsonl --profile $W/profile.json --only $P -o $W/plan-$P.json
done
C="--runs 1 --cold --workload corpus --device cpu --cgroup-slack 1G --profile $W/profile.json --work-dir $W/work"
ORDER=(chosen full compressed sm_only e_only)
for R in 1 2 3; do
  for i in 0 1 2 3 4; do
    P=${ORDER[$(( (i + R - 1) % 5 ))]}
    $Z bench $D --engine zipmoe --plan $W/plan-$P.json --budget $B --batch 1 --new-tokens 128 $C --json $W/r$R-$P.json
  done
done
for f in $W/r*-*.json; do echo "== $f"; $Z bench --report $f; done
echo SINGLES-DONE
