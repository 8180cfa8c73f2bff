"""`zipmoe bench`: zipmoe against Accelerate's disk offload (and other baselines), side by side.

The work is in zipmoe.runtime.bench: run (the driver), inputs (prompts, token ids, the files the
engines read), worker (one engine's process), engines, cgroup, cold and report; docs/bench.md
explains the method.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer


class _Progress:
    """A rich progress bar over runs (each engine's worker reports each finished run)."""

    def __init__(self, total: int):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        console = Console(stderr=True)
        self.prog = Progress(TextColumn("[bold]bench[/bold] {task.description}"), BarColumn(), MofNCompleteColumn(),
                             TimeElapsedColumn(), console=console, transient=False, disable=not console.is_terminal)
        self.task = self.prog.add_task("", total=total)
        self.prog.start()

    def describe(self, text: str) -> None:
        self.prog.update(self.task, description=text)

    def advance(self, n: int = 1) -> None:
        if n > 0:
            self.prog.advance(self.task, n)

    def close(self) -> None:
        self.prog.stop()


def _print_report(doc: dict, plot_path: Optional[Path], compact: bool = False) -> None:
    from rich.console import Console

    from zipmoe.runtime.bench import report as bench_report
    from zipmoe.units import format_size

    import sys

    con = Console(width=None if sys.stdout.isatty() else 250)
    machine = doc.get("machine", {})
    bw = doc.get("disk_bw") or {}
    cg = doc.get("cgroup") or {}
    title = f"zipmoe bench · {Path(doc.get('container', '?')).name} · {doc.get('device')} · {machine.get('gpu') or machine.get('cpu') or ''}"
    bench_report.render_table(doc.get("summary", []), doc.get("ratios", []), console=con, title=title, compact=compact)
    notes = []
    if not compact and bench_report.render_predictions(doc.get("summary", []), (doc.get("model") or {}).get("top_k"), console=con):
        notes.append("predicted: the plan's own prediction (plan.json, made from the calibration before the run; zipmoe-basic: its "
                     "'full only' alternative); model: the profile's served state costs charged for this run's own routing "
                     "replayed through a cache with its pools (the cost model alone); at batch N both per step of N rows, from a "
                     "plan made for N rows (zipmoe plan --batch N) and the profile's costs served at N rows; × = measured / predicted; "
                     "experts per decode layer call in each state (measured: the run's counters, prefill included)")
    if bench_report.render_paired(doc.get("paired") or [], console=con):
        notes.append("round by round: each engine's median TPOT in a round over the first engine's in the same round "
                     "(--rounds; rounds alternate the engines' order), the median and range of those ratios")
    if not compact and bench_report.render_host_work(doc.get("summary", []), console=con):
        notes.append("the serving thread per fetched tensor (a compute tensor that was not a full-pool hit), prefill "
                     "included: host = its own work in the fetch pipeline (admit and the parts after it are in it; other: "
                     "the loop's bookkeeping), predict and wait beside it (docs/runtime.md, 'Host work per fetched tensor')")
    if bw.get("bytes_per_s"):
        notes.append(f"disk {format_size(bw['bytes_per_s'])}/s ({bw.get('source')}); floor = bytes read per token / disk bandwidth")
    notes.append(f"cache: {doc.get('cold_mode')}" + ("" if doc.get("cold_mode") != "o_direct" else " (page cache could not be dropped)"))
    notes.append("memory cgroup: " + (f"v{cg.get('version')}, limit = budget + the process's own baseline (measured) + {format_size(cg.get('slack_bytes') or 0)}" if cg.get("usable") else f"none ({cg.get('reason')})"))
    tc = doc.get("token_check") or {}
    if tc:
        notes.append(tc.get("message", ""))
    for res in doc.get("results", []):
        at = f"{res['engine']} @ {format_size(res['budget']) if res.get('budget') else 'none'}"
        line = (res.get("load_info") or {}).get("default_plan")
        if line:  # zipmoe-default: which plan it fitted at load, as chat and serve say it (its last line; warnings before it)
            notes.append(f"{at}: {line.strip().splitlines()[-1]}")
        if res.get("budget_broken"):
            notes.append(f"{at} broke the budget: {res['budget_broken']}")
    runs = [r for res in doc.get("results", []) for r in res.get("runs", [])]
    wl = sorted({str(r.get("workload") or "greedy") for r in runs})
    if wl:
        notes.append("workload: " + ", ".join(wl) + (" (teacher-forced text: runtime/data/corpus.txt or --prompts)" if "corpus" in wl else ""))
    if any(r.get("belady_hit_rate") is not None for r in runs):
        notes.append("distinct tok: distinct ids over all rows (↻p: the tokens cycle with period p); experts: distinct (layer, expert) "
                     "pairs of the decode steps; hit ¼: hits in any pool over the first → last quarter of the decode steps; "
                     "MIN: Belady's optimum at the same capacity in experts (≤: mixed pools, an upper bound)")
    if any(r.get("stopped_by_time_limit") for r in doc.get("summary", [])):
        notes.append("* stopped by --time-limit: fewer tokens than asked (the comparison is per token)")
    notes += bench_report.cycle_warnings(runs)
    for n in notes:
        con.print(f"  {n}", style="bold red" if n.startswith(("tokens DIFFER", "WARNING")) else "dim", markup=False)
    if plot_path is not None:
        bench_report.plot(doc.get("summary", []), str(plot_path))
        con.print(f"  plot: {plot_path}")


def _paper(docs: list, show: bool, json_path: Optional[Path], plot_path: Optional[Path], md_path: Optional[Path] = None) -> None:
    """The paper's tables from the results (runtime/bench/tables.py), when asked for."""
    if not (show or json_path or plot_path or md_path):
        return
    from zipmoe.runtime.bench import tables

    tables.emit_all(docs, show=show, json_path=json_path, plot_path=plot_path, md_path=md_path)


def bench(
    file: Optional[Path] = typer.Argument(None, help="The .zmoe container (not needed with --report)."),
    baseline: List[str] = typer.Option([], "--baseline", help="Baseline to compare with: accelerate, uncompressed, resident, deepspeed, llama.cpp, moe-infinity (repeatable)."),
    budget: List[str] = typer.Option([], "--budget", help="Memory budget, e.g. 8G (repeatable)."),
    batch: str = typer.Option("1", "--batch", help="Batch sizes, comma separated, e.g. 1,4,16."),
    new_tokens: str = typer.Option("32", "--new-tokens", help="New tokens per run, comma separated, e.g. 32,128."),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="Prompts, one per line (or JSON lines with 'prompt'); with --workload corpus the texts to teacher-force."),
    workload: str = typer.Option("corpus", "--workload", metavar="corpus|sample|greedy", help="What every engine decodes: corpus (teacher-forced English text, the default), sample (--temperature sampling, --seed) or greedy (argmax: a random-weight model loops)."),
    seed: int = typer.Option(0, "--seed", help="The sample workload's seed (torch.manual_seed before every run)."),
    temperature: float = typer.Option(1.0, "--temperature", help="The sample workload's temperature."),
    runs: int = typer.Option(3, "--runs", help="Measured runs per engine, budget and case (median, min, max)."),
    rounds: int = typer.Option(1, "--rounds", help="Run every engine and budget this many times over, in reverse order every other round (a fresh process each), and print each engine's TPOT against the first engine's round by round: ratios that a drift of the disk between runs does not skew."),
    cold: bool = typer.Option(True, "--cold/--warm", help="Drop the page cache before every run (default) or warm it with a first run."),
    plan: Optional[Path] = typer.Option(None, "--plan", help="plan.json from `zipmoe plan` for the zipmoe engine."),
    source: Optional[Path] = typer.Option(None, "--source", help="The model's safetensors folder for the Hugging Face baselines (else the container is unpacked)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write every run and the summary here (kept when something fails)."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="PNG of time per output token by budget (needs matplotlib: zipmoe[bench])."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
    engine: List[str] = typer.Option([], "--engine", help="Run exactly these engines instead of zipmoe + baselines: zipmoe, zipmoe-noprefetch, zipmoe-pools, zipmoe-basic, uncompressed, accelerate, resident, deepspeed, llama.cpp, moe-infinity."),
    ablations: bool = typer.Option(False, "--ablations", help="Also run zipmoe-basic (basic eviction only), zipmoe-pools (heterogeneous pools, no plan) and zipmoe-noprefetch (the plan without prefetch)."),
    raw_container: Optional[Path] = typer.Option(None, "--raw-container", help="An existing codec-raw .zmoe for 'uncompressed' (else packed from the source once)."),
    work_dir: Optional[Path] = typer.Option(None, "--work-dir", help="Folder for the unpacked source, raw container, offload folders and logs (default FILE.bench/ next to FILE)."),
    time_limit: float = typer.Option(120.0, "--time-limit", help="Seconds after which a run stops once it has --min-tokens tokens (slow baselines make fewer tokens); 0 = none."),
    engine_timeout: float = typer.Option(0.0, "--engine-timeout", help="Seconds after which an engine's worker is killed (its finished runs kept, the engine reported as timed out); 0 = none."),
    min_tokens: int = typer.Option(2, "--min-tokens", help="Tokens a run makes before --time-limit can stop it (at least 2 for a time per token)."),
    context: Optional[int] = typer.Option(None, "--context", help="The zipmoe engines' KV cache in tokens (default: the run's longest prompt + new tokens, rounded up to 64; clamped to the model's max_position_embeddings); on the CPU its bytes are added to the cgroup on top of the budget."),
    threads: int = typer.Option(0, "--threads", help="torch threads in every engine (default: the zipmoe engines take the cores their decode workers leave, as chat does; the others torch's default)."),
    cgroup_slack: Optional[str] = typer.Option(None, "--cgroup-slack", help="Cgroup margin on top of the budget and the process's measured baseline (default 256M on CPU, 1G with CUDA)."),
    cold_method: str = typer.Option("auto", "--cold-method", help="How cold runs empty the page cache: auto (drop_caches where permitted, else fadvise), drop_caches, or fadvise (POSIX_FADV_DONTNEED on the engine's files only)."),
    no_cgroup: bool = typer.Option(False, "--no-cgroup", help="Do not put engines in memory cgroups (budgets then rely on the engines alone)."),
    cgroup_move_to_leaf: bool = typer.Option(False, "--cgroup-move-to-leaf", help="cgroup v2, root only: when the memory controller cannot be enabled because this cgroup holds processes, move them (this shell included) into a leaf child zipmoe-leaf, as container runtimes do; they stay there."),
    disk_bw: Optional[str] = typer.Option(None, "--disk-bw", help="Disk bandwidth for the I/O floor, e.g. 1.5G (per second); default: plan's profile, else measured."),
    profile: Optional[Path] = typer.Option(None, "--profile", help="Hardware profile from `zipmoe plan --profile-only --profile FILE` (its disk bandwidth sets the I/O floor)."),
    trace_out: Optional[Path] = typer.Option(None, "--trace-out", help="Record the zipmoe engine's activation trace here (for `zipmoe plan --trace`)."),
    merge: bool = typer.Option(False, "--merge", help="Add to the results already in --json (resumable stages) instead of starting afresh."),
    report: List[Path] = typer.Option([], "--report", help="Only print the table (and --plot) of an existing bench JSON; repeatable with --paper*: the paper's tables of several models (and their --pressure runs) from one command."),
    compact: bool = typer.Option(False, "--compact", help="A narrow table: TPOT, its ratio to the I/O floor and to each baseline."),
    gguf: Optional[Path] = typer.Option(None, "--gguf", help="A bf16 GGUF of the model for the llama.cpp baseline (else converted from the source once by llama.cpp's convert_hf_to_gguf.py)."),
    llama_cpp_source: Optional[Path] = typer.Option(None, "--llama-cpp-source", metavar="DIR", help="The folder with llama.cpp's convert_hf_to_gguf.py and gguf-py/ for the llama.cpp baseline's conversion: a llama.cpp checkout, an unpacked llama-cpp-python sdist or `python -m zipmoe.runtime.bench.llamacpp_convert fetch DIR`'s folder. Default: $ZIPMOE_BENCH_LLAMA_CPP_SOURCE, else the cache's, fetched once from the installed llama-cpp-python's sdist."),
    moe_infinity_site: Optional[Path] = typer.Option(None, "--moe-infinity-site", metavar="DIR", help="The moe-infinity baseline's own Python folder: MoE-Infinity built from source with the packages it pins (benchmarks/moe_infinity_build.sh makes it); only that engine's process sees it. Default: $ZIPMOE_BENCH_MOE_INFINITY_SITE."),
    paper: bool = typer.Option(False, "--paper", help="Also print the paper's tables (TTFT/TPOT, throughput by batch, latency by length, ablation) from the results."),
    paper_json: Optional[Path] = typer.Option(None, "--paper-json", help="Write the paper's tables as JSON here."),
    paper_plot: Optional[Path] = typer.Option(None, "--paper-plot", help="PNG of the paper's tables (needs matplotlib)."),
    paper_md: Optional[Path] = typer.Option(None, "--paper-md", help="Write the paper's tables as markdown here (what docs/benchmarks.md quotes)."),
    pressure: Optional[str] = typer.Option(None, "--pressure", metavar="SIZE", help="Memory pressure (the paper's experiment with host memory occupied): while the engines run, occupy the host's memory until only SIZE stays available to them and the page cache; recorded, and the paper's tables compare these runs with the same engines' runs without it."),
    deepspeed_offload: Optional[str] = typer.Option(None, "--deepspeed-offload", metavar="auto|nvme|cpu", help="Where the deepspeed baseline offloads its parameters: nvme (fails with one line where DeepSpeed's async_io op cannot be built), cpu (outside the budget), auto (nvme where it can be built; the default). Default: $ZIPMOE_BENCH_DEEPSPEED_OFFLOAD."),
    deepspeed_build_timeout: Optional[float] = typer.Option(None, "--deepspeed-build-timeout", metavar="SECONDS", help="Time limit for building DeepSpeed's async_io op (default: $ZIPMOE_BENCH_DEEPSPEED_BUILD_TIMEOUT, else 1800)."),
    deepspeed_libaio: Optional[Path] = typer.Option(None, "--deepspeed-libaio", metavar="PREFIX", help="A libaio installed into PREFIX (include/libaio.h, lib/libaio.so: benchmarks/libaio_build.sh build makes one) for DeepSpeed's async_io op, where the machine has no libaio-dev; the op's build and the engines' workers get the compiler and loader paths to it. Default: $ZIPMOE_BENCH_DEEPSPEED_LIBAIO."),
    deepspeed_load_in_budget: Optional[bool] = typer.Option(None, "--deepspeed-load-in-budget/--deepspeed-load-unbudgeted", help="Keep the deepspeed baseline's memory cgroup at the budget while it loads too (default: unbudgeted loading, the cgroup tightened once loaded; $ZIPMOE_BENCH_DEEPSPEED_LOAD_IN_BUDGET=1 sets it)."),
) -> None:
    """Serve the same model with zipmoe and with baselines under the same budget; compare per token."""
    from zipmoe.errors import UsageError
    from zipmoe.runtime.bench import engines as bench_engines
    from zipmoe.runtime.bench import run as bench_run
    from zipmoe.units import parse_size

    if report:
        docs = [bench_run.finalize(bench_run.load_results(r)) for r in report]
        if len(docs) > 1 and not (paper or paper_json or paper_plot or paper_md):
            raise UsageError("several --report files go into the paper's tables: add --paper, --paper-json, --paper-md or --paper-plot")
        if len(docs) == 1:
            _print_report(docs[0], plot, compact)
        _paper(docs, paper, paper_json, paper_plot, paper_md)
        return
    if file is None:
        raise UsageError("give the .zmoe container to benchmark (or --report out.json)")
    for b in baseline:
        if b not in bench_engines.BASELINES:
            raise UsageError(f"unknown baseline {b!r}: choose from {', '.join(bench_engines.BASELINES)}")
    for e in engine:
        bench_engines.engine(e)
    if engine:
        engines = list(dict.fromkeys(engine))
    else:
        engines = ["zipmoe"] + (["zipmoe-noprefetch", "zipmoe-pools", "zipmoe-basic"] if ablations else []) + list(dict.fromkeys(baseline))
    if cold_method not in ("auto", "drop_caches", "fadvise"):
        raise UsageError(f"unknown --cold-method {cold_method!r}: use auto, drop_caches or fadvise")
    if cold_method == "drop_caches" and cold:
        from zipmoe.runtime.bench.cold import can_drop_caches

        if not can_drop_caches():
            raise UsageError("--cold-method drop_caches needs write access to /proc/sys/vm/drop_caches (root); use fadvise")
    if cgroup_move_to_leaf and no_cgroup:
        raise UsageError("--cgroup-move-to-leaf and --no-cgroup contradict each other: give one of them")
    if context is not None and context < 2:
        raise UsageError("--context must be at least 2 tokens")
    if runs < 1:
        raise UsageError(f"--runs must be at least 1, got {runs}")
    if rounds < 1:
        raise UsageError(f"--rounds must be at least 1, got {rounds}")
    from zipmoe.runtime.plan.workload import check_workload

    check_workload(workload)
    if not temperature > 0:
        raise UsageError(f"--temperature must be above 0, got {temperature:g} (use --workload greedy for argmax)")
    if min_tokens < 1:
        raise UsageError(f"--min-tokens must be at least 1, got {min_tokens}")
    if threads < 0:
        raise UsageError(f"--threads must not be negative, got {threads}")
    if engine_timeout < 0:
        raise UsageError(f"--engine-timeout must not be negative, got {engine_timeout:g}")
    if pressure is not None:
        from zipmoe.runtime.bench.pressure import check_leave

        check_leave(parse_size(pressure))
    from zipmoe.runtime.bench.deepspeed_engine import check_libaio, check_offload, use_libaio
    from zipmoe_cli.env import cache_dir, deepspeed_env, deepspeed_libaio_env, engine_env, llama_cpp_source_env, moe_infinity_site_env

    zipmoe_env = engine_env()  # ZIPMOE_READERS / ZIPMOE_PREFETCH for the zipmoe engines (bench forces every load)
    ds_env = deepspeed_env()
    ds_offload = check_offload(deepspeed_offload) if deepspeed_offload is not None else ds_env["offload"]
    if deepspeed_build_timeout is not None and not 0 < deepspeed_build_timeout < float("inf"):
        raise UsageError(f"--deepspeed-build-timeout must be a number of seconds above 0, got {deepspeed_build_timeout:g}")
    ds_timeout = deepspeed_build_timeout if deepspeed_build_timeout is not None else ds_env["build_timeout_s"]
    ds_in_budget = deepspeed_load_in_budget if deepspeed_load_in_budget is not None else bool(ds_env["load_in_budget"])
    ds_libaio = check_libaio(deepspeed_libaio) if deepspeed_libaio is not None else deepspeed_libaio_env()
    if (plot is not None or paper_plot is not None):
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot needs matplotlib: pip install 'zipmoe[bench]' (or leave out --plot)") from None
    cfg = bench_run.BenchConfig(
        container=file, engines=engines, budgets=[parse_size(b) for b in budget],
        batches=bench_run.parse_int_list(batch, "--batch"), new_tokens=bench_run.parse_int_list(new_tokens, "--new-tokens"),
        prompts_file=prompts, workload=workload, sample_seed=seed, temperature=temperature, runs=runs, rounds=rounds, cold=cold, plan=plan, source=source, json_path=json_out, device=device,
        work_dir=work_dir, time_limit_s=time_limit or None, min_tokens=min_tokens, threads=threads or None,
        cgroup=not no_cgroup, cgroup_move_to_leaf=cgroup_move_to_leaf, cold_method=cold_method, cgroup_slack=parse_size(cgroup_slack) if cgroup_slack else None,
        context=context, disk_bw=float(parse_size(disk_bw)) if disk_bw else None, merge=merge, raw_container=raw_container, profile=profile, trace_out=trace_out,
        gguf=gguf, llama_cpp_source=llama_cpp_source or llama_cpp_source_env(), engine_timeout_s=engine_timeout or None, pressure=parse_size(pressure) if pressure else None, moe_infinity_site=moe_infinity_site or moe_infinity_site_env(),
        readers=zipmoe_env.get("readers"), prefetch=zipmoe_env.get("prefetch"), deepspeed_offload=ds_offload,
        deepspeed_build_timeout_s=ds_timeout, deepspeed_load_in_budget=ds_in_budget, cache_dir=cache_dir(),
    )
    if ds_libaio and "deepspeed" in engines:  # inherited by the op's build process and every worker
        use_libaio(ds_libaio)
    from rich.console import Console

    err = Console(stderr=True)
    doc, errors = bench_run.run_bench(cfg, log=lambda m: err.print(f"[dim]{m}[/dim]"), progress_factory=_Progress)
    _print_report(doc, plot if doc.get("summary") else None, compact)
    _paper([doc], paper, paper_json, paper_plot, paper_md)
    if json_out is not None:
        Console().print(f"  results: {json_out}", style="dim")
    exc = bench_run.first_error_exception(errors)
    if exc is not None:
        raise exc
