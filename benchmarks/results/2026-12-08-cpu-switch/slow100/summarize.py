"""The rows of docs/benchmarks.md §27d's table under the 100 MiB/s cap, from this folder's bench JSONs."""
import json
from pathlib import Path

here = Path(__file__).parent
for B in ("300M", "600M"):
    for suf in ("", "-compressed"):
        f = here / f"b1-{B}{suf}.json"
        if not f.exists():
            continue
        d = json.loads(f.read_text())
        pr = {p["engine"]: p["per_round"] for p in d.get("paired") or []}
        for r in d["results"]:
            t = [x["tpot_s"] * 1000 for x in r["runs"]]
            x = r["runs"][0]
            h = x["counters"]["hits"]
            tot = sum(h.values()) or 1
            pred, model = x["predicted_tpot_s"] * 1000, x["model_tpot_s"] * 1000
            name = "`--only compressed`" if suf and r["engine"] == "zipmoe" else r["engine"]
            print(f"| {B} | {name} | " + " · ".join(f"{v:.1f}" for v in t) + f" ms | {pred:.1f} | "
                  + " · ".join(f"{v / pred:.2f}" for v in t) + f" | {model:.1f} | " + " · ".join(f"{v / model:.2f}" for v in t)
                  + " | " + "·".join(str(round(100 * h[k] / tot)) for k in ("full", "compressed", "sm_only", "e_only", "none"))
                  + f" | {x['decode_bytes_read_io'] / 2**20 / max(1, int(x['generated'])):.1f}"
                  + " | " + " ".join(f"{v:.3f}" for v in pr.get(r["engine"]) or []) + " |"
                  + ("" if d["token_check"]["same"] else " TOKENS DIFFER"))
