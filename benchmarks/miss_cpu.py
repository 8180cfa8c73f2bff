"""The miss path on the CPU: the demo at a budget that misses, before and after, and step time over 5,000 tokens.

    python benchmarks/miss_cpu.py DEMO.zmoe [--budget 800M] [--tokens 64]
        [--before-python /work/main/.venv/bin/python] [--flat-tokens 5000] [--flat-fraction 0.8]

1. TPOT at ``--budget`` (greedy, one prompt, ``--tokens`` decode steps timed after the prefill):
   "after" is this checkout's runtime (reads shared by ``readers`` threads, prefetch on, O(1)
   LFU cache); "after, no prefetch" the same with ``prefetch=False``; "before" runs the same
   measurement in a subprocess with another checkout's interpreter (``--before-python``, e.g.
   the main repository's venv before this branch is merged). Each engine runs in its own
   process, one after the other, same prompt and settings. Also printed: hits per state, MB
   read per token, prefetch precision / recall.
2. Step time over ``--flat-tokens`` decode steps (conversations of 500 tokens on ten prompts,
   one after another on one runtime: the expert cache carries over, the KV cache starts afresh,
   so the first and the last steps attend over the same lengths) at the budget that holds ``--flat-fraction`` of
   the experts' bytes (pick it so that about 90% of the uses hit the full pool; the script prints
   the hit rate): the mean step time of the first and the last 500 steps, and the cache's
   structure size at the end (bounded by the number of tensors; with the old LFU heap it grew by
   one entry per hit and admissions slowed down with it). ``--flat-tokens 0`` skips it.

Machine figures go to docs/benchmarks.md with the command line. Torch threads: 1, decode
workers: 1 (the project's CPU box has 2 shared cores).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

PROMPT = "Write a long story about a lighthouse keeper who finds a map in a bottle."
FLAT_CHUNK = 500
FLAT_PROMPTS = [PROMPT, "Explain how a steam engine works, step by step.", "Describe a busy market in Marrakesh at dawn.",
                "Write a letter from a sailor to his daughter.", "What should a beginner know about growing tomatoes?",
                "Tell the history of the printing press.", "Write a detective story set on a night train.",
                "Explain photosynthesis to a ten-year-old.", "Describe a chess game between two old friends.",
                "Write a speech for the opening of a public library."]


def measure(path: str, budget, tokens: int, prefetch: bool | None, flat: bool, readers: int | None = None) -> dict:
    import torch

    import zipmoe
    from zipmoe.runtime.engine.counters import DecodeClock, delta

    torch.set_num_threads(1)
    kw = {} if prefetch is None else {"prefetch": prefetch}
    if readers:
        kw["readers"] = readers
    try:
        model, tok = zipmoe.load(path, budget=budget, workers=1, **kw)
    except TypeError:  # an older runtime without the keyword
        model, tok = zipmoe.load(path, budget=budget, workers=1)
    rt = model.zipmoe
    # the flat run: conversations of FLAT_CHUNK tokens one after another on one runtime (its
    # expert cache carries over, the KV cache does not), so that the first and the last steps
    # attend over the same lengths and only the cache's own cost can differ
    chunks = [(PROMPT, tokens)] if not flat else [(FLAT_PROMPTS[i % len(FLAT_PROMPTS)], min(FLAT_CHUNK, tokens - i * FLAT_CHUNK))
                                                  for i in range(-(-tokens // FLAT_CHUNK))]
    steps, start = [], None
    t0 = time.perf_counter()
    for prompt, n in chunks:
        ids = tok(prompt, return_tensors="pt").input_ids
        clock = DecodeClock(rt.counters)
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, min_new_tokens=n + 1,
                           max_new_tokens=n + 1, streamer=clock, pad_token_id=tok.eos_token_id)
        steps.extend(clock.steps())
        start = start if start is not None else clock.start
    wall = time.perf_counter() - t0
    d = delta(rt.counters.snapshot(), start)
    hits = d["hits"]
    total = sum(hits.values()) or 1
    out = {
        "budget": rt.budget, "steps": len(steps), "wall_s": wall,
        "tpot_ms": 1000 * sum(steps) / max(1, len(steps)),
        "hits": {k: v / total for k, v in hits.items()},
        "mb_read_per_token": d["bytes_read"] / 1e6 / max(1, len(steps)),
        "describe": rt.describe(),
    }
    if "prediction_by_layer" in d:
        from zipmoe.runtime.engine.counters import prediction_quality

        out["prediction"] = prediction_quality(d).get("all")
        out["prefetch"] = d.get("prefetch")
    if flat:
        n = min(500, len(steps) // 2)
        out["first_ms"] = 1000 * sum(steps[:n]) / max(1, n)
        out["last_ms"] = 1000 * sum(steps[-n:]) / max(1, n)
        cache = rt.cache
        size = getattr(cache, "structure_size", None)
        out["cache_structure"] = size() if size else sum(len(p._heap) for p in cache.pools.values()) + len(cache.count)
        out["tensors"] = sum(len(ts) for ts in rt.expert_tensors.values())
    rt.close()
    return out


def _child(python: str, args: list) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    p = subprocess.run([python, os.path.abspath(__file__), "--child", *args], capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise SystemExit(f"engine {python} failed: {p.stderr.strip().splitlines()[-1] if p.stderr.strip() else p.returncode}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("container")
    ap.add_argument("--budget", default="800M")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--before-python", default=None)
    ap.add_argument("--flat-tokens", type=int, default=5000)
    ap.add_argument("--flat-fraction", type=float, default=0.8)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--prefetch", default="default", help=argparse.SUPPRESS)
    ap.add_argument("--flat", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--readers", type=int, default=0, help="reader threads of this checkout's runtime (default: its default)")
    ap.add_argument("--engines", default="before,after-no-prefetch,after",
                    help="which engines to run (comma-separated; before needs --before-python)")
    a = ap.parse_args(argv)
    if a.child:
        pf = None if a.prefetch == "default" else a.prefetch == "on"
        budget = int(a.budget) if a.budget.isdigit() else a.budget
        print(json.dumps(measure(a.container, budget, a.tokens, pf, a.flat, a.readers or None)))
        return 0
    print(f"# {a.container}, budget {a.budget}, {a.tokens} decode steps, 1 torch thread, 1 worker; "
          f"{os.uname().nodename}, load {os.getloadavg()[0]:.1f}")
    engines = []
    want = a.engines.split(",")
    rd = ["--readers", str(a.readers)] if a.readers else []
    if a.before_python and "before" in want:
        engines.append(("before", a.before_python, []))
    if "after-no-prefetch" in want:
        engines.append(("after, no prefetch", sys.executable, ["--prefetch", "off", *rd]))
    if "after" in want:
        engines.append(("after", sys.executable, ["--prefetch", "on", *rd]))
    print(f"{'engine':<20} {'TPOT ms':>8} {'full':>6} {'compr':>6} {'miss':>6} {'MB/tok':>7} {'prec':>5} {'recall':>6}")
    for name, py, extra in engines:
        r = _child(py, [a.container, "--budget", a.budget, "--tokens", str(a.tokens), *extra])
        h = r["hits"]
        pr = r.get("prediction") or {}
        f = (lambda x: f"{x:.2f}" if isinstance(x, float) else "-")
        print(f"{name:<20} {r['tpot_ms']:>8.1f} {h.get('full', 0):>6.1%} {h.get('compressed', 0):>6.1%} "
              f"{h.get('none', 0):>6.1%} {r['mb_read_per_token']:>7.1f} {f(pr.get('precision')):>5} {f(pr.get('recall')):>6}",
              flush=True)
    if a.flat_tokens:
        from zipmoe.runtime.engine.loader import requirements

        budget = int(requirements(a.container, workers=1)["budget_for"](a.flat_fraction))
        print(f"# step time over {a.flat_tokens} decode steps at {budget / 2**20:.0f} MiB "
              f"({a.flat_fraction:.0%} of the experts' bytes)")
        for name, py, extra in engines:
            if name == "after" and any(n == "after, no prefetch" for n, _, _ in engines):
                continue  # the CPU default (prefetch off) is the one that matters for the cache
            r = _child(py, [a.container, "--budget", str(budget), "--tokens", str(a.flat_tokens), "--flat", *extra])
            print(f"{name:<20} full-pool hits {r['hits'].get('full', 0):.1%}; first 500 steps {r['first_ms']:.1f} ms, "
                  f"last 500 {r['last_ms']:.1f} ms (x{r['last_ms'] / r['first_ms']:.2f}); cache structure "
                  f"{r['cache_structure']} entries for {r['tensors']} tensors", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
