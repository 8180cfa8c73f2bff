#!/usr/bin/env bash
# The planner's 3% margin for plans of full and compressed slots (7 Dec, night): the plans
# of revision 7's CPU profile (../2026-12-07-cpu-betafit/profile.json, its container mtime set to
# this pack's; the same container id) and calibration, re-planned at 300M/500M/800M; the chosen
# plan against full tensors only, one bench each (the two engines alternate, 2 rounds), 128 tokens
# of the corpus, cold, batch 1. 800M chose full tensors only (no run needed: the plan is zipmoe-basic's).
set -x
Z=/work/main/.venv/bin/zipmoe; D=/work/main/out/demo.zmoe; H=$(cd "$(dirname "$0")" && pwd); W=${W:-/tmp/cpumargin}
export HF_HUB_OFFLINE=1
mkdir -p $W; cd $W
P=$W/profile.json  # §22q's profile, its record of the container's mtime set to this pack's (same container id)
python3 -c "import json,os,sys; p=json.load(open(sys.argv[1])); p['container']['mtime_ns']=os.stat(sys.argv[2]).st_mtime_ns; json.dump(p,open(sys.argv[3],'w'))" \
  $H/../2026-12-07-cpu-betafit/profile.json $D $P
C="--runs 1 --cold --workload corpus --device cpu --cgroup-slack 1G --profile $P --batch 1 --new-tokens 128 --rounds 2"
for b in 300M 500M; do
  $Z bench $D --engine zipmoe --engine zipmoe-basic --plan $H/plan-$b.json --budget $b $C --work-dir $W/w$b --json $H/b1-$b.json
done
echo MARGIN-DONE
# the plans themselves (plan-*.json at the 3% margin, plan5-*.json at the 5% tried for an hour):
#   zipmoe plan $D --budget B --trace $H/../2026-12-07-cpu-betafit/calib.jsonl --profile $P -o $H/plan-B.json
