"""Print the Switch CPU runs of this folder (and low/) as the rows of docs/benchmarks.md §27d."""
import json
import sys
from pathlib import Path

here = Path(__file__).parent
for B, d in [(b, here / sub) for sub, bs in (("low", ("300M", "450M", "600M")), (".", ("900M", "1500M", "2400M"))) for b in bs]:
    for suf in ("", "-compressed"):
        f = d / f"b1-{B}{suf}.json"
        if not f.exists():
            continue
        doc = json.loads(f.read_text())
        paired = {p.get("engine"): p.get("per_round") for p in doc.get("paired") or []}
        for r in doc["results"]:
            runs = r["runs"]
            x = runs[0]
            h = x["counters"]["hits"]
            tot = sum(h.values()) or 1
            pools = r["load_info"]["runtime"]["pools"]
            print(f"| {B} | {'--only compressed' if suf and r['engine'] == 'zipmoe' else r['engine']} | "
                  + " ".join(f"{k[0].upper()}{v / 2**20:.0f}" for k, v in pools.items() if v) + " | "
                  + " · ".join(f"{t['tpot_s'] * 1000:.1f}" for t in runs) + " ms | "
                  + f"{(x.get('predicted_tpot_s') or 0) * 1000:.1f} | {(x.get('model_tpot_s') or 0) * 1000:.1f} | "
                  + "·".join(str(round(100 * h[k] / tot)) for k in ("full", "compressed", "sm_only", "e_only", "none"))
                  + f" | {x['distinct_tokens']} · {x['distinct_experts']} | "
                  + (" ".join(f"{v:.3f}" for v in paired.get(r["engine"]) or []) or "") + " |")
        tc = doc.get("token_check") or {}
        if not tc.get("same", False):
            print("TOKEN MISMATCH", f, tc, file=sys.stderr)
