"""Decode on the CPU before and after zipmoe's decode loop, in one run.

    .venv/bin/python benchmarks/decode_cpu.py /tmp/h14/demo.zmoe [--threads 2] [--tokens 32]
        [--dtype auto] [--contexts 4096:fixed,4096,512:fixed] [--chat-budget 800M] [--chat-kv grow]
        [--runs 3]

1. Every expert in budget, warm (``warm=True``: no misses in the timed steps): time per
   output token of ``model.generate`` (transformers' loop, dynamic cache: the path before)
   and of :class:`zipmoe.runtime.engine.loop.DecodeLoop` (static cache, each ``--contexts``
   entry: ``N`` a cache growing to the conversation up to N positions, the default;
   ``N:fixed`` N positions allocated at once), greedy, ``--tokens`` new tokens (EOS
   suppressed), the median of ``--runs``.
2. A two-turn chat at ``--chat-budget``: TTFT and TPOT of turn 1 and turn 2, before (every
   turn ``model.generate`` on the whole rendered conversation) and after (the loop keeping the
   conversation's KV cache: turn 2 prefills only its new suffix), as ``zipmoe chat`` runs them;
   the loop once per ``--chat-kv`` (``grow``, ``fixed`` or both).

Prints one table per part and a JSON document (``--json FILE``). Timings on a shared machine
move with its load: the script prints the load average at the start and the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def _load(path, budget, threads, dtype, warm):
    import zipmoe

    return zipmoe.load(path, budget=budget, workers=1, threads=threads, warm=warm, dtype=dtype)


def _tpot(times: list[float]) -> float | None:
    return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None


class _Clock:
    def __init__(self):
        self.times, self.seen = [], False

    def put(self, _v):
        if not self.seen:
            self.seen = True
            return
        self.times.append(time.perf_counter())

    def end(self):
        pass


def resident(args) -> dict:
    import torch

    from zipmoe.runtime.engine.loader import requirements
    from zipmoe.runtime.engine.loop import DecodeLoop

    req = requirements(args.container, workers=1, dtype=args.dtype)
    budget = req["budget_for"](1.0)
    model, tok = _load(args.container, budget, args.threads, args.dtype, warm=True)
    enc = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    ids, n = enc["input_ids"], args.tokens
    out: dict = {"budget": budget, "prompt_tokens": int(ids.shape[1]), "dtype": str(model.dtype)}
    try:
        tokens = {}

        def before():
            clock = _Clock()
            with torch.inference_mode():
                seq = model.generate(**enc, max_new_tokens=n, min_new_tokens=n, do_sample=False, streamer=clock,
                                     temperature=None, top_p=None, top_k=None)
            tokens["before"] = seq[0, ids.shape[1]:].tolist()
            return _tpot(clock.times)

        rows = [("model.generate (before)", before)]
        for ctx, kv in args.contexts:
            loop = DecodeLoop(model, context=ctx, kv=kv)

            def after(loop=loop, key=f"loop@{ctx}:{kv}"):
                with torch.inference_mode():
                    res = loop.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
                tokens[key] = res.tokens[0]
                return res.stats["tpot_s"]

            what = f"grows to {loop.columns}" if loop.growing else "fixed"
            rows.append((f"loop, context {loop.context}, {what} (after)", after))
        for _, fn in rows:  # warm-up of each path
            fn()
        figures = {name: [] for name, _ in rows}
        for _ in range(args.runs):  # interleaved, so that a change of load hits every path alike
            for name, fn in rows:
                figures[name].append(fn())
        out["tpot_s"] = {k: statistics.median(v) for k, v in figures.items()}
        out["tpot_runs_s"] = figures
        out["same_tokens"] = all(v == tokens["before"] for v in tokens.values())
        out["distinct_tokens"] = len(set(tokens["before"]))  # of --tokens (every expert resident: no cache to flatter)
    finally:
        model.zipmoe.close()
    return out


def chat(args) -> dict:
    import torch

    from zipmoe.runtime.engine.turn import turn_on_generate, chat_inputs, chat_turn
    from zipmoe.runtime.engine.loop import DecodeLoop

    out = {}
    sides = {"generate": None} | {("after" if kv == "grow" else f"after ({kv})"): kv for kv in args.chat_kv}
    for side, kv in sides.items():
        model, tok = _load(args.container, args.chat_budget, args.threads, args.dtype, warm=False)
        rt = model.zipmoe
        try:
            loop = DecodeLoop(model, context=args.chat_context, kv=kv) if kv is not None else None
            history, turns = [], []
            for text in args.turns:
                history.append({"role": "user", "content": text})
                inputs = chat_inputs(tok, history, rt.device)
                with torch.inference_mode():
                    if loop is None:  # before: model.generate on the whole conversation (the encoder-decoder path)
                        res = turn_on_generate(model, tok, inputs, max_new_tokens=args.tokens, greedy=True)
                    else:
                        res = chat_turn(model, tok, inputs, max_new_tokens=args.tokens, greedy=True, loop=loop, reuse=True)
                history.append({"role": "assistant", "content": res.text})
                s = res.stats
                turns.append({k: s.get(k) for k in ("ttft_s", "tpot_s", "prompt_tokens", "prefill_tokens",
                                                     "new_tokens", "hit_rate")} | {"token_ids": res.token_ids}
                             | {"kv_columns": loop.columns if loop is not None else None})
            out["before" if kv is None else side] = turns
        finally:
            rt.close()
    out["sides"] = ["before"] + [k for k in sides if k != "generate"]
    out["same_tokens"] = [all(out[k][i]["token_ids"] == t["token_ids"] for k in out["sides"])
                          for i, t in enumerate(out["before"])]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("container")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--contexts", default="4096:fixed,4096,512:fixed",
                    help="the loop's KV caches, comma separated: N (growing up to N positions) or N:fixed")
    ap.add_argument("--chat-budget", default="800M")
    ap.add_argument("--chat-context", type=int, default=4096)
    ap.add_argument("--chat-kv", default="grow", help="the chat loop's KV cache: grow, fixed, or grow,fixed")
    ap.add_argument("--prompt", default="Write a short poem about the sea.")
    ap.add_argument("--turns", nargs="+", default=["What is the capital of France?", "And what is it famous for?"])
    ap.add_argument("--skip", choices=["resident", "chat"], default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.contexts = [(int(x.split(":")[0]), (x.split(":") + ["grow"])[1]) for x in args.contexts.split(",") if x]
    args.chat_kv = [x for x in args.chat_kv.split(",") if x]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    doc = {"container": args.container, "threads": args.threads, "tokens": args.tokens,
           "load_start": os.getloadavg(), "cores": len(os.sched_getaffinity(0))}
    print(f"load average at start: {doc['load_start'][0]:.2f} ({doc['cores']} cores)")
    if args.skip != "resident":
        r = resident(args)
        doc["resident"] = r
        print(f"\nevery expert in budget ({r['budget'] / 1e6:.0f} MB, warm), {r['dtype']}, {args.threads} threads, "
              f"{args.tokens} new tokens, prompt {r['prompt_tokens']} tokens, median of {args.runs}:")
        base = r["tpot_s"]["model.generate (before)"]
        for name, v in r["tpot_s"].items():
            print(f"  {name:34s} TPOT {v * 1000:7.1f} ms  ({base / v:.2f}x)")
        print(f"  same tokens: {r['same_tokens']}; {r['distinct_tokens']} distinct of {args.tokens}")
    if args.skip != "chat":
        c = chat(args)
        doc["chat"] = c
        print(f"\ntwo-turn chat at {args.chat_budget} (greedy, up to {args.tokens} new tokens per turn):")
        for side in c["sides"]:
            for i, t in enumerate(c[side]):
                tp = f"{t['tpot_s'] * 1000:7.1f} ms" if t["tpot_s"] else "   n/a"
                cols = f", KV {t['kv_columns']} positions" if t["kv_columns"] else ""
                print(f"  {side:14s} turn {i + 1}: TTFT {t['ttft_s']:6.2f} s, TPOT {tp}, prompt {t['prompt_tokens']} tokens, "
                      f"prefilled {t['prefill_tokens']}, {t['new_tokens']} new ({len(set(t['token_ids']))} distinct){cols}")
        print(f"  same tokens per turn: {c['same_tokens']}")
    doc["load_end"] = os.getloadavg()
    print(f"\nload average at the end: {doc['load_end'][0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)


if __name__ == "__main__":
    main()
