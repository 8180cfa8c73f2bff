#!/usr/bin/env bash
# Batch 4 at 500M: the plan chosen at the 3% margin (compressed only, plan-500M.json) against full
# tensors only, alternating, two rounds, 128 new tokens of the corpus per row, cold; same profile as run.sh.
set -x
Z=/work/main/.venv/bin/zipmoe; D=/work/main/out/demo.zmoe; H=$(cd "$(dirname "$0")" && pwd); W=${W:-/tmp/cpumargin}
export HF_HUB_OFFLINE=1
mkdir -p $W; cd $W
P=$W/profile.json  # §22q's profile, its record of the container's mtime set to this pack's (same container id)
python3 -c "import json,os,sys; p=json.load(open(sys.argv[1])); p['container']['mtime_ns']=os.stat(sys.argv[2]).st_mtime_ns; json.dump(p,open(sys.argv[3],'w'))" \
  $H/../2026-12-07-cpu-betafit/profile.json $D $P
$Z bench $D --engine zipmoe --engine zipmoe-basic --plan $H/plan-500M.json --budget 500M --runs 1 --cold --workload corpus \
  --device cpu --cgroup-slack 1G --profile $P --batch 4 --new-tokens 128 --rounds 2 --work-dir $W/wb4 --json $H/b4-500M.json
echo B4-DONE
