#!/usr/bin/env bash
# §27d under a disk slower than decompression: the same Switch container with the disk's reads
# capped at 100 MiB/s (benchmarks/slow_disk.sh: the block layer's throttle, 100 ms slices), profile
# revision 10 measured under the cap, the plan at 300M and 600M from §27d's calibration, then at
# each budget the plan against zipmoe-basic, two paired rounds, 128 tokens of the corpus, cold.
set -x
Z=/work/main/.venv/bin/zipmoe; H=$(cd "$(dirname "$0")" && pwd); W=${W:-/tmp/swb}; D=$W/sw.zmoe
S="bash /work/main/benchmarks/slow_disk.sh -f $D ${RATE:-100M} --"
export HF_HUB_OFFLINE=1
cd $W
$S $Z plan $D --profile-only --profile $H/profile.json --remeasure --device cpu
for B in ${BUDGETS:-300M 600M}; do
  $Z plan $D --budget $B --trace $H/../calib.jsonl --profile $H/profile.json --device cpu -o $H/plan-$B.json
done
C="--runs 1 --rounds 2 --cold --workload corpus --device cpu --cgroup-slack 1G --profile $H/profile.json --batch 1 --new-tokens 128"
for B in ${BUDGETS:-300M 600M}; do
  $S $Z bench $D --engine zipmoe --engine zipmoe-basic --plan $H/plan-$B.json --budget $B $C --work-dir $W/s100-$B --json $H/b1-$B.json
done
echo SLOW-DONE
