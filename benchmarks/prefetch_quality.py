"""Prefetch precision and recall per family: the synth presets and the demo, on the CPU.

    python benchmarks/prefetch_quality.py --work /tmp/pq [--preset small] [--demo] [--tokens 32] [--json out.json]

For each family (``zipmoe synth FAMILY --preset PRESET``; with ``--demo`` also the demo model,
SmolLM2-135M upcycled into a Mixtral MoE, whose routers are the upcycling's and not random),
pack it (zstd), load it with prefetch on and a budget holding ``--fraction`` of the experts,
decode ``--tokens`` greedy steps from a fixed prompt and print the predictor's precision
(predicted experts the layer then chose) and recall (chosen experts that had been predicted),
over all layers and the worst / best layer (``model.zipmoe.counters``'s
``prediction_by_layer``). Predictions depend on the weights only (layer L+1's router applied to
layer L's hidden state), not on the device: the CPU measures what the GPU would see.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "switch_transformers")


def measure(path: Path, fraction: float, tokens: int, seq2seq: bool) -> dict:
    import torch

    import zipmoe
    from zipmoe.runtime.engine.counters import delta, prediction_quality
    from zipmoe.runtime.engine.loader import requirements

    req = requirements(path, workers=1)
    model, _ = zipmoe.load(path, budget=req["budget_for"](fraction), workers=1, prefetch=True)
    rt = model.zipmoe
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (1, 12), generator=g)
    c0 = rt.counters.snapshot()
    t0 = time.perf_counter()
    with torch.inference_mode():
        kw = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
        if seq2seq:
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)
        else:
            model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    secs = time.perf_counter() - t0
    d = delta(rt.counters.snapshot(), c0)
    q = prediction_quality(d)
    layers = {k: v for k, v in q.items() if k != "all" and v["precision"] is not None}
    out = {"all": q.get("all"), "layers": len(layers), "seconds": secs, "prefetch": d["prefetch"],
           "worst_layer_precision": min((v["precision"] for v in layers.values()), default=None),
           "best_layer_precision": max((v["precision"] for v in layers.values()), default=None),
           "worst_layer_recall": min((v["recall"] for v in layers.values() if v["recall"] is not None), default=None),
           "per_layer": layers}
    rt.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/pq")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--demo", action="store_true", help="also the demo model (about 3 minutes to build)")
    ap.add_argument("--fraction", type=float, default=0.3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(1)
    from zipmoe.codecs.writer import pack
    from zipmoe.runtime import synth

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    todo = [(f, a.preset) for f in a.families.split(",") if f] + ([("demo", "demo")] if a.demo else [])
    results = {}
    for fam, preset in todo:
        src, out = work / f"{fam}-{preset}", work / f"{fam}-{preset}.zmoe"
        if not out.exists():
            t = time.time()
            if fam == "demo":
                synth.build_demo(src)
            else:
                synth.write(fam, src, preset=preset, force=True, progress=False)
            pack(src, out, force=True)
            print(f"{fam} {preset}: built in {time.time() - t:.0f} s", flush=True)
        r = measure(out, a.fraction, a.tokens, fam == "switch_transformers")
        results[f"{fam} {preset}"] = r
        al = r["all"] or {}
        print(f"{fam:20s} {preset:8s} precision {al.get('precision', 0):.3f} recall {al.get('recall', 0):.3f}  "
              f"layers {r['layers']}  worst layer precision {r['worst_layer_precision']:.2f} recall "
              f"{r['worst_layer_recall']:.2f}  prefetch {r['prefetch']}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
