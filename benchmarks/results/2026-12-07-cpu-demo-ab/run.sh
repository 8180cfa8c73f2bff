# demo at 800M on the CPU box: the code before this session (5f5fb29) and after, alternating, 2 rounds
cd /tmp
for r in 1 2; do
  for v in before after; do
    if [ $v = before ]; then pp=/tmp/site-b0; else pp=; fi
    PYTHONPATH=$pp HF_HUB_OFFLINE=1 /work/main/.venv/bin/python -c "import sys; from zipmoe_cli.app import main; sys.argv=['zipmoe']+sys.argv[1:]; main()" \
      bench /work/main/out/demo.zmoe --engine zipmoe --budget 800M --device cpu --new-tokens 64 --runs 1 --cold \
      --json /tmp/cpu-ab-$v-$r.json > /tmp/cpu-ab-$v-$r.log 2>&1
    echo "$v $r rc=$?"; grep -iE "tpot|zipmoe " /tmp/cpu-ab-$v-$r.log | head -4
  done
done
