"""`zipmoe plan`: size the four cache pools for a memory budget (docs/planner.md)."""

from __future__ import annotations

import json
from pathlib import Path

import typer


def _table(plan: dict, console) -> None:
    from rich.table import Table

    from zipmoe.runtime.engine.states import POOLS, STATES
    from zipmoe.units import format_size

    first = f"--only {plan['only']}" if plan.get("only") else "chosen"
    rows = [(first, plan)] + list(plan["alternatives"].items())
    best = plan["expected_tpot_s"]
    t = Table(title="plans compared (predicted per output token)", title_justify="left")
    t.add_column("plan")
    t.add_column("slots/layer\nF·C·S·E", justify="right")
    t.add_column("pools", justify="right")
    t.add_column("experts/token/layer\nF·C·S·E·miss", justify="right")
    t.add_column("layer", justify="right")
    t.add_column("TPOT", justify="right")
    t.add_column("vs\nchosen", justify="right")
    for name, p in rows:
        slots = p["slots"]["per_layer"] if p is plan else p["slots"]
        h = p["expected_hits"]
        style = "bold green" if p is plan else None
        t.add_row(name, "·".join(f"{slots[s]:.3g}" for s in POOLS),  # a part slot: 1.76 (docs/planner.md)
                  format_size(sum(p["pools"].values())),
                  "·".join(f"{h[s]:.2g}" for s in STATES),
                  f"{1e3 * p['expected_layer_makespan_s']:.3f}ms", f"{1e3 * p['expected_tpot_s']:.2f}ms",
                  f"{p['expected_tpot_s'] / best:.2f}x" if best > 0 else "-", style=style)
    console.print(t)
    console.print("[dim]F full, C compressed (E+SM), S SM only, E E only; slots go to experts by popularity rank, "
                  "hottest first, in that order[/dim]")


def plan(
    path: Path = typer.Argument(..., metavar="FILE.zmoe", help="The .zmoe container."),
    budget: str = typer.Option(None, "--budget", "-b", metavar="SIZE", help="Memory for weights: 24G, 24GiB, 512M, 1.5T or bytes."),
    trace: list[Path] = typer.Option(None, "--trace", metavar="FILE", help="Activation trace (JSON lines) from `chat --trace-out` or `bench`; repeatable."),
    calibrate: str = typer.Option(None, "--calibrate", metavar="PROMPTS", help="Record a trace by running the model on PROMPTS: `builtin` (or `corpus`: the bundled passages, teacher-forced) or a file, one text per line."),
    calibrate_workload: str = typer.Option("corpus", "--calibrate-workload", metavar="corpus|sample|greedy", help="How --calibrate decodes: corpus (teacher-force the texts, the default), sample (temperature 1.0, seed 0) or greedy (the short built-in prompts answered greedily: a random-weight model loops)."),
    profile: Path = typer.Option(None, "--profile", metavar="FILE", help="Hardware profile JSON: used if it exists (must match this machine and file), else measured and written there."),
    profile_only: bool = typer.Option(False, "--profile-only", help="Only measure (or show) the hardware profile."),
    remeasure: bool = typer.Option(False, "--remeasure", help="Measure the profile again even if a matching one exists."),
    out: Path = typer.Option(None, "-o", "--out", metavar="PLAN.json", help="Write the plan here (plan.json), for `chat --plan` and `bench --plan`."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan (or profile) as JSON instead of tables."),
    device: str = typer.Option("auto", "--device", metavar="auto|cpu|cuda", help="auto, cpu or cuda: where merges and experts compute."),
    dtype: str = typer.Option("auto", "--dtype", metavar="auto|bfloat16|float32", help="What the model will compute in, as `zipmoe chat --dtype` (auto: config.json's): float32 experts take twice the memory in the full pool."),
    calibrate_tokens: int = typer.Option(32, "--calibrate-tokens", metavar="N", help="Tokens generated per calibration prompt."),
    workers: int = typer.Option(0, "--workers", metavar="N", help="Decode workers the runtime will use (default: the runtime's default)."),
    force: bool = typer.Option(False, "--force", help="Load even under a memory limit below what serving needs (it will thrash)."),
    batch: int = typer.Option(1, "--batch", metavar="N", help="Plan for N rows served together (`bench --batch N`, `serve` with N clients): the states' costs are served at N rows once (kept in the profile) and the calibration's routing is replayed as N rows call the layers. Needs --trace or --calibrate."),
    only: str = typer.Option(None, "--only", metavar="full|compressed|sm_only|e_only", help="Write that pool's single-pool plan instead of the planner's choice (which it still prints): to measure one pool against another with `bench --plan`, or to pin one."),
) -> None:
    """Split a memory budget among the cache pools (full, compressed, SM only, E only)."""
    from zipmoe_cli.default_plan import keep_usage
    from zipmoe_cli.env import cache_dir, load_options

    engine_options = load_options(force)  # ZIPMOE_READERS / _PREFETCH / _FORCE, and --force
    from rich.console import Console

    from zipmoe.codecs.reader import ContainerReader
    from zipmoe.errors import UsageError
    from zipmoe.machine import decode_workers, resolve_device
    from zipmoe.runtime.plan.calibrate import read_prompts, read_recall, record_trace
    from zipmoe.runtime.plan.layout import container_layout
    from zipmoe.runtime.plan.planner import REPLAY_SHORTLIST, make_plan
    from zipmoe.runtime.plan.stats import from_traces, uniform
    from zipmoe.runtime.plan.busy import busy_warning
    from zipmoe.runtime.plan.profile import get_profile
    from zipmoe.units import format_size, parse_size

    err = Console(stderr=True)
    con = Console()
    if workers < 0:
        raise UsageError(f"--workers must be at least 1, got {workers}")
    from zipmoe.runtime.plan.search import POOLS

    if only is not None and only not in POOLS:
        raise UsageError(f"--only: one of {', '.join(POOLS)}, got {only!r}")
    if only is not None and profile_only:
        raise UsageError("--only writes a plan; it does not go with --profile-only")
    if batch < 1:
        raise UsageError(f"--batch must be at least 1, got {batch}")
    if batch > 1 and not (trace or calibrate) and not profile_only:
        raise UsageError("--batch N replays recorded routing as N rows call the layers: give --trace or --calibrate "
                         "(or --profile-only to measure its costs alone)")
    workers = workers or decode_workers()
    budget_bytes = parse_size(budget) if budget is not None else None
    if budget_bytes is None and not profile_only:
        raise UsageError("--budget is required (e.g. --budget 24G), unless --profile-only")
    dev = resolve_device(device)
    from zipmoe.runtime.plan.layout import expert_tensors

    with ContainerReader(path) as reader:
        layout = container_layout(reader, dtype, dev)
        cid = reader.container_id
        # the tensors a replay of the routing needs (--trace, --calibrate), read with the index once
        ets = expert_tensors(reader, compute_itemsize=layout.compute_itemsize) if (trace or calibrate) and not profile_only else None
    if budget_bytes is not None and budget_bytes < layout.min_budget(workers):
        make_plan(layout, budget_bytes, None, {}, workers=workers)  # raises BudgetError with the minimum

    # activation statistics first: a bad trace or prompts file fails before anything is measured
    stats = None
    if not profile_only:
        traces = list(trace or [])
        if traces:  # validate the given traces before calibrating or measuring
            from_traces(traces, container_id=cid, num_experts=layout.num_experts, top_k=layout.top_k,
                        layers=layout.sparse_layers)
        if calibrate is not None:
            prompts = read_prompts(calibrate, calibrate_workload)  # an unknown workload is one line
            if not as_json:
                err.print("[dim]calibrating: running the model on the prompts with a trace...[/dim]")
            if calibrate_tokens < 1:
                raise UsageError(f"--calibrate-tokens must be at least 1, got {calibrate_tokens}")
            traces.append(record_trace(path, prompts, budget_bytes, dev, workers, calibrate_tokens, layout.dtype,
                                       load_options=engine_options, workload=calibrate_workload,
                                       on_done=keep_usage))  # the default plan fits from this routing too
            if not as_json:
                err.print(f"[dim]calibration trace: {traces[-1]} (reuse it with --trace)[/dim]")
        if traces:
            stats = from_traces(traces, container_id=cid, num_experts=layout.num_experts, top_k=layout.top_k,
                                layers=layout.sparse_layers)
        else:
            stats = uniform(layout.num_experts, layout.top_k, layout.sparse_layers, cid)

    if not as_json:
        err.print("[dim]hardware profile: measuring or reusing (a few seconds the first time)...[/dim]")
    measure_options = dict(engine_options)
    readers = measure_options.pop("readers", None)
    prof, source = get_profile(path, cid, dev, profile, workers=workers, remeasure=remeasure, dtype=layout.dtype,
                               cache_dir=cache_dir(), load_options=measure_options,
                               **({"readers": readers} if readers is not None else {}))
    where = str(profile) if profile is not None else "cache"
    busy = busy_warning(prof)
    if busy and not as_json:
        err.print(busy, style="yellow", markup=False, highlight=False)
    if batch > 1:  # the states' costs served at the batch, measured once and kept in the profile
        from zipmoe.runtime.plan.batched import ensure_batch, has_batch
        from zipmoe.runtime.plan.profile import default_profile_path

        if not as_json and not has_batch(prof, batch):
            err.print(f"[dim]serving each cache state at batch {batch} (once; kept in the profile)...[/dim]")
        keep = profile if profile is not None else default_profile_path(cid, dev, layout.dtype, cache_dir=cache_dir())
        prof, _ = ensure_batch(prof, batch, path, layout, device=dev, workers=workers,
                               load_options={**engine_options, **({"readers": r} if (r := prof.get("disk", {}).get("readers")) else {})},
                               save_to=keep)

    if profile_only:
        if as_json:
            con.print_json(json.dumps(prof))
        else:
            c = prof["costs"]
            con.print(f"[bold]profile[/bold] ({source}, {where}) for {path.name} on {prof['machine']['hostname']} "
                      f"/ {prof['machine']['cpu_model']} / {prof['machine']['device']}")
            alone = prof["disk"].get("latency_s", c["disk_latency"])
            alone_bw = prof["disk"].get("bw", c["disk_bw"])
            serving = c["disk_latency"] - alone
            con.print(f"  disk       {format_size(alone_bw)}/s cold, latency {1e6 * alone:.0f} us ({prof['disk']['method']})"
                      + (f" + {1e6 * serving:.0f} us per read while serving" if serving > 0 else "")
                      + (f"; {format_size(c['disk_bw'])}/s while serving" if c["disk_bw"] < 0.999 * alone_bw else ""))
            if c.get("merge_overhead_s"):
                con.print(f"  serving    {1e6 * c['merge_overhead_s']:.0f} us of the runtime's own work per fetched tensor")
            con.print(f"  decompress {format_size(c['decomp_bw_per_worker'])}/s bf16 per worker ({prof['decomp']['codec']})")
            con.print(f"  merge      {format_size(c['merge_bw'])}/s bf16 ({prof['merge']['kernel']})")
            con.print(f"  compute    {1e3 * c['compute_s_per_expert']:.3f} ms per expert per token "
                      f"({prof['compute']['torch_threads']} torch threads)")
            from zipmoe.runtime.plan.batched import step_costs_at

            for n in sorted((prof.get("batches") or {}), key=int):
                sc = step_costs_at(prof, int(n))
                if sc:
                    a = sc["per_expert_s"]
                    con.print(f"  batch {n}    served at {n} rows: resident step {1e3 * sc['resident_step_s']:.2f} ms, per chosen "
                              f"expert (ms) " + ", ".join(f"{k} {1e3 * v:.3f}" for k, v in a.items()))
        return

    replay = None
    if traces:  # the recorded routing itself: the best candidates are judged by replaying it (docs/planner.md)
        from zipmoe.runtime.plan.replay import layer_calls_from_trace

        replay = (layer_calls_from_trace(traces, layers=layout.sparse_layers), ets)
    result = make_plan(layout, budget_bytes, stats, prof, workers=workers, device=dev, profile_source=source,
                       profile_path=str(profile) if profile is not None else None,
                       prefetch_recall=read_recall(traces) if traces else None, replay=replay, only=only,
                       batch=batch)
    if out is not None:
        try:
            out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        except OSError as exc:
            raise UsageError(f"cannot write {out}: {exc.strerror or exc}") from None
    if as_json:
        con.print_json(json.dumps(result))
        return
    c = result["profile"]["costs"]
    con.print(f"[bold]plan[/bold] for {path.name} under {format_size(budget_bytes)}: dense weights "
              f"{format_size(result['dense_bytes'])}, working set {format_size(result['working_bytes'])}, "
              f"cache pools {format_size(result['pool_bytes_available'])}")
    if stats.source == "uniform prior":
        con.print("[yellow]no trace given: expert popularity is the uniform prior (every expert equally likely); "
                  "pass --trace or --calibrate for a plan that follows real routing[/yellow]")
    else:
        s = stats.summary()
        basis = (f"its {s['decode_steps']} decode steps (prompts left out: the plan is for output tokens)"
                 if s["basis"] == "decode steps" else "all of them")
        con.print(f"activations: {s['tokens']} tokens from {len(s['files'])} trace(s), counted from {basis}; top-{s['top_k']} "
                  f"ranks take {100 * s['top_k_share']:.0f}% of selections (uniform: {100 * s['top_k'] / s['num_experts']:.0f}%)")
        sr = result["search"]
        if sr.get("judged_by") == "replay":
            con.print(f"hits: the best {REPLAY_SHORTLIST} candidates and the single-pool plans judged by replaying the traces' "
                      f"{sr['replayed_layer_calls']} layer calls ({sr['replayed_decode_calls']} of decode steps) through the "
                      "runtime's cache from empty; predictions below are for that routing from a cold start "
                      "(the rank model's steady state and the routing replayed warm are in plan.json)")
    con.print(f"costs ({result['profile']['source']}, {result['profile']['disk_method']}; as served): disk "
              f"{format_size(c['disk_bw'])}/s + {1e6 * c['disk_latency']:.0f} us, decompress "
              f"{format_size(c['decomp_bw_per_worker'])}/s x {workers} workers, merge {format_size(c['merge_bw'])}/s, "
              f"expert {1e3 * c['compute_s_per_expert']:.3f} ms")
    rec = result["profile"].get("prefetch_recall")
    if rec is not None:
        con.print(f"prefetch: recall {rec:.2f} in the calibration; it hides up to "
                  f"{1e3 * result['expected_prefetch_credit_s_per_token']:.2f} ms per token of the chosen plan's fetches "
                  f"(bounded by the time between two sparse layers)")
    if dev.startswith("cuda"):
        con.print("[dim]the full pool lives in GPU memory, the other pools in host memory; the budget counts both (and the pinned staging ring)[/dim]")
    _table(result, con)
    for line in result.get("explain") or []:  # the arithmetic behind the choice (runtime/plan/planner.py)
        con.print(line, markup=False, highlight=False)
    singles = [v["expected_tpot_s"] for k, v in result["alternatives"].items() if k != "no cache"]
    if singles and min(singles) > 0:
        gain = min(singles) / result["expected_tpot_s"]
        con.print(f"{'written' if only else 'chosen'} plan: {format_size(sum(result['pools'].values()))} in pools, predicted "
                  f"{1e3 * result['expected_tpot_s']:.2f} ms per token, {gain:.2f}x the best single-pool plan")
    if out is not None:
        con.print(f"wrote {out} (use it with `zipmoe chat {path.name} --plan {out}`)")
    else:
        con.print("[dim]pass -o plan.json to save it[/dim]")
