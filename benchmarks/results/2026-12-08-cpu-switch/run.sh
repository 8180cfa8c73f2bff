#!/usr/bin/env bash
# Issue 22 item 3 and issue 24 on the CPU box: an encoder-decoder's profile served through
# model.generate (profile revision 9: every cache state, passes._generate_stream). SwitchTransformers
# at switch-base-128's shapes, 4 layers a side (2 sparse each: 2.3 GiB of decoder experts, 4.5 GiB in
# all), synthesised and packed into $W. A fresh profile measured alone, one calibration on the corpus,
# the plan at three budgets and compressed only at each, then at each budget the chosen plan against
# full tensors only (zipmoe-basic) and compressed only, 128 tokens of the corpus, cold, batch 1,
# two paired rounds (bench --rounds 2), predicted beside measured. OUT: where the results go (default
# this folder); SKIP_PROFILE=1 keeps OUT/profile.json; PLANS_ONLY=1 stops after the plans.
set -x
Z=/work/main/.venv/bin/zipmoe; H=${OUT:-$(cd "$(dirname "$0")" && pwd)}; W=${W:-/tmp/swb}; D=$W/sw.zmoe
BUDGETS=${BUDGETS:-900M 1500M 2400M}
export HF_HUB_OFFLINE=1
mkdir -p $W; cd $W
[ -f $D ] || { $Z synth switch_transformers -o $W/src --preset switch-base-128 --layers 4 --force && $Z pack $W/src -o $D; }
[ -n "$SKIP_PROFILE" ] || $Z plan $D --profile-only --profile $H/profile.json --remeasure --device cpu
set -- $BUDGETS
$Z plan $D --budget $1 --calibrate corpus --calibrate-tokens 16 --profile $H/profile.json --device cpu -o $H/plan-$1.json
T=$(python3 -c "import json;print(json.load(open('$H/plan-$1.json'))['trace']['files'][-1])"); cp $T $H/calib.jsonl
for B in $BUDGETS; do
  $Z plan $D --budget $B --trace $H/calib.jsonl --profile $H/profile.json --device cpu -o $H/plan-$B.json
  $Z plan $D --budget $B --trace $H/calib.jsonl --profile $H/profile.json --device cpu --only compressed -o $H/plan-$B-compressed.json
done
[ -n "$PLANS_ONLY" ] && exit 0
C="--runs 1 --rounds 2 --cold --workload corpus --device cpu --cgroup-slack 1G --profile $H/profile.json --batch 1 --new-tokens 128"
for B in $BUDGETS; do
  $Z bench $D --engine zipmoe --engine zipmoe-basic --plan $H/plan-$B.json --budget $B $C --work-dir $W/w-$B --json $H/b1-$B.json
  $Z bench $D --engine zipmoe --engine zipmoe-basic --plan $H/plan-$B-compressed.json --budget $B $C --work-dir $W/wc-$B --json $H/b1-$B-compressed.json
done
echo SWITCH-DONE
