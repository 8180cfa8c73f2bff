#!/usr/bin/env bash
# §27d, profile revision 10 (the served fit net of first touches): the plan (full tensors only at
# each budget now) against zipmoe-basic, two paired rounds, predicted and modelled beside measured.
set -x
Z=/work/main/.venv/bin/zipmoe; H=$(cd "$(dirname "$0")" && pwd); W=${W:-/tmp/swb}; D=$W/sw.zmoe
export HF_HUB_OFFLINE=1
C="--runs 1 --rounds 2 --cold --workload corpus --device cpu --cgroup-slack 1G --profile $H/profile.json --batch 1 --new-tokens 128"
for B in ${BUDGETS:-300M 450M 900M}; do
  $Z bench $D --engine zipmoe --engine zipmoe-basic --plan $H/plan-$B.json --budget $B $C --work-dir $W/r10-$B --json $H/b1-$B.json
done
echo REV10-DONE
