"""Where the serving thread's time goes on the miss path (GPU): cProfile of the decode steps.

    python benchmarks/profile_miss_gpu.py --work /tmp/pm --layers 6 --fraction 0.35 --tokens 12 --out DIR

Builds (once, in --work) a synthetic qwen2_moe checkpoint with the per-layer shapes of
qwen1.5-moe-a2.7b and ``--layers`` decoder layers (fused layout), packs it with zstd, loads it
on CUDA with a budget holding ``--fraction`` of the experts' bytes, decodes 4 untimed greedy
steps, then ``--tokens`` steps under cProfile (the serving thread only: readers and decode
workers are other threads) and again without it. Writes ``profile_miss_gpu.json`` (TPOT with
and without the profiler, per-token stage seconds from the runtime's counters, fetched tensors
per token, the serving thread's seconds per fetched tensor) and ``profile_miss_gpu.txt`` (the
profile's top functions by own time and by cumulative time) into --out.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path


def build(work: Path, layers: int) -> Path:
    from zipmoe.codecs.writer import pack
    from zipmoe.runtime import synth
    from zipmoe.runtime.synth.family import Preset
    from zipmoe.runtime.synth.registry import get_family

    preset = "qwen1.5-moe-a2.7b"
    fam = get_family("qwen2_moe")
    base = fam.presets[preset]
    name = f"{preset}-{layers}L"
    fam.presets[name] = Preset(name, dict(base.config, num_hidden_layers=layers), f"{preset}, {layers} layers")
    src, out = work / f"{name}-src", work / f"{name}.zmoe"
    if not out.exists():
        work.mkdir(parents=True, exist_ok=True)
        t = time.time()
        synth.write("qwen2_moe", src, preset=name, layout="fused", force=True, progress=False)
        print(f"synth {name}: {time.time() - t:.0f} s", flush=True)
        t = time.time()
        pack(src, out, force=True)
        print(f"pack (zstd): {time.time() - t:.0f} s", flush=True)
    return out


def steps(model, loop, ids, n: int) -> float:
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    loop.generate(ids, torch.ones_like(ids), max_new_tokens=n + 1, min_new_tokens=n + 1, do_sample=False)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/pm")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--fraction", type=float, default=0.35)
    ap.add_argument("--tokens", type=int, default=12)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    import zipmoe
    from zipmoe.runtime.engine.counters import delta
    from zipmoe.runtime.engine.loader import requirements
    from zipmoe.runtime.engine.loop import DecodeLoop

    path = build(Path(a.work), a.layers)
    req = requirements(path, workers=a.workers, device="cuda")
    budget = req["budget_for"](a.fraction)
    model, _ = zipmoe.load(path, budget=budget, device="cuda", workers=a.workers)
    rt = model.zipmoe
    loop = DecodeLoop(model, context=256)
    g = torch.Generator().manual_seed(0)
    # a one-token prompt: every forward of a generate call is then a one-token step
    ids = torch.randint(0, model.config.vocab_size, (1, 1), generator=g).to("cuda")
    steps(model, loop, ids, 4)  # warm: graphs captured, kernels compiled
    c0 = rt.counters.snapshot()
    plain = steps(model, loop, ids, a.tokens)
    d = delta(rt.counters.snapshot(), c0)
    prof = cProfile.Profile()
    prof.enable()
    profiled = steps(model, loop, ids, a.tokens)
    prof.disable()
    fetched = sum(d["hits"][s] for s in ("none", "e_only", "sm_only", "compressed"))
    forwards = a.tokens + 1
    out = {
        "layers": a.layers, "budget": budget, "fraction": a.fraction, "workers": a.workers, "readers": rt.readers,
        "window": rt.window, "prefetch": rt.describe()["prefetch"],
        "generate_s": plain, "generate_profiled_s": profiled, "forwards": forwards,
        "tpot_s": plain / forwards, "tpot_profiled_s": profiled / forwards,
        "hits": d["hits"], "fetched_tensors_per_forward": fetched / forwards,
        "stage_s_per_forward": {k: v / forwards for k, v in d["time_s"].items()},
        "serving_thread_s_per_fetched_tensor": (d["time_s"]["stage"] + d["time_s"]["admit"] + d["time_s"]["wait"]) / max(1, fetched),
        "bytes_read_per_forward": d["bytes_read"] / forwards, "staging_waits": d["staging_waits"],
        "memory": rt.memory(), "prefetch_counts": d["prefetch"],
    }
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.sort_stats("tottime").print_stats(40)
    st.sort_stats("cumulative").print_stats(50)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    Path(a.out, "profile_miss_gpu.txt").write_text(s.getvalue())
    Path(a.out, "profile_miss_gpu.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))
    print("\n".join(s.getvalue().splitlines()[:70]))
    rt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
