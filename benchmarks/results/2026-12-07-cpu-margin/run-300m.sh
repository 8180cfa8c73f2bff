#!/usr/bin/env bash
# 300M again, three more paired rounds: compressed only (the plan chosen at a 3% margin, plan-300M.json)
# against full tensors only (the plan at 5%, plan5-300M.json: zipmoe-basic's), same profile as run.sh.
set -x
Z=/work/main/.venv/bin/zipmoe; D=/work/main/out/demo.zmoe; H=$(cd "$(dirname "$0")" && pwd); W=${W:-/tmp/cpumargin}
export HF_HUB_OFFLINE=1
mkdir -p $W; cd $W
P=$W/profile.json  # §22q's profile, its record of the container's mtime set to this pack's (same container id)
python3 -c "import json,os,sys; p=json.load(open(sys.argv[1])); p['container']['mtime_ns']=os.stat(sys.argv[2]).st_mtime_ns; json.dump(p,open(sys.argv[3],'w'))" \
  $H/../2026-12-07-cpu-betafit/profile.json $D $P
$Z bench $D --engine zipmoe --engine zipmoe-basic --plan $H/plan-300M.json --budget 300M --runs 1 --cold --workload corpus \
  --device cpu --cgroup-slack 1G --profile $P --batch 1 --new-tokens 128 --rounds 3 --work-dir $W/w300b --json $H/b1-300M-r3.json
echo R3-DONE
