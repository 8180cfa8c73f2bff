#!/bin/bash
# CPU before/after of the row batch: serve_load on the demo at 800M, alternating the code of f2ddff1 and HEAD
cd /tmp
export HF_HUB_OFFLINE=1
PY=/work/main/.venv/bin/python
for round in 1 2; do
  for v in after before; do
    pp=""; [ $v = before ] && pp=/tmp/site-before
    echo "== round $round $v $(date -u +%T)"
    PYTHONPATH=$pp $PY /work/main/benchmarks/serve_load.py /work/main/out/demo.zmoe --budget 800M --max-batch 8 \
      --concurrency 1,4,8 --requests 4 --new-tokens 32 --temperature 1.0 --chat \
      --json /work/main/out/ab/$v-$round.json > /work/main/out/ab/$v-$round.log 2>&1
    echo "   rc=$? $(date -u +%T)"
  done
done
echo DONE
