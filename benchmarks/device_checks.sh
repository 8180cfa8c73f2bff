#!/usr/bin/env bash
# Device call 1 (H200 machine): what needs the GPU except the serving benchmark.
#   - the Triton merge kernel: exactness on all bit patterns + ~1 GiB, throughput vs d2d copy
#   - the GPU-marked tests: Triton kernels, runtime bit-identity on CUDA for every family
#   - the codec benchmark on an idle many-core CPU (per-core decode + merge)
# Expects .whl/ to hold the zipmoe wheel and the packages the image lacks (zstandard, lz4,
# transformers 5.24 to match the CPU suite). Results under $OUT.
set -uo pipefail
REPO=$(pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  lscpu | grep -E "Model name|^CPU\(s\)"
  python3 -c "import torch, transformers, triton, zstandard, lz4, numba; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, 'zstd', zstandard.ZSTD_VERSION, 'numba', numba.__version__)"
} 2>&1 | tee "$OUT/machine.txt"
echo "== gpu_merge"; timeout 240 python3 benchmarks/gpu_merge.py --json "$OUT/gpu_merge.json" > "$OUT/gpu_merge.log" 2>&1; echo "rc=$?"; tail -25 "$OUT/gpu_merge.log"
echo "== gpu tests"; (cd /tmp && timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu "$REPO/tests/test_kernels_triton.py" "$REPO/tests/test_runtime.py" "$REPO/tests/test_runtime_units.py") > "$OUT/gpu_tests.log" 2>&1; echo "rc=$?"; tail -15 "$OUT/gpu_tests.log"
echo "== codecs"; timeout 200 python3 benchmarks/codecs.py --values 64M --repeat 3 --workers 16 > "$OUT/codecs.log" 2>&1; echo "rc=$?"; tail -22 "$OUT/codecs.log"
