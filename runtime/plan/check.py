"""Measured against predicted: serve prompts under a plan (and its single-pool alternatives).

    python -m zipmoe.runtime.plan.check M.zmoe --plan plan.json [--prompts builtin|corpus|FILE]
        [--workload corpus|sample|greedy] [--seed N] [--tokens 32] [--alternatives] [--json]
        [--json-out FILE] [--workers N] [--device cpu] [--no-cascade] [--alternative NAME ...]

For each plan (the chosen one, and with ``--alternatives`` every single-pool plan recorded in
plan.json's ``alternatives``), the model is loaded with the plan's budget and pools, the
prompts are served once to warm the cache (the runtime's pools converge to the most used
experts), then served again while the decode steps are timed (``--workload``: ``corpus``,
the default, teacher-forces the bundled passages or the ``--prompts`` texts, as ``zipmoe plan
--calibrate`` does; ``greedy`` answers the short built-in prompts greedily, the old behaviour;
``sample`` samples them at temperature 1.0 with ``--seed``) (a streamer stamps each
token; the prefill is excluded) and the runtime's counters are read. Printed per plan:
predicted and measured time per output token (median decode step; also the 10th percentile,
the least disturbed by other processes on a shared machine), their ratio, and the
expected vs measured experts per token per layer in each state. ``--no-cascade`` measures with
the cache's cascade off (tensors evicted from the compressed pool are dropped instead of kept
in the pools below: the policy before 2026-11-30), for the ablation in docs/benchmarks.md.
``--alternative NAME`` (repeatable; e.g. ``"full only"``) measures only those single-pool plans
beside the chosen one. Each row also keeps the timed pass's read counters (reads, bytes and
seconds per cache state, fresh read buffers) and stage times, to see where a plan's time went.

Use the same prompts and workload as the trace the plan was made from (``zipmoe plan
--calibrate builtin`` and ``--prompts builtin`` here, both the corpus by default), so that the
activation statistics match.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from zipmoe.runtime.engine.states import STATES

__all__ = ["measure_plan", "main"]


def measure_plan(path, plan: dict, prompts: list[str], tokens: int = 32, workers: int | None = None,
                 device: str = "cpu", cascade: bool = True, workload: str = "corpus", seed: int = 0) -> dict:
    """Serve ``prompts`` under ``plan`` (a plan.json dict) with ``workload`` (calibrate.py's
    :func:`~zipmoe.runtime.plan.calibrate.calibration_inputs`); measured TPOT, hits, layer makespans."""
    import torch

    from zipmoe.machine import torch_threads
    from zipmoe.runtime.plan.calibrate import calibration_inputs, load_kwargs
    from zipmoe.runtime.engine.counters import DecodeClock
    from zipmoe.runtime.engine.loader import load
    from zipmoe.runtime.engine.loop import generate_ids

    workers = workers or plan.get("workers") or 1
    # torch threads as the CLI sets them: the cores the decode workers leave (oversubscribing the
    # cores with OpenMP threads that spin makes every step many times slower)
    model, tok = load(path, budget=plan["budget"], device=device, plan=plan, workers=workers,
                      threads=torch_threads(workers), **load_kwargs(plan.get("dtype", "bfloat16")))
    rt = model.zipmoe
    if not cascade:
        rt.cache.demote = None
    units = max(1, len(next(iter(rt.expert_tensors.values()))))
    rows = calibration_inputs(tok, model.config.to_dict(), prompts, workload, tokens)

    def serve(timed: bool):
        gaps = []
        total = None
        for i, (prompt, forced) in enumerate(rows):
            ids = torch.tensor([prompt], dtype=torch.long, device=model.device)
            clock = DecodeClock(rt.counters) if timed else None
            kw = {}
            if workload == "sample":
                torch.manual_seed(int(seed) + i)
                kw = {"temperature": 1.0}
            with torch.inference_mode():
                generate_ids(model, ids, attention_mask=torch.ones_like(ids), do_sample=workload == "sample",
                             min_new_tokens=tokens, max_new_tokens=tokens, streamer=clock,
                             pad_token_id=getattr(tok, "pad_token_id", None) or getattr(tok, "eos_token_id", None),
                             forced=[forced] if forced is not None else None, **kw)
            if timed:
                d = clock.delta()
                total = d if total is None else _add(total, d)
                gaps += clock.steps()
        return gaps, total

    serve(False)  # warm the cache
    gaps, d = serve(True)
    rt.fetcher.close()
    layer_calls = max(1, int(d["layer_calls"]))
    lm = d["layer_makespan_s"]
    return {
        "tpot_s": statistics.median(gaps),
        "tpot_mean_s": statistics.fmean(gaps),
        # a low percentile is the least disturbed by other processes on a shared machine
        "tpot_p10_s": sorted(gaps)[len(gaps) // 10],
        "steps": len(gaps),
        "layer_makespan_s": sum(v[0] for v in lm.values()) / max(1, sum(v[1] for v in lm.values())),
        "hits": {s: d["hits"][s] / units / layer_calls for s in STATES},
        "bytes_read_per_token": d["bytes_read"] / max(1, len(gaps)),
        "pools": dict(rt.pools),
        "counters": {k: d[k] for k in ("reads_by_state", "fresh_buffers", "time_s", "reads", "bytes_read")},
    }


def _add(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        if isinstance(v, dict):
            out[k] = _add(a.get(k, {}), v)
        elif isinstance(v, list):
            out[k] = [x + y for x, y in zip(a.get(k, [0] * len(v)), v)]
        elif isinstance(v, (int, float)) and k != "peak_held_bytes":
            out[k] = a.get(k, 0) + v
        else:
            out[k] = v
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zipmoe.runtime.plan.check", description=__doc__.splitlines()[0])
    ap.add_argument("container")
    ap.add_argument("--plan", required=True)
    ap.add_argument("--prompts", default="builtin", help="builtin (or corpus): the workload's built-in texts; or a file, one per line")
    ap.add_argument("--workload", default="corpus", choices=("corpus", "sample", "greedy"),
                    help="corpus: teacher-force the texts (default); sample: temperature 1.0, --seed; greedy: argmax")
    ap.add_argument("--seed", type=int, default=0, help="the sample workload's seed")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--alternatives", action="store_true")
    ap.add_argument("--alternative", action="append", default=[], metavar="NAME",
                    help="measure this single-pool plan of plan.json (repeatable; e.g. 'full only')")
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-cascade", action="store_true", help="drop tensors evicted from the compressed pool (ablation)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON instead of one line per plan")
    ap.add_argument("--json-out", default=None, help="also write the rows here, rewritten after every plan")
    ap.add_argument("--debug", action="store_true", help="show the traceback of an error")
    a = ap.parse_args(argv)
    try:
        return _check(a)
    except Exception as exc:  # one line, as the CLI does; the traceback with --debug
        if a.debug:
            raise
        from zipmoe.errors import ZipmoeError

        msg = str(exc) if isinstance(exc, (ZipmoeError, ValueError)) else f"{type(exc).__name__}: {exc}"
        if isinstance(exc, OSError) and exc.filename:
            msg = f"{exc.filename}: {exc.strerror}"
        print(f"zipmoe.runtime.plan.check: error: {msg}", file=sys.stderr)
        return 2 if isinstance(exc, (OSError, ValueError, KeyError)) else 1


def _check(a) -> int:
    with open(a.plan, encoding="utf-8") as f:
        try:
            plan = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{a.plan} is not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(plan, dict) or "budget" not in plan or "pools" not in plan:
        raise ValueError(f"{a.plan} is not a plan.json from `zipmoe plan`")
    from zipmoe.runtime.plan.calibrate import read_prompts

    prompts = read_prompts(a.prompts, a.workload)
    plans = [("chosen", plan)]
    alts = plan.get("alternatives", {})
    unknown = [n for n in a.alternative if n not in alts]
    if unknown:
        raise ValueError(f"{a.plan} has no alternative {unknown[0]!r} (it has: {', '.join(repr(n) for n in alts)})")
    if a.alternatives or a.alternative:
        for name, alt in alts.items():
            if name == "no cache" or (a.alternative and name not in a.alternative):
                continue
            plans.append((name, {**plan, "pools": alt["pools"], "expected_tpot_s": alt["expected_tpot_s"],
                                 "expected_hits": alt["expected_hits"],
                                 "expected_layer_makespan_s": alt["expected_layer_makespan_s"]}))
    rows = []
    for name, p in plans:
        m = measure_plan(a.container, p, prompts, a.tokens, a.workers, a.device, cascade=not a.no_cascade,
                         workload=a.workload, seed=a.seed)
        rows.append({"plan": name, "cascade": not a.no_cascade, "pools": p["pools"], "predicted_tpot_s": p["expected_tpot_s"],
                     "measured_tpot_s": m["tpot_s"], "measured_tpot_p10_s": m["tpot_p10_s"],
                     "ratio": m["tpot_s"] / p["expected_tpot_s"],
                     "predicted_layer_s": p["expected_layer_makespan_s"], "measured_layer_s": m["layer_makespan_s"],
                     "predicted_hits": p["expected_hits"], "measured_hits": m["hits"], "steps": m["steps"],
                     "counters": m["counters"]})
        if a.json_out:  # after every plan: a long check that is cut short keeps what it measured
            with open(a.json_out, "w", encoding="utf-8") as f:
                json.dump({"container": a.container, "plan": a.plan, "device": a.device, "tokens": a.tokens,
                           "workload": a.workload, "rows": rows}, f, indent=2)
        if not a.json:
            r = rows[-1]
            hits = lambda h: "·".join(f"{h[s]:.2f}" for s in STATES)  # noqa: E731
            print(f"{name:16s} TPOT predicted {1e3 * r['predicted_tpot_s']:7.2f} ms  measured {1e3 * r['measured_tpot_s']:7.2f} ms"
                  f"  ({r['ratio']:.2f}x; p10 {1e3 * r['measured_tpot_p10_s']:.2f} ms)  layer {1e3 * r['predicted_layer_s']:.2f}/{1e3 * r['measured_layer_s']:.2f} ms"
                  f"  experts F·C·S·E·miss predicted {hits(r['predicted_hits'])} measured {hits(r['measured_hits'])}"
                  + ("" if r["cascade"] else "  (no cascade)"),
                  flush=True)
    if a.json:
        json.dump(rows, sys.stdout, indent=2)
        print()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
