#!/usr/bin/env bash
# The compressed pool adopting the read buffers (engine/adopt.py) against the copy it replaced,
# on the CPU box: the demo (float32) at 500M, compressed only (a hand-written plan whose one
# compressed pool the runtime scales to what the budget leaves), 128 tokens of the corpus, cold,
# batch 1; the code of fb16ba5 (copies; installed with --no-deps into /tmp/site-b0) and this
# code (adoption) alternating, three rounds. Host work per fetched tensor from each run's JSON.
set -u
H=$(cd "$(dirname "$0")" && pwd); D=/work/main/out/demo.zmoe; PY=/work/main/.venv/bin/python
export HF_HUB_OFFLINE=1
CID=$($PY -c "import zipmoe;m,_=zipmoe.load('$D',budget='2G',device='cpu',workers=1);print(m.zipmoe.container_id);m.zipmoe.close()" 2>/dev/null | tail -1)
echo "{\"container_id\": \"$CID\", \"pools\": {\"compressed\": 10737418240}}" > $H/plan-compressed.json
cd /tmp
for r in 1 2 3; do
  for v in before after; do
    if [ $v = before ]; then pp=/tmp/site-b0; else pp=; fi
    PYTHONPATH=$pp $PY -c "import sys; from zipmoe_cli.app import main; sys.argv=['zipmoe']+sys.argv[1:]; main()" \
      bench $D --engine zipmoe --plan $H/plan-compressed.json --budget 500M --device cpu --new-tokens 128 \
      --workload corpus --runs 1 --cold --work-dir /tmp/adopt-w --json $H/$v-$r.json > $H/$v-$r.log 2>&1
    echo "$v $r rc=$?"
  done
done
echo ADOPT-AB-DONE
