"""A mixed plan's host memory over a run, on the CPU, read buffers handled as on CUDA.

    .venv/bin/python benchmarks/rss_mix_cpu.py [TOKENS] [--container out/demo.zmoe] [--budget 600M]

Loads the container with a mix (of the pools' bytes: full 30%, SM only 20%, E only 50%), with no
idle room for read buffers (on CUDA the staging ring takes the window's share, so every read
with host pools maps a fresh buffer: engine/working.py), and feeds the corpus stream for TOKENS
decode steps (default 128), printing the process's RSS every 16 tokens. Used in
docs/benchmarks.md §22l: with the fetch/group reference cycle (before d48bd8e) the RSS grew by
300-340 MiB over 128 tokens, since then by 14-26 MiB.
"""

from __future__ import annotations

import argparse
import gc
import json
import os


def rss_mib() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) // 1024
    return 0


def main(argv=None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    import zipmoe
    from zipmoe.codecs.reader import ContainerReader
    from zipmoe.runtime.engine import working
    from zipmoe.runtime.plan.passes import _pass_loop, forced_stream

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tokens", nargs="?", type=int, default=128)
    ap.add_argument("--container", default="out/demo.zmoe")
    ap.add_argument("--budget", default="600M")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    working.WorkingSet._idle_room = lambda self: 0  # as on CUDA: no idle room for read buffers
    with ContainerReader(a.container) as r:
        cid = r.container_id
    probe, _ = zipmoe.load(a.container, budget=a.budget, device="cpu", workers=2)
    total = sum(probe.zipmoe.pools.values())
    probe.zipmoe.close()
    del probe
    gc.collect()
    plan = {"container_id": cid, "pools": {"full": int(0.3 * total), "compressed": 0, "sm_only": int(0.2 * total),
                                           "e_only": int(0.5 * total)}}
    model, tok = zipmoe.load(a.container, budget=a.budget, device="cpu", workers=2, plan=plan, prefetch=True)
    rt = model.zipmoe
    prompt, forced = forced_stream(tok, model.config.to_dict(), a.tokens)
    loop = _pass_loop(model, rt, int(prompt.shape[1]) + len(forced) + 1)
    by_token = []
    with torch.inference_mode():
        loop.prefill(prompt)
        for i, t in enumerate(forced):
            loop.step(torch.tensor([t], dtype=torch.long))
            if i % 16 == 15:
                by_token.append((i + 1, rss_mib()))
    print(json.dumps({"pools": rt.pools, "pools_used_MiB": round(rt.cache.used_bytes() / 2**20),
                      "rss_MiB_by_token": by_token, "fresh_buffers": rt.counters.fresh_buffers}))
    rt.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
