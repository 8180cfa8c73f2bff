#!/usr/bin/env bash
# A/B: the first-token change (after = /work/main HEAD) against the commit before it (before = /tmp/before-site), alternated
cd /tmp
for round in 1 2; do
  for v in before after; do
    pp=""; [ $v = before ] && pp=/tmp/before-site
    env PYTHONPATH=$pp HF_HUB_OFFLINE=1 /work/main/.venv/bin/python /work/main/benchmarks/serve_load.py /work/main/out/demo.zmoe \
      --budget 800M --max-batch 8 --concurrency 1,4,8 --requests 4 --new-tokens 32 --temperature 1.0 \
      --json /tmp/sl/ab-$v-$round.json > /tmp/sl/ab-$v-$round.txt 2>&1
  done
done
echo AB-DONE
