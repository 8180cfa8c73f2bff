#!/usr/bin/env bash
# The planner's 3% margin for plans of full and compressed slots (7 Dec, night; docs/benchmarks.md §22r).
# The plans: §22q's CPU profile (../2026-12-07-cpu-betafit/profile.json, its record of the
# container's mtime set to this pack's; the same container id) and calibration, re-planned:
#   zipmoe plan $D --budget B --trace $H/../2026-12-07-cpu-betafit/calib.jsonl --profile $P -o $H/plan-B.json
# (plan-*.json at the 3% margin, plan5-*.json at the 5% tried for an hour). 800M chose full tensors
# only (no run needed: the plan is zipmoe-basic's). Then the chosen plan against full tensors only,
# the two engines alternating in one bench, 128 new tokens of the corpus a row, cold:
#   run.sh b1     batch 1 at 300M and 500M, 2 rounds each    -> b1-300M.json, b1-500M.json  (run.log)
#   run.sh 300m   batch 1 at 300M, 3 more rounds             -> b1-300M-r3.json             (run-300m.log)
#   run.sh b4     batch 4 at 500M, 2 rounds                  -> b4-500M.json                (run-b4.log)
set -x
Z=/work/main/.venv/bin/zipmoe; D=/work/main/out/demo.zmoe; H=$(cd "$(dirname "$0")" && pwd); W=${W:-/tmp/cpumargin}
export HF_HUB_OFFLINE=1
mkdir -p $W; cd $W
P=$W/profile.json
python3 -c "import json,os,sys; p=json.load(open(sys.argv[1])); p['container']['mtime_ns']=os.stat(sys.argv[2]).st_mtime_ns; json.dump(p,open(sys.argv[3],'w'))" \
  $H/../2026-12-07-cpu-betafit/profile.json $D $P
pair() {  # pair BUDGET BATCH ROUNDS JSON: the plan at BUDGET against zipmoe-basic
  $Z bench $D --engine zipmoe --engine zipmoe-basic --plan $H/plan-$1.json --budget $1 --runs 1 --cold --workload corpus \
    --device cpu --cgroup-slack 1G --profile $P --batch $2 --new-tokens 128 --rounds $3 --work-dir $W/w-$1-b$2 --json $H/$4
}
case ${1:-b1} in
  b1)   pair 300M 1 2 b1-300M.json; pair 500M 1 2 b1-500M.json ;;
  300m) pair 300M 1 3 b1-300M-r3.json ;;
  b4)   pair 500M 4 2 b4-500M.json ;;
  *)    echo "usage: run.sh [b1|300m|b4]" >&2; exit 2 ;;
esac
echo DONE
