#!/usr/bin/env bash
# the demo at 800M, full tensors only, before (HEAD) and after (working tree), alternating
cd /work/main
run() {  # label
  (cd /tmp && HF_HUB_OFFLINE=1 /work/main/.venv/bin/zipmoe bench /work/main/out/demo.zmoe --engine zipmoe-basic --budget 800M \
      --new-tokens 64 --cold --workload corpus --device cpu --cgroup-slack 1G --runs 1 --json /tmp/ab-$1.json > /tmp/ab-$1.log 2>&1)
  python3 - "$1" <<'PY'
import json, sys
d = json.load(open(f"/tmp/ab-{sys.argv[1]}.json"))
r = d["results"][0]["runs"][0]; c = r["counters"]
f = sum(v for k, v in c["hits"].items() if k != "full")
hp = c.get("host_parts", {})
print(sys.argv[1], f"tpot {1e3*r['tpot_s']:.1f} ms", f"fetched {f}", f"host {1e6*c['time_s']['host']/f:.0f} us",
      f"to_device {1e6*hp.get('to_device', 0)/f:.0f}", f"merge {1e6*c['time_s']['merge']/f:.0f}", f"wait {1e6*c['time_s']['wait']/f:.0f}",
      f"distinct {r.get('distinct_tokens')}", flush=True)
PY
}
for i in 1 2; do
  if [ $((i % 2)) = 1 ]; then order="after before"; else order="before after"; fi
  for v in $order; do
    if [ $v = before ]; then git stash -q; fi
    run $v-$i
    if [ $v = before ]; then git stash pop -q; fi
  done
done
