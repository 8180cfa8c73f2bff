#!/usr/bin/env bash
set -x
Z=/work/main/.venv/bin/zipmoe; D=/work/main/out/demo.zmoe; W=/tmp/cpu400
export HF_HUB_OFFLINE=1 ZIPMOE_CACHE_DIR=/tmp/zc-check
P=$(ls /tmp/zc-check/profiles/*.json | head -1)
C="--runs 1 --cold --workload corpus --device cpu --cgroup-slack 1G --profile $P --work-dir $W/work"
$Z bench $D --engine zipmoe --engine zipmoe-basic --plan /tmp/plan400.json --budget 400M --batch 1 --new-tokens 128 $C --json $W/r1.json
$Z bench $D --engine zipmoe-basic --engine zipmoe --plan /tmp/plan400.json --budget 400M --batch 1 --new-tokens 128 $C --json $W/r2.json
echo CPU400-DONE
