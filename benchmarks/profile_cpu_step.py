"""Where a CPU decode step goes, every expert resident: torch's kernels against everything around them.

    .venv/bin/python benchmarks/profile_cpu_step.py out/demo.zmoe --source out/demo [--threads 2]
        [--dtype float32] [--context 512] [--tokens 24] [--json FILE]

In one process, the same prompt, greedy, ``--tokens`` decode steps after a prefill:

* ``zipmoe loop``: ``zipmoe.load(..., warm=True)`` with a budget that holds every expert, then
  :class:`zipmoe.runtime.engine.loop.DecodeLoop` (a StaticCache of ``--context`` positions);
* ``transformers eager``: ``from_pretrained(source, experts_implementation="eager")`` stepped by
  the same DecodeLoop (the same StaticCache length and one-token forwards): the bit-identity
  reference's arithmetic, the same kernels, none of zipmoe's runtime;
* ``transformers grouped_mm``: the same with ``experts_implementation="grouped_mm"`` (the
  kernels of ``--kernels fast``: other arithmetic);
* ``llama.cpp`` (with ``--gguf FILE``, or ``--gguf auto`` to convert the source with
  runtime.bench.gguf): llama-cpp-python on the same threads, the same prompt ids, one
  ``eval`` of one token per step (its own kernels: bf16 weights, float32 activations); what a
  CPU-only user runs instead. Its profile columns stay empty.

For each: TPOT (median step), and from a ``torch.profiler`` pass over a few steps the time
spent inside aten kernels (the top-level ops' CPU time: what any bit-identical engine must
spend with torch's kernels) against the step's wall time (the rest: Python, the module calls,
dispatch, zipmoe's bookkeeping). Prints a table and the top ops of the zipmoe step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def _steps(step_fn, first, tokens: int) -> list[float]:
    import torch

    times, nxt = [], first
    with torch.inference_mode():
        for _ in range(tokens):
            t0 = time.perf_counter()
            logits = step_fn(nxt)
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            times.append(time.perf_counter() - t0)
    return times


def _kernel_share(step_fn, first, tokens: int) -> tuple[float, float, list]:
    """(wall s per step, aten top-level CPU s per step, top ops) over ``tokens`` profiled steps."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        nxt = first
        for _ in range(tokens):
            nxt = step_fn(nxt)[:, -1].argmax(-1, keepdim=True)
        wall = (time.perf_counter() - t0) / tokens
    events = prof.events()
    # top-level aten ops: no aten parent (their children are inside their time)
    top = [e for e in events if e.name.startswith("aten::") and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
    kern = sum(e.cpu_time_total for e in top) / 1e6 / tokens
    by: dict[str, list] = {}
    for e in top:
        s = by.setdefault(e.name, [0, 0.0])
        s[0] += 1
        s[1] += e.cpu_time_total / 1e6
    ops = sorted(((n, c / tokens, t / tokens) for n, (c, t) in by.items()), key=lambda x: -x[2])[:12]
    return wall, kern, ops


def _stepper(model, ids, context: int):
    """(step function, first token) of a :class:`DecodeLoop` over ``model`` after prefilling ``ids``."""
    import torch

    from zipmoe.runtime.engine.loop import DecodeLoop

    loop = DecodeLoop(model, context=context, graphs=False)
    with torch.inference_mode():
        logits = loop.prefill(ids)

    def step(nxt):
        return loop.step(nxt)[:, None]

    return step, logits.argmax(-1, keepdim=True)


def _llama_steps(gguf: str, ids, threads: int, context: int, tokens: int) -> list[float]:
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(model_path=gguf, n_ctx=context, n_threads=threads, n_threads_batch=threads, use_mmap=True,
                          logits_all=False, verbose=False)
    llm.eval(ids[0].tolist())
    n_vocab = llm.n_vocab()
    times = []
    for _ in range(tokens):
        ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
        tok = int(np.argmax(np.ctypeslib.as_array(ptr, shape=(n_vocab,))))
        t0 = time.perf_counter()
        llm.eval([tok])
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("container")
    ap.add_argument("--source", required=True, help="the checkpoint folder the container was packed from")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--profile-tokens", type=int, default=6)
    ap.add_argument("--prompt", default="Write a short poem about the sea.")
    ap.add_argument("--gguf", default=None, help="a bf16 GGUF of the source for the llama.cpp row, or 'auto' to convert it")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM

    import zipmoe
    from zipmoe.runtime.engine.loader import requirements

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    req = requirements(args.container, workers=1, dtype=args.dtype)
    model, tok = zipmoe.load(args.container, budget=req["budget_for"](1.0), workers=1, threads=args.threads, warm=True, dtype=args.dtype)
    enc = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)
    ids = enc["input_ids"]
    engines = {"zipmoe loop": model}
    for impl in ("eager", "grouped_mm"):
        engines[f"transformers {impl}"] = AutoModelForCausalLM.from_pretrained(args.source, dtype=dtype, experts_implementation=impl).eval()
    rows, tops = [], {}
    load = os.getloadavg()[0]
    for name, m in engines.items():
        step, first = _stepper(m, ids, args.context)
        times = _steps(step, first, args.tokens)
        step, first = _stepper(m, ids, args.context)
        wall, kern, ops = _kernel_share(step, first, args.profile_tokens)
        rows.append({"engine": name, "tpot_ms": statistics.median(times) * 1e3, "profiled_step_ms": wall * 1e3,
                     "aten_ms": kern * 1e3, "outside_aten_ms": (wall - kern) * 1e3})
        tops[name] = [{"op": n, "calls": c, "ms": t * 1e3} for n, c, t in ops]
        print(json.dumps(rows[-1]), flush=True)
    if args.gguf:
        gguf = args.gguf
        if gguf == "auto":
            from pathlib import Path

            from zipmoe.runtime.bench.gguf import convert

            gguf = str(Path(args.container).with_suffix(".bf16.gguf"))
            if not Path(gguf).exists():
                convert(Path(args.source), Path(gguf))
        times = _llama_steps(gguf, ids, args.threads, args.context, args.tokens)
        rows.append({"engine": "llama.cpp (bf16 GGUF)", "tpot_ms": statistics.median(times) * 1e3, "profiled_step_ms": None,
                     "aten_ms": None, "outside_aten_ms": None})
        print(json.dumps(rows[-1]), flush=True)
    print(f"\nthreads {args.threads}, dtype {args.dtype}, context {args.context}, {args.tokens} steps; load average {load:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"{'engine':24} {'TPOT ms':>9} {'profiled':>9} {'in aten':>9} {'outside':>9}")
    for r in rows:
        cells = "".join(f" {r[k]:9.2f}" if r[k] is not None else f" {'':>9}" for k in ("profiled_step_ms", "aten_ms", "outside_aten_ms"))
        print(f"{r['engine']:24} {r['tpot_ms']:9.2f}{cells}")
    print("\nzipmoe step, top aten ops (calls / step, ms / step):")
    for o in tops["zipmoe loop"]:
        print(f"  {o['op']:32} {o['calls']:7.1f} {o['ms']:8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "load_average": load, "rows": rows, "top_ops": tops}, f, indent=1)


if __name__ == "__main__":
    main()
