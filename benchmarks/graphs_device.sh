#!/usr/bin/env bash
# Issue 14's GPU checks in one device call (H200 box; runs from a copy of the repository whose
# .whl/ holds the zipmoe wheel and zstandard, lz4, xxhash for Python 3.12):
#   GPU tests of the graphed decode step and of the runtime (pytest -m gpu), while the benchmark
#   model is synthesised and packed on the CPU; then benchmarks/decode_gpu.py.
#   LAYERS (default 24): decoder layers of the qwen1.5-moe-a2.7b-shaped model (per-layer shapes kept).
# Everything lands in $OUT (or ./out/graphs): tests.log, bench.log, decode_gpu.json.
set -uo pipefail
OUTDIR=${OUT:-$PWD/out/graphs}
mkdir -p "$OUTDIR"
REPO=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false CUBLAS_WORKSPACE_CONFIG=:4096:8
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
LAYERS=${LAYERS:-24}
(cd /tmp && timeout ${BUILD_TIMEOUT:-230} python3 "$REPO/benchmarks/decode_gpu.py" --build-only --work /tmp/dec --layers "$LAYERS" > "$OUTDIR/build.log" 2>&1; echo "build rc=$?" >> "$OUTDIR/build.log") &
BUILD=$!
(cd /tmp && timeout ${TEST_TIMEOUT:-210} python3 -m pytest -q -p no:cacheprovider -m gpu -rfEs "$REPO/tests/test_graphs.py" "$REPO/tests/test_runtime.py" > "$OUTDIR/tests.log" 2>&1; echo "gpu tests rc=$?" >> "$OUTDIR/tests.log")
tail -25 "$OUTDIR/tests.log"
wait $BUILD
cat "$OUTDIR/build.log"
(cd /tmp && timeout ${BENCH_TIMEOUT:-230} python3 "$REPO/benchmarks/decode_gpu.py" --work /tmp/dec --layers "$LAYERS" --batch 1,4 \
    --tokens 12 --skip 3 --compare 8 --profile-tokens 3 --json "$OUTDIR/decode_gpu.json" > "$OUTDIR/bench.log" 2>&1; echo "bench rc=$?" >> "$OUTDIR/bench.log")
grep -v "^\s*$" "$OUTDIR/bench.log" | grep -v Warning | tail -30
