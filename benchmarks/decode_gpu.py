"""Decode TPOT on the GPU with every expert resident: zipmoe graphed vs zipmoe eager vs plain transformers.

    python benchmarks/decode_gpu.py --work /tmp/dec --layers 6 --batch 1,4 --json out.json

Builds (once, in --work) a synthetic qwen2_moe checkpoint with the shapes of
qwen1.5-moe-a2.7b (``--preset``; ``--layers N`` keeps every per-layer shape and N decoder
layers, to save the synth and pack minutes) in the fused layout, packs it (codec raw: the
codec does not matter with every expert resident), then for each batch size:

* ``zipmoe-graphed``: ``zipmoe.load(..., warm=True)`` with a budget that holds every expert,
  a StaticCache, :class:`zipmoe.runtime.engine.graphs.GraphedStep` as served (its defaults);
* ``zipmoe-batched`` (batch > 1 only): GraphedStep with ``batched_sparse=True``, the graphs of
  batch > 1 sparse blocks (the default, EngineSettings.batched_sparse; before 1 Dec 2026 the
  default ran them on the host path);
* ``zipmoe-pieces``: GraphedStep with ``graph_sparse=False`` (the pieces are graphs, every
  sparse block runs the host path): what the sparse blocks' graphs add;
* ``zipmoe-eager``: the same model, the eager step (the runtime's host path every layer);
* ``zipmoe-fast``: the same warm model switched to ``kernels="fast"`` (transformers' grouped_mm
  experts function over the slots; its reference is hf-grouped_mm), graphed: one graph a step;
* ``hf-eager`` / ``hf-grouped_mm``: transformers with every weight in GPU memory,
  ``experts_implementation`` eager / grouped_mm, the same StaticCache loop.

Every engine prefills the same prompt, then decodes greedily; TPOT is the wall time of
``--tokens`` steps after ``--skip`` warm-up steps (the graphed engine's first two steps are its
eager warm-up and its capture), divided by their number, with no host sync between steps
other than the engine's own. A second, shorter pass under torch.profiler counts per token the
host's launch calls (cudaLaunchKernel & co., cudaGraphLaunch, memcpy/memset) and the GPU's
kernels, the GPU-busy time (the union of the kernels' intervals) and the kernels with most GPU
time (``top_kernels``, printed after the table). The zipmoe engines' logits
are compared with hf-eager's (zipmoe-fast's with hf-grouped_mm's), step by step (``torch.equal``):
the bit-identity contract.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch",
                "cudaMemcpyAsync", "cudaMemsetAsync", "cudaLaunchCooperativeKernel")


def log(*a) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def build(work: Path, preset: str, layers: int | None, codec: str = "raw") -> tuple[Path, Path]:
    """The qwen2_moe ``preset`` (``layers`` decoder layers when given) synthesised (fused layout) and
    packed with ``codec`` under ``work``, each step skipped when its output exists."""
    from zipmoe.codecs.writer import pack
    from zipmoe.runtime import synth
    from zipmoe.runtime.synth.family import Preset
    from zipmoe.runtime.synth.registry import get_family

    fam = get_family("qwen2_moe")
    name = preset
    if layers:
        base = fam.preset(preset)
        name = f"{preset}-{layers}L"
        fam.presets[name] = Preset(name, dict(base.config, num_hidden_layers=layers), f"{preset}, {layers} layers")
    src = work / f"{name}-src"
    out = work / (f"{name}.zmoe" if codec == "raw" else f"{name}-{codec}.zmoe")
    if not (src / "config.json").exists():
        t = time.time()
        synth.write("qwen2_moe", src, preset=name, layout="fused", force=True, progress=False)
        log(f"synth {name}: {time.time() - t:.0f} s")
    if not out.exists():
        t = time.time()
        pack(src, out, codec=codec, force=True)
        log(f"pack ({codec}) {out.stat().st_size / 2**30:.2f} GiB: {time.time() - t:.0f} s")
    return src, out


def prompt_ids(vocab: int, batch: int, n: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234 + batch)
    return torch.randint(3, vocab, (batch, n), generator=g).to(device)


class Loop:
    """Prefill then greedy steps over a StaticCache; ``step`` is GraphedStep or the eager step
    (engine/step.py's forward: the call the graphs capture, as the decode loop makes it)."""

    def __init__(self, model, prompt, context: int, graphed, graph_sparse: bool = True, batched_sparse=None,
                 attention: str = "reproducible") -> None:
        from transformers import StaticCache

        from zipmoe.runtime.engine.graphs import GraphedStep
        from zipmoe.runtime.engine.hf_compat import cache_kw
        from zipmoe.runtime.engine.step import attention_kernels, forward

        self.model = model
        self.attention = attention
        b, n = prompt.shape
        self.cache = StaticCache(config=model.config, max_cache_len=context)
        self.mask = torch.zeros((b, context), dtype=torch.int64, device=prompt.device)
        self.mask[:, :n] = 1
        self.pos = n
        with torch.no_grad(), attention_kernels(attention, prompt.device):
            self.logits = model(input_ids=prompt, attention_mask=self.mask, **{cache_kw(model): self.cache},
                                use_cache=True).logits[:, -1]
        self.graph = (GraphedStep(model, self.cache, b, graph_sparse=graph_sparse, batched_sparse=batched_sparse,
                                  attention=attention) if graphed else None)
        self._eager = forward

    def step(self):
        nxt = self.logits.argmax(-1, keepdim=True)
        self.mask[:, self.pos] = 1
        pos = torch.full((nxt.shape[0], 1), self.pos, dtype=torch.long, device=nxt.device)
        with torch.no_grad():
            if self.graph is not None:
                self.logits = self.graph(nxt, pos, self.mask)
            else:
                self.logits = self._eager(self.model, self.cache, nxt, pos, self.mask, attention=self.attention)
        self.pos += 1
        return self.logits


def profile_steps(loop: Loop, steps: int) -> dict:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            loop.step()
        torch.cuda.synchronize()
    launches = 0
    graph_launches = 0
    kernels = []
    by_name: dict = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            kernels.append((e.time_range.start, e.time_range.end))
            n, us = by_name.get(e.name, (0, 0.0))
            by_name[e.name] = (n + 1, us + e.time_range.end - e.time_range.start)
        elif e.name in LAUNCH_CALLS:
            launches += 1
            graph_launches += e.name == "cudaGraphLaunch"
    kernels.sort()
    busy = 0.0
    cur_s = cur_e = None
    for s, t in kernels:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, t
        else:
            cur_e = max(cur_e, t)
    if cur_e is not None:
        busy += cur_e - cur_s
    return {"launch_calls_per_token": launches / steps, "graph_launches_per_token": graph_launches / steps,
            "gpu_kernels_per_token": len(kernels) / steps, "gpu_busy_ms_per_token": busy / 1000.0 / steps,
            # where the GPU time goes: the kernels that take most of it, per token
            "top_kernels": [{"kernel": name[:90], "per_token": n / steps, "us_per_token": us / steps}
                            for name, (n, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:12]]}


def set_experts_implementation(model, impl: str) -> None:
    for m in model.modules():
        if getattr(m, "config", None) is not None and hasattr(m.config, "_experts_implementation"):
            m.config._experts_implementation = impl
    model.config._experts_implementation = impl


def measure(name: str, model, prompt, args, graphed: bool, ref_logits=None, graph_sparse: bool = True,
            ref_name: str = "hf_eager", batched_sparse=None) -> tuple[dict, list]:
    res: dict = {"engine": name, "batch": int(prompt.shape[0])}
    try:
        loop = Loop(model, prompt, args.context, graphed, graph_sparse, batched_sparse, args.attention)
        logits = [loop.logits.clone()]
        for _ in range(args.skip):
            logits.append(loop.step().clone())
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.tokens):
            out = loop.step()
            if len(logits) < args.compare + 1:
                logits.append(out.clone())
        torch.cuda.synchronize()
        res["tpot_ms"] = (time.perf_counter() - t0) * 1000 / args.tokens
        if ref_logits is not None:
            n = min(len(ref_logits), len(logits))
            res[f"identical_to_{ref_name}"] = all(torch.equal(a, b) for a, b in zip(ref_logits[:n], logits[:n]))
            res["compared_steps"] = n
        if loop.graph is not None:
            res["graph_stats"] = dict(loop.graph.stats)
        if args.profile_tokens:
            try:
                res.update(profile_steps(loop, args.profile_tokens))
            except Exception as exc:  # noqa: BLE001 - keep the timing
                res["profile_error"] = f"{type(exc).__name__}: {exc}"
        log(name, json.dumps(res))
        del loop
        return res, logits
    except Exception as exc:  # noqa: BLE001 - one engine's failure must not lose the others' figures
        import traceback

        traceback.print_exc()
        res["error"] = f"{type(exc).__name__}: {exc}"
        log(name, "FAILED", res["error"])
        return res, []


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/decode_gpu")
    ap.add_argument("--preset", default="qwen1.5-moe-a2.7b")
    ap.add_argument("--layers", type=int, default=0, help="decoder layers (0: the preset's)")
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    ap.add_argument("--context", type=int, default=256, help="static cache length")
    ap.add_argument("--attention", default="reproducible", choices=["reproducible", "pytorch"],
                    help="the attention kernels of every engine (engine/step.py attention_kernels)")
    ap.add_argument("--skip", type=int, default=3, help="untimed steps first")
    ap.add_argument("--tokens", type=int, default=16, help="timed steps")
    ap.add_argument("--compare", type=int, default=8, help="steps whose logits are compared")
    ap.add_argument("--profile-tokens", type=int, default=4)
    ap.add_argument("--engines", default="zipmoe-graphed,zipmoe-batched,zipmoe-pieces,zipmoe-eager,zipmoe-fast,hf-eager,hf-grouped_mm",
                    help="zipmoe-pieces: graphed pieces, every sparse block on the host path")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", default=None)
    ap.add_argument("--build-only", action="store_true", help="synth and pack, then stop (no GPU needed)")
    args = ap.parse_args(argv)
    if args.build_only:
        build(Path(args.work), args.preset, args.layers or None)
        return 0
    if args.device != "cuda" or not torch.cuda.is_available():
        print("decode_gpu: needs a CUDA device", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    import zipmoe
    from zipmoe.runtime.engine.loader import requirements

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    src, path = build(work, args.preset, args.layers or None)
    cfg = json.loads((src / "config.json").read_text())
    batches = [int(b) for b in args.batch.split(",")]
    engines = args.engines.split(",")
    results = {"machine": torch.cuda.get_device_name(), "torch": torch.__version__,
               "transformers": transformers.__version__, "preset": args.preset,
               "layers": cfg["num_hidden_layers"], "context": args.context, "prompt": args.prompt, "attention": args.attention,
               "tokens": args.tokens, "runs": []}
    prompts = {b: prompt_ids(cfg["vocab_size"], b, args.prompt, "cuda") for b in batches}

    def save():  # after every engine: a run cut short keeps what it measured
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))

    refs: dict = {}
    # plain transformers first: its eager logits are the reference
    if any(e.startswith("hf-") for e in engines):
        t = time.time()
        model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16,
                                                                  experts_implementation="eager").to("cuda").eval()
        log(f"transformers load: {time.time() - t:.0f} s")
        for impl in ("eager", "grouped_mm"):
            if f"hf-{impl}" not in engines:
                continue
            set_experts_implementation(model, impl)
            for b in batches:
                res, logits = measure(f"hf-{impl}", model, prompts[b], args, graphed=False)
                results["runs"].append(res)
                save()
                refs[(impl, b)] = logits
        del model
        gc.collect()
        torch.cuda.empty_cache()
    if any(e.startswith("zipmoe") for e in engines):
        req = requirements(path, workers=4, device="cuda")
        t = time.time()
        model, _ = zipmoe.load(path, budget=req["budget_for"](1.0), device="cuda", workers=4, warm=True)
        rt = model.zipmoe
        log(f"zipmoe load + warm: {time.time() - t:.0f} s; slots: {rt.describe()['slots']}")
        for b in batches:
            for name, graphed, sparse, batched in (("zipmoe-graphed", True, True, None),
                                                   ("zipmoe-batched", True, True, True),
                                                   ("zipmoe-pieces", True, False, None),
                                                   ("zipmoe-eager", False, False, None)):
                if name in engines and not (name == "zipmoe-batched" and b == 1):
                    res, _ = measure(name, model, prompts[b], args, graphed=graphed, ref_logits=refs.get(("eager", b)),
                                     graph_sparse=sparse, batched_sparse=batched)
                    results["runs"].append(res)
                    save()
        if "zipmoe-fast" in engines:  # --kernels fast: the same warm slots, transformers' grouped_mm function
            from zipmoe.runtime.engine.experts_hook import FAST_IMPLEMENTATION

            set_experts_implementation(model, FAST_IMPLEMENTATION)
            for b in batches:
                res, _ = measure("zipmoe-fast", model, prompts[b], args, graphed=True,
                                 ref_logits=refs.get(("grouped_mm", b)), ref_name="hf_grouped_mm")
                results["runs"].append(res)
                save()
        results["zipmoe_misses"] = rt.counters.hits.get("none", 0)
        rt.close()
    by = {(r["engine"], r["batch"]): r for r in results["runs"]}
    print(f"\n{'engine':16} {'batch':>5} {'TPOT ms':>9} {'launch/tok':>10} {'kernels/tok':>11} {'GPU busy ms':>11}  identical")
    for r in results["runs"]:
        print(f"{r['engine']:16} {r['batch']:>5} {r.get('tpot_ms', float('nan')):>9.2f} "
              f"{r.get('launch_calls_per_token', float('nan')):>10.0f} {r.get('gpu_kernels_per_token', float('nan')):>11.0f} "
              f"{r.get('gpu_busy_ms_per_token', float('nan')):>11.2f}  "
              f"{r.get('identical_to_hf_eager', r.get('identical_to_hf_grouped_mm', ''))}{r.get('error', '')}")
    for b in batches:
        g, gm = by.get(("zipmoe-graphed", b), {}), by.get(("hf-grouped_mm", b), {})
        if "tpot_ms" in g and "tpot_ms" in gm:
            print(f"batch {b}: zipmoe graphed / transformers grouped_mm = {g['tpot_ms'] / gm['tpot_ms']:.2f}")
    for r in results["runs"]:  # where each engine's GPU time goes
        if r.get("top_kernels"):
            print(f"\n{r['engine']}, batch {r['batch']}: the kernels with most GPU time, per token")
            for k in r["top_kernels"]:
                print(f"  {k['us_per_token']:9.1f} us  {k['per_token']:7.1f} x  {k['kernel']}")
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
