#!/usr/bin/env bash
# The default plan (bench --engine zipmoe-default: fitted at load, no --plan) against full tensors
# only on the CPU box, the demo at 500M, batch 1 (7 Dec, evening; docs/benchmarks.md §22v).
# The profile is §22q's (../2026-12-07-cpu-betafit/profile.json, its record of the container's
# mtime set to this pack's); a cache folder of its own (ZIPMOE_CACHE_DIR) gets the routing the
# default fits from by one `zipmoe plan --calibrate builtin` (the calibration keeps its routing
# there, as chat and serve keep theirs):
#   run.sh calib   the calibration (calib.log)
#   run.sh pair    zipmoe-default against zipmoe-basic, 128 corpus tokens, cold, ROUNDS (2) rounds -> b1-500M-default$SUFFIX.json
#                  (the code of a2647cc: SUFFIX=-before, run-before.log; with the default choosing as zipmoe plan:
#                  run.log, then SUFFIX=-r2, run-r2.log; at db3779f (7 Dec, night) SUFFIX=-r3 ROUNDS=4, run-r3.log)
set -x
H=$(cd "$(dirname "$0")" && pwd); R=$(cd "$H/../../.." && pwd); Z=${Z:-$R/.venv/bin/zipmoe}; D=${D:-$R/out/demo.zmoe}
W=${W:-/tmp/defcache}; C=$H/../2026-12-07-cpu-betafit
export HF_HUB_OFFLINE=1 ZIPMOE_CACHE_DIR=$W/cache
mkdir -p $W; cd $W
P=$W/profile.json
[ -e $P ] || python3 -c "import json,os,sys; p=json.load(open(sys.argv[1])); p['container']['mtime_ns']=os.stat(sys.argv[2]).st_mtime_ns; json.dump(p,open(sys.argv[3],'w'))" \
  $C/profile.json $D $P
case ${1:-pair} in
  calib) $Z plan $D --budget 500M --calibrate builtin --profile $P --device cpu -o $W/plan-500M.json ;;
  pair)  $Z bench $D --engine zipmoe-default --engine zipmoe-basic --budget 500M --runs 1 --cold --workload corpus \
           --device cpu --cgroup-slack 1G --profile $P --batch 1 --new-tokens 128 --rounds ${ROUNDS:-2} --work-dir $W/w \
           --json $H/b1-500M-default${SUFFIX:-}.json ;;
  *)     echo "usage: run.sh [calib|pair]" >&2; exit 2 ;;
esac
echo DONE
