#!/usr/bin/env bash
# One short device call (H200) for the GPU checks and figures of issues 14 and 15, each stage
# under its own time limit so that a stuck stage cannot eat the others' output:
#   1. pytest -m gpu over tests/ (graphed decode incl. batched sparse blocks, the loop, the
#      runtime, the Triton merge), while the qwen1.5-moe-a2.7b-shaped checkpoint (LAYERS decoder
#      layers, default 24: the real model's size) is synthesised and packed (codec raw) on the CPU;
#   2. benchmarks/decode_gpu.py at batch 1 and 4, every expert resident (DECODE=0 skips it);
#   3. `zipmoe bench` at BUDGET (default 8G) from a cold page cache: zipmoe against zipmoe-basic
#      (the miss path), batch 1.
# Needs .whl/ with the zipmoe wheel and zstandard, lz4, xxhash for the device's Python.
# Everything lands in $OUT (or ./out/final): tests.log, build.log, bench.log, decode_gpu.json, miss.json.
set -uo pipefail
OUTDIR=${OUT:-$PWD/out/final}
mkdir -p "$OUTDIR"
REPO=$PWD
T0=$(date +%s)
left() { echo $(( ${1} - ($(date +%s) - T0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false CUBLAS_WORKSPACE_CONFIG=:4096:8
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
LAYERS=${LAYERS:-24}
(cd /tmp && timeout ${BUILD_TIMEOUT:-200} python3 "$REPO/benchmarks/decode_gpu.py" --build-only --work /tmp/dec --layers "$LAYERS" > "$OUTDIR/build.log" 2>&1; echo "build rc=$?" >> "$OUTDIR/build.log") &
BUILD=$!
(cd /tmp && timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider -m gpu -rA "$REPO/tests" > "$OUTDIR/tests.log" 2>&1; echo "gpu tests rc=$?" >> "$OUTDIR/tests.log")
grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$OUTDIR/tests.log" | tail -70
wait $BUILD
cat "$OUTDIR/build.log"
[ "${DECODE:-1}" = 1 ] && (cd /tmp && timeout $(left ${DECODE_END:-360}) python3 "$REPO/benchmarks/decode_gpu.py" --work /tmp/dec --layers "$LAYERS" --batch 1,4 \
    --tokens 12 --skip 3 --compare 8 --profile-tokens 2 --engines ${ENGINES:-zipmoe-graphed,zipmoe-batched,zipmoe-fast,hf-eager,hf-grouped_mm} \
    --json "$OUTDIR/decode_gpu.json" > "$OUTDIR/decode.log" 2>&1; echo "decode rc=$?" >> "$OUTDIR/decode.log")
grep -v "^\s*$" "$OUTDIR/decode.log" | grep -v Warning | tail -30
Z=$(ls /tmp/dec/*.zmoe | head -1)
(cd /tmp && timeout $(left ${END:-470}) zipmoe bench "$Z" --engine zipmoe --engine zipmoe-basic --budget ${BUDGET:-8G} --batch 1 --new-tokens 16 --runs 1 \
    --time-limit ${TIME_LIMIT:-60} --cold --cold-method fadvise --device cuda --source /tmp/dec/$(basename "$Z" .zmoe)-src --json "$OUTDIR/miss.json" --work-dir /tmp/dec/bench \
    > "$OUTDIR/bench.log" 2>&1; echo "bench rc=$?" >> "$OUTDIR/bench.log")
tail -30 "$OUTDIR/bench.log"
