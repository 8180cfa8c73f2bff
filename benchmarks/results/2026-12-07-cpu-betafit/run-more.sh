#!/usr/bin/env bash
# Item 3 on the CPU box with profile revision 7: the profile and calibration of run.sh, the plan
# and `--only compressed` at 300M and 800M, each in one bench with full tensors only (zipmoe-basic)
# beside it, 128 tokens of the corpus, cold, batch 1.
set -x
Z=/work/main/.venv/bin/zipmoe; D=/work/main/out/demo.zmoe; H=$(cd "$(dirname "$0")" && pwd); W=${W:-/tmp/cpubeta}
export HF_HUB_OFFLINE=1
mkdir -p $W; cd $W
C="--runs 1 --cold --workload corpus --device cpu --cgroup-slack 1G --profile $H/profile.json --batch 1 --new-tokens 128"
for B in 300M 800M; do
  $Z plan $D --budget $B --trace $H/calib.jsonl --profile $H/profile.json -o $H/plan-$B.json
  $Z plan $D --budget $B --trace $H/calib.jsonl --profile $H/profile.json --only compressed -o $H/plan-$B-compressed.json
  $Z bench $D --engine zipmoe --engine zipmoe-basic --plan $H/plan-$B.json --budget $B $C --work-dir $W/w-$B --json $H/b1-$B.json
  $Z bench $D --engine zipmoe --plan $H/plan-$B-compressed.json --budget $B $C --work-dir $W/wc-$B --json $H/b1-$B-compressed.json
done
echo MORE-DONE
