#!/usr/bin/env bash
# Profile revision 5 (β: a compressed hit beside misses) and the margin of 5% for full + compressed
# plans, on the CPU box: the demo (float32) at 400M and 800M, the plan the planner now chooses
# (profile.json measured with nothing else running; the calibration of ../2026-12-07-cpu-singles)
# against full tensors only (zipmoe-basic), 128 tokens of the corpus, cold, three paired rounds.
set -x
Z=/work/main/.venv/bin/zipmoe; D=/work/main/out/demo.zmoe; H=$(cd "$(dirname "$0")" && pwd); W=${W:-/tmp/cpubeta}
export HF_HUB_OFFLINE=1
mkdir -p $W; cd $W
for B in 400M 800M; do
  $Z bench $D --engine zipmoe --engine zipmoe-basic --plan $H/plan5-$B.json --budget $B --batch 1 --new-tokens 128 \
     --rounds 3 --runs 1 --cold --workload corpus --device cpu --cgroup-slack 1G --profile $H/profile.json \
     --work-dir $W/work-$B --json $W/b1-$B.json
done
echo BETA-DONE
