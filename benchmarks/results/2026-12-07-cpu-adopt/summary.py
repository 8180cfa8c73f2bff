"""Per run: TPOT, hits, fresh read buffers, and the serving thread's work per fetched tensor (us)."""
import json, sys
from pathlib import Path

H = Path(__file__).parent
for name in ("before-1", "after-1", "before-2", "after-2", "before-3", "after-3"):
    r = json.loads((H / f"{name}.json").read_text())["results"][0]
    run = r["runs"][0]
    c = run["counters"]
    hits = c["hits"]
    fetched = sum(v for k, v in hits.items() if k != "full")  # tensors that were not full-pool hits
    t = c["time_s"]
    per = lambda s: 1e6 * s / fetched if fetched else float("nan")  # noqa: E731
    print(f"{name:9s} tpot {1e3 * run['tpot_s']:7.1f} ms  hits {hits}  fresh {c['fresh_buffers']}  fetched {fetched}  "
          f"host {per(t['host']):6.1f}  admit {per(t['admit']):6.1f}  peak RSS {r['peak_rss_sampled_bytes'] / 2**20:.0f} MiB  "
          f"distinct tok {run['distinct_tokens']}")
