#!/usr/bin/env bash
# Plans for four rows on the CPU box (7 Dec, evening; docs/benchmarks.md §22t). The profile is
# §22q's (../2026-12-07-cpu-betafit/profile.json, its record of the container's mtime set to this
# pack's), the calibration §22q's; `zipmoe plan --batch 4` serves each state at four rows once and
# keeps the costs in that profile (profile-b4.json here is the profile after it):
#   run.sh plan    the plan for 4 rows at 500M (plan-b4-500M.json, plan.log) and the single-pool
#                  plans it passed over (--only e_only, sm_only, compressed)
#   run.sh eonly   e_only only (predicted 6% faster than full tensors only at 4 rows) against full
#                  tensors only, 4 rows at 500M, 2 rounds -> b4-500M-e_only.json (run-eonly.log)
#   run.sh sm      sm_only only against full tensors only, the same               -> b4-500M-sm_only.json
set -x
H=$(cd "$(dirname "$0")" && pwd); R=$(cd "$H/../../.." && pwd); Z=${Z:-$R/.venv/bin/zipmoe}; D=${D:-$R/out/demo.zmoe}; W=${W:-/tmp/b4}
C=$H/../2026-12-07-cpu-betafit
export HF_HUB_OFFLINE=1
mkdir -p $W; cd $W
P=$W/profile.json
[ -e $P ] || python3 -c "import json,os,sys; p=json.load(open(sys.argv[1])); p['container']['mtime_ns']=os.stat(sys.argv[2]).st_mtime_ns; json.dump(p,open(sys.argv[3],'w'))" \
  $C/profile.json $D $P
plan() {  # plan [--only POOL] -> plan-b4-500M[-POOL].json
  $Z plan $D --budget 500M --trace $C/calib.jsonl --profile $P --batch 4 --device cpu "$@"
}
pair() {  # pair PLAN JSON: that plan against zipmoe-basic, 4 rows at 500M, 2 rounds
  $Z bench $D --engine zipmoe --engine zipmoe-basic --plan $1 --budget 500M --runs 1 --cold --workload corpus \
    --device cpu --cgroup-slack 1G --profile $P --batch 4 --new-tokens 128 --rounds 2 --work-dir $W/w-b4 --json $H/$2
}
case ${1:-plan} in
  plan)  plan -o $H/plan-b4-500M.json 2>&1 | tee $H/plan.log
         for o in e_only sm_only compressed; do plan --only $o -o $H/plan-b4-500M-$o.json > /dev/null 2>&1; done
         cp $P $H/profile-b4.json ;;
  eonly) pair $H/plan-b4-500M-e_only.json b4-500M-e_only.json ;;
  sm)    pair $H/plan-b4-500M-sm_only.json b4-500M-sm_only.json ;;
  *)     echo "usage: run.sh [plan|eonly|sm]" >&2; exit 2 ;;
esac
echo DONE
