"""The same logits at every budget, prefetch and graphs setting, equal to transformers (issue 26's fidelity check).

On a reduced qwen1.5-moe-a2.7b shape (its real hidden size, 60 experts of its real size, top-4,
the vocabulary; ``--layers`` decoder layers), packed with zstd:

1. **Reference**: transformers computing the checkpoint (``experts_implementation="eager"``,
   bf16) stepped through zipmoe's :class:`DecodeLoop` (engine/step.py's call, the static cache),
   and checked against ``generate(cache_implementation="static")`` itself (greedy tokens and
   logits), so that the loop's call form is transformers' on this device.
2. **Teacher-forced steps**: the same prompt and the same continuation fed to every zipmoe
   configuration (budget where every expert is resident, half, a quarter; graphs on and off;
   prefetch on and off), every step's float32 logits compared with ``torch.equal`` to the
   reference: steps that differ, the first, the largest difference, layers graphed / on the host
   path, hits by state.
3. **Sampled tokens**: ``temperature 1.0, seed 7`` at every configuration: the same tokens.
0. **Attention kernels** (``--probe-attention``, ``--probe-only``): ``scaled_dot_product_attention``
   at the decode shape per kernel (PyTorch's choice, ``reproducible``, cuDNN, memory-efficient,
   math): the kernel picked, whether repeated calls give the same bits, the time per call.
   ``--attention`` (``reproducible``, the engine's default, or ``pytorch``) is what the reference
   and every zipmoe configuration run with (engine/step.py ``attention_kernels``).
4. **Pinpoint** (only when a configuration differs): at its first differing step, every decoder
   layer's attention, sparse-block input and output recorded (eager) against the reference's,
   and, graphed, each sparse block's input as the host path saw it: the first module that differs.

    python benchmarks/fidelity_gpu.py --work /tmp/fid --out OUT [--layers 6] [--steps 48]

Writes ``OUT/fidelity.json`` and prints a table. ``--device cpu --preset small`` runs the same
on the CPU (no graphs) in a minute, to check the script.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_gpu import build, log  # noqa: E402  (the same synthesised shape and packing as the decode-step benchmark)


def reference_model(src: Path, device: str):
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16, experts_implementation="eager")
    return m.to(device).eval()


ATTENTION = "reproducible"  # --attention: every loop's and the reference's attention kernels (engine/step.py)


def teacher_forced(model, prompt: torch.Tensor, stream: list, context: int, graphs: str = "off"):
    """Prefill ``prompt`` then feed ``stream`` one token per step; every step's float32 logits (CPU)."""
    from zipmoe.runtime.engine.loop import DecodeLoop

    loop = DecodeLoop(model, context=context, batch=1, graphs=graphs, attention=ATTENTION)
    with torch.inference_mode():
        out = [loop.prefill(prompt).cpu()]
        for tok in stream:
            out.append(loop.step(torch.tensor([tok])).cpu())
    return out, loop


def compare(want: list, got: list) -> dict:
    diff = [i for i, (a, b) in enumerate(zip(want, got)) if not torch.equal(a, b)]
    mx = max((float((want[i] - got[i]).abs().max()) for i in diff), default=0.0)
    return {"steps": len(got), "differ": len(diff), "first": diff[0] if diff else None, "max_abs": mx}


def sampled(model, prompt: torch.Tensor, tokens: int, context: int, graphs: str = "off") -> list:
    from zipmoe.runtime.engine.loop import DecodeLoop

    loop = DecodeLoop(model, context=context, batch=1, graphs=graphs, attention=ATTENTION)
    res = loop.generate(prompt, max_new_tokens=tokens, do_sample=True, temperature=1.0, seed=7,
                        generation_kwargs={"pad_token_id": 0})
    return res.tokens[0]


def generate_check(ref, prompt: torch.Tensor, tokens: int, context: int) -> dict:
    """transformers' own generate (static cache, greedy) against the loop on the same model."""
    from transformers import StaticCache

    from zipmoe.runtime.engine.hf_compat import NO_AUTO_COMPILE, cache_kw
    from zipmoe.runtime.engine.loop import DecodeLoop
    from zipmoe.runtime.engine.step import attention_kernels

    cache = StaticCache(config=ref.config, max_cache_len=context)
    with torch.inference_mode(), warnings.catch_warnings(), attention_kernels(ATTENTION, prompt.device):
        warnings.simplefilter("ignore")
        g = ref.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=tokens, min_new_tokens=tokens,
                         do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0,
                         **{cache_kw(ref): cache}, **NO_AUTO_COMPILE)
    want_tokens = g.sequences[0, prompt.shape[1]:].tolist()
    want_logits = [x.float().cpu() for x in g.logits]
    loop = DecodeLoop(ref, context=context, batch=1, graphs="off", attention=ATTENTION)
    res = loop.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, keep_logits=True,
                        generation_kwargs={"pad_token_id": 0})
    got_logits = [x.cpu() for x in res.logits]
    return {"tokens_equal": res.tokens[0] == want_tokens, **compare(want_logits, got_logits)}


def cli_sampling(path: Path, budgets: dict, versions: dict, device: str, tokens: int, out_dir: Path) -> dict:
    """``zipmoe chat FILE --budget B --temperature 1.0 --seed 7 --json`` (the issue's command), one cold
    process per version and budget; ``versions``: name -> the PYTHONPATH entry put first (None:
    this process's). Returns per version: the tokens per budget and whether they all agree."""
    import subprocess

    res = {}
    for name, site in versions.items():
        env = dict(os.environ)
        if site:
            env["PYTHONPATH"] = site + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        runs = {}
        for label, budget in budgets.items():
            cmd = [sys.executable, "-m", "zipmoe_cli", "chat", str(path), "--budget", str(budget), "--device", device,
                   "--prompt", "Tell me a story about a lighthouse keeper.", "--max-new-tokens", str(tokens),
                   "--temperature", "1.0", "--seed", "7", "--json"]
            if name != "before":  # the landed code before --attention existed
                cmd += ["--attention", ATTENTION]
            t = time.time()
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd="/tmp", timeout=600)
            (out_dir / f"chat-{name}-{label}.log").write_text(proc.stdout[-20000:] + "\n--- stderr\n" + proc.stderr[-20000:])
            try:
                doc = json.loads(proc.stdout)
                runs[label] = {"tokens": doc["token_ids"], "tpot_s": doc["stats"].get("tpot_s"),
                               "hits": doc["stats"].get("hits")}
            except (ValueError, KeyError):
                runs[label] = {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]}
            log(f"chat {name} {label}: {time.time() - t:.0f} s, {len(runs[label].get('tokens', []))} tokens")
        toks = [r["tokens"] for r in runs.values() if "tokens" in r]
        first = None
        if len(toks) > 1:
            a = toks[0]
            for b in toks[1:]:
                d = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                if d is not None and (first is None or d < first):
                    first = d
        res[name] = {"budgets": {k: {kk: vv for kk, vv in v.items() if kk != "tokens"} | {"distinct": len(set(v.get("tokens", [])))}
                                 for k, v in runs.items()},
                     "all_agree": len(toks) == len(runs) and all(t == toks[0] for t in toks), "first_difference": first}
    return res


# ----------------------------------------------------------------------------- pinpoint
def _first_tensor(x):
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)):
        for y in x:
            t = _first_tensor(y)
            if t is not None:
                return t
    return None


def record(model) -> tuple[dict, list]:
    """Forward hooks on every decoder layer's attention, sparse block, experts (inputs and outputs)."""
    recs: dict = {}
    handles = []
    for name, m in model.named_modules():
        tail = name.rsplit(".", 1)[-1]
        if tail in ("self_attn", "mlp", "experts", "shared_expert") and ".layers." in f".{name}":
            def hook(mod, args, kwargs, out, name=name):
                x = _first_tensor(args) if args else _first_tensor(list(kwargs.values()))
                recs[name] = (None if x is None else x.detach().float().cpu().clone(),
                              _first_tensor(out).detach().float().cpu().clone())
            handles.append(m.register_forward_hook(hook, with_kwargs=True))
    return recs, handles


def pinpoint(ref, model, prompt, stream, step: int, context: int) -> dict:
    """At teacher-forced ``step`` (its cache state equal to the reference's: the steps before agree),
    which module's output differs first, eager; and in graph pieces, which sparse block's input."""
    from zipmoe.runtime.engine import graphs as graphs_mod
    from zipmoe.runtime.engine.loop import DecodeLoop

    out = {"step": step}
    # eager, the reference and zipmoe, hooks on for the step only
    loop = DecodeLoop(ref, context=context, batch=1, graphs="off", attention=ATTENTION)
    loop.prefill(prompt)
    for tok in stream[: step - 1]:
        loop.step(torch.tensor([tok]))
    want_recs, handles = record(ref)
    want = loop.step(torch.tensor([stream[step - 1]])).cpu()
    for hh in handles:
        hh.remove()
    loop = DecodeLoop(model, context=context, batch=1, graphs="off", attention=ATTENTION)
    loop.prefill(prompt)
    for tok in stream[: step - 1]:
        loop.step(torch.tensor([tok]))
    got_recs, handles = record(model)
    got = loop.step(torch.tensor([stream[step - 1]])).cpu()
    for hh in handles:
        hh.remove()
    out["eager_logits_equal"] = bool(torch.equal(want, got))
    first = None
    order = [k for k in want_recs]  # hooks fire in execution order
    for k in order:
        if k not in got_recs:
            continue
        a, b = want_recs[k], got_recs[k]
        same_in = a[0] is None or b[0] is None or torch.equal(a[0], b[0])
        same_out = torch.equal(a[1], b[1])
        if not (same_in and same_out):
            first = {"module": k, "input_equal": same_in, "output_equal": same_out,
                     "max_abs_out": float((a[1] - b[1]).abs().max())}
            break
    out["eager_first_difference"] = first
    out["modules_compared"] = sum(1 for k in order if k in got_recs)
    # graphed pieces, sparse blocks on the host path: what each sparse block saw
    if model.zipmoe.device.type == "cuda" and graphs_mod.supported(model, 1):
        seen = []
        orig = graphs_mod.experts_host_path

        def spy(mod, hidden, ids, weights):
            res = orig(mod, hidden, ids, weights)
            seen.append((mod._zipmoe_layer, hidden.detach().float().cpu().clone(), res.detach().float().cpu().clone()))
            return res

        graphs_mod.experts_host_path = spy
        try:
            loop = DecodeLoop(model, context=context, batch=1, graphs="off", attention=ATTENTION)
            loop.graphed = graphs_mod.GraphedStep(model, loop.cache, 1, graph_sparse=False, attention=ATTENTION)
            loop.prefill(prompt)
            for tok in stream[: step - 1]:
                loop.step(torch.tensor([tok]))
            seen.clear()
            g = loop.step(torch.tensor([stream[step - 1]])).cpu()
        finally:
            graphs_mod.experts_host_path = orig
        out["pieces_logits_equal"] = bool(torch.equal(want, g))
        first = None
        names = [k for k in want_recs if k.endswith(".mlp.experts")]
        for (layer, h_in, h_out), name in zip(seen, names):
            a = want_recs[name]
            if not torch.equal(a[0], h_in) or not torch.equal(a[1], h_out):
                first = {"layer": layer, "input_equal": bool(torch.equal(a[0], h_in)),
                         "output_equal": bool(torch.equal(a[1], h_out))}
                break
        out["pieces_first_difference"] = first
    return out


# ----------------------------------------------------------------------------- attention kernels
def attention_probe(device: str, reps: int = 100, heads: int = 16, head_dim: int = 128) -> dict:
    """``scaled_dot_product_attention`` as a decode step calls it (one query per row, a boolean
    mask over a static cache of ``ctx`` positions, three quarters written), per kernel: which
    one PyTorch picks, whether ``reps`` calls on the same inputs give the same bits, and the
    time per call. The qwen1.5-moe-a2.7b attention shape (16 heads of 128)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B = SDPBackend
    kinds = {"default": None, "reproducible": [B.FLASH_ATTENTION, B.EFFICIENT_ATTENTION, B.MATH],
             "cudnn": [B.CUDNN_ATTENTION], "efficient": [B.EFFICIENT_ATTENTION], "math": [B.MATH]}

    def name_of(choice: int) -> str:
        for b in B.__members__.values():
            if int(b) == int(choice):
                return b.name
        return str(choice)

    g = torch.Generator(device=device).manual_seed(0)
    rows = []
    for ctx in (80, 640, 4096):
        for batch in (1, 4):
            shape = (batch, heads, ctx, head_dim)
            q = torch.randn((batch, heads, 1, head_dim), device=device, dtype=torch.bfloat16, generator=g)
            k = torch.randn(shape, device=device, dtype=torch.bfloat16, generator=g)
            v = torch.randn(shape, device=device, dtype=torch.bfloat16, generator=g)
            mask = torch.zeros((batch, 1, 1, ctx), dtype=torch.bool, device=device)
            mask[..., : ctx * 3 // 4] = True
            for kind, backends in kinds.items():
                row = {"context": ctx, "batch": batch, "kernels": kind}
                ctxm = sdpa_kernel(backends) if backends else torch.inference_mode()
                try:
                    with torch.inference_mode(), ctxm:
                        row["picked"] = name_of(torch._fused_sdp_choice(q, k, v, mask, 0.0, False))
                        first = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                        outs = [F.scaled_dot_product_attention(q, k, v, attn_mask=mask) for _ in range(reps)]
                        torch.cuda.synchronize()
                        row["runs_differing"] = sum(not torch.equal(first, o) for o in outs)
                        row["distinct_results"] = len({o.float().cpu().numpy().tobytes() for o in [first, *outs]})
                        t = time.perf_counter()
                        for _ in range(reps):
                            F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                        torch.cuda.synchronize()
                        row["us_per_call"] = round((time.perf_counter() - t) / reps * 1e6, 1)
                except RuntimeError as exc:
                    row["error"] = str(exc).splitlines()[0][:200]
                rows.append(row)
                log("attention", json.dumps(row))
    return {"reps": reps, "heads": heads, "head_dim": head_dim, "rows": rows}


# ----------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/zipmoe-fidelity"))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--preset", default="qwen1.5-moe-a2.7b")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--codec", default="zstd")
    ap.add_argument("--steps", type=int, default=48, help="teacher-forced steps")
    ap.add_argument("--sample", type=int, default=64, help="sampled tokens per configuration")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--fractions", default="1.0,0.5,0.25", help="expert fractions the budgets hold")
    ap.add_argument("--pinpoint-step", type=int, default=0, help="run the pinpoint at this step even without a difference")
    ap.add_argument("--before-site", default=None, help="a site folder with the code before the change: its `zipmoe chat` "
                    "runs the sampled-token check too (the reproduction)")
    ap.add_argument("--cli-tokens", type=int, default=128, help="tokens of the `zipmoe chat` sampled runs (0: skip them)")
    ap.add_argument("--context", type=int, default=0, help="the loops' static cache length (0: what the steps need; chat's is 4096)")
    ap.add_argument("--repeat", type=int, default=1, help="run the reference and every configuration this many times (run-to-run)")
    ap.add_argument("--sdpa", default="default", choices=["default", "cudnn", "flash", "efficient", "math"],
                    help="restrict scaled_dot_product_attention to one backend (diagnosis)")
    ap.add_argument("--attention", default="reproducible", choices=["reproducible", "pytorch"],
                    help="the attention kernels of the reference and of every zipmoe configuration (engine/step.py)")
    ap.add_argument("--probe-attention", action="store_true",
                    help="first: each attention kernel's choice, run-to-run bits and time at the decode shape")
    ap.add_argument("--probe-only", action="store_true", help="the attention probe alone (attention.json)")
    args = ap.parse_args(argv)
    global ATTENTION
    ATTENTION = args.attention

    import zipmoe
    from zipmoe.runtime.engine import graphs as graphs_mod
    from zipmoe.runtime.engine.loader import requirements

    args.work.mkdir(parents=True, exist_ok=True)
    out_dir = args.out or args.work
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    if args.probe_attention or args.probe_only:
        probe = attention_probe(args.device)
        probe.update(device=torch.cuda.get_device_name(), torch=torch.__version__,
                     cudnn=torch.backends.cudnn.version())
        (out_dir / "attention.json").write_text(json.dumps(probe, indent=1))
        print("\n| context | batch | kernels | picked | runs differing (of %d) | distinct | us per call |" % probe["reps"])
        print("|---:|---:|---|---|---:|---:|---:|")
        for r in probe["rows"]:
            print(f"| {r['context']} | {r['batch']} | {r['kernels']} | {r.get('picked', '-')} | "
                  f"{r.get('runs_differing', r.get('error', '-'))} | {r.get('distinct_results', '-')} | {r.get('us_per_call', '-')} |")
        if args.probe_only:
            return 0
    src, path = build(args.work, args.preset, args.layers, args.codec)
    cfg = json.loads((src / "config.json").read_text())
    g = torch.Generator().manual_seed(2026)
    prompt = torch.randint(3, cfg["vocab_size"], (1, args.prompt_tokens), generator=g)
    stream = torch.randint(3, cfg["vocab_size"], (args.steps,), generator=g).tolist()
    context = args.context or args.prompt_tokens + max(args.steps, args.sample, 16) + 8
    if args.sdpa != "default":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                   "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[args.sdpa]
        sdpa_kernel([backend]).__enter__()  # for the whole run
    dev = args.device
    doc: dict = {"preset": args.preset, "layers": args.layers, "codec": args.codec, "steps": args.steps,
                 "context": context, "sdpa": args.sdpa, "attention": args.attention, "repeat": args.repeat,
                 "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
                 "torch": torch.__version__, "configs": []}
    import transformers

    doc["transformers"] = transformers.__version__
    t = time.time()
    ref = reference_model(src, dev)
    with torch.inference_mode():
        doc["loop_vs_generate"] = generate_check(ref, prompt.to(dev), 16, context)
    log(f"reference loaded, loop vs generate: {doc['loop_vs_generate']} ({time.time() - t:.0f} s)")
    want, _ = teacher_forced(ref, prompt, stream, context)
    want_sample = sampled(ref, prompt, args.sample, context)
    for _ in range(args.repeat - 1):  # the reference against itself: is the device deterministic here?
        again, _ = teacher_forced(ref, prompt, stream, context)
        doc.setdefault("reference_repeat", []).append({**compare(want, again),
                                                       "sampled_equal": sampled(ref, prompt, args.sample, context) == want_sample})
    if doc.get("reference_repeat"):
        log("reference against itself:", json.dumps(doc["reference_repeat"]))
    log(f"reference: {len(want)} steps, sampled {len(set(want_sample))} distinct of {len(want_sample)}")

    req = requirements(path, workers=4, device=dev)
    cases = []
    for frac in [float(x) for x in args.fractions.split(",")]:
        for graphs in (("on", "off") if dev == "cuda" else ("off",)):
            cases.append((frac, graphs, None))
    cases.append((0.5, "on" if dev == "cuda" else "off", False))  # prefetch off (on by default on CUDA)
    if dev != "cuda":
        cases.append((0.5, "off", True))
    first_bad = None
    cases = [c for c in cases for _ in range(args.repeat)]
    for frac, graphs, prefetch in cases:
        budget = req["budget_for"](frac)
        kw = {} if prefetch is None else {"prefetch": prefetch}
        model, _ = zipmoe.load(path, budget=budget, device=dev, workers=4, warm=frac >= 1.0, attention=ATTENTION, **kw)
        rt = model.zipmoe
        try:
            use = graphs if graphs == "off" or graphs_mod.supported(model, 1) else "off"
            t = time.time()
            got, loop = teacher_forced(model, prompt, stream, context, graphs=use)
            c = compare(want, got)
            stats = dict(loop.graphed.stats) if loop.graphed is not None else {}
            tokens = sampled(model, prompt, args.sample, context, graphs=use)
            row = {"fraction": frac, "budget": budget, "graphs": use, "prefetch": rt.prefetch, **c,
                   "sampled_equal": tokens == want_sample, "graph_stats": stats,
                   "hits": dict(rt.counters.hits), "seconds": round(time.time() - t, 1)}
            doc["configs"].append(row)
            log(json.dumps(row))
            if c["first"] is not None and first_bad is None and c["first"] > 0:
                first_bad = (frac, graphs, prefetch, c["first"])
        finally:
            rt.close()
            del model
            torch.cuda.empty_cache() if dev == "cuda" else None
    if first_bad is None and args.pinpoint_step:
        first_bad = (0.5, "on", None, args.pinpoint_step)
    if first_bad is not None:
        frac, graphs, prefetch, step = first_bad
        kw = {} if prefetch is None else {"prefetch": prefetch}
        model, _ = zipmoe.load(path, budget=req["budget_for"](frac), device=dev, workers=4, warm=frac >= 1.0,
                               attention=ATTENTION, **kw)
        try:
            with torch.inference_mode():
                doc["pinpoint"] = {"config": [frac, graphs, prefetch], **pinpoint(ref, model, prompt, stream, step, context)}
            log("pinpoint:", json.dumps(doc["pinpoint"]))
        finally:
            model.zipmoe.close()
    if args.cli_tokens:
        versions = {"after": None}
        if args.before_site:
            versions = {"before": args.before_site, **versions}
        budgets = {f"{f:.2f}" + (f"#{r + 1}" if args.repeat > 1 else ""): req["budget_for"](f)
                   for f in [float(x) for x in args.fractions.split(",")] for r in range(args.repeat)}
        doc["chat_sampled"] = cli_sampling(path, budgets, versions, dev, args.cli_tokens, out_dir)
        log("chat sampled:", json.dumps({k: {kk: v[kk] for kk in ("all_agree", "first_difference")}
                                         for k, v in doc["chat_sampled"].items()}))
    ok = all(r["differ"] == 0 and r["sampled_equal"] for r in doc["configs"] + doc.get("reference_repeat", []))
    ok = ok and doc["loop_vs_generate"]["differ"] == 0
    ok = ok and all(v["all_agree"] for k, v in doc.get("chat_sampled", {}).items() if k == "after")
    doc["all_identical"] = ok
    (out_dir / "fidelity.json").write_text(json.dumps(doc, indent=2))
    print("\n| budget (experts) | graphs | prefetch | steps differ | first | max abs | sampled same | graphed / host layers |")
    print("|---|---|---|---:|---:|---:|---|---|")
    for r in doc["configs"]:
        gs = r["graph_stats"]
        print(f"| {r['fraction']:.2f} | {r['graphs']} | {r['prefetch']} | {r['differ']} of {r['steps']} | "
              f"{r['first'] if r['first'] is not None else '–'} | {r['max_abs']:.3g} | {r['sampled_equal']} | "
              f"{gs.get('graphed_layers', 0)} / {gs.get('host_layers', 0)} |")
    print(f"\nloop vs generate (static cache): {doc['loop_vs_generate']}")
    print("ALL IDENTICAL" if ok else "DIFFERENCES FOUND")
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
