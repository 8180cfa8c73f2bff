"""The `zipmoe bench` driver: prepare inputs, run every engine in its own process, collect.

Flow (one call of :func:`run_bench`):

1. Check the request: the container opens, the device exists, each baseline's packages are
   installed, the runtime accepts each zipmoe engine's options, budgets parse.
2. Prepare what the engines read (runtime/bench/inputs.py): the source safetensors folder for the Hugging Face engines
   (``--source``, else the container is unpacked once into the work folder), the codec-raw
   container for ``uncompressed`` (packed once from the source), token ids of the prompts
   (tokenised once here, so every engine gets exactly the same ids; left padded).
3. For each engine and budget: a worker process (runtime/bench/worker.py) inside a fresh
   memory cgroup limited to ``budget + slack`` (runtime/bench/cgroup.py), cold or warm. Runs are
   appended to out.json as they finish, so an error or a kill keeps what was measured.
4. Summarise (runtime/bench/report.py): ratios, I/O floor, token check.

Errors of the user's making (a missing baseline package, a budget an engine cannot run in, a
GPU requested without one) do not stop the other engines: they are recorded in out.json and
the first one is raised at the end, as one line, after the table was printed.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from zipmoe.errors import BudgetError, UsageError, ZipmoeError
from zipmoe.machine import cpu_model, resolve_device
from zipmoe.runtime.bench import cgroup, cold, engines, report
from zipmoe.runtime.bench.merge import merge_runs
from zipmoe.runtime.bench.inputs import (corpus_ids, load_tokenizer, make_cases, run_context, prepare_raw_container,
                                         prepare_source, read_prompts, tokenize)
from zipmoe.runtime.plan.workload import check_workload
from zipmoe.runtime.bench.procs import kill_tree
from zipmoe.units import format_size

SCHEMA = "zipmoe-bench/1"

@dataclass
class BenchConfig:
    container: Path | None
    engines: list[str]
    budgets: list[int]
    batches: list[int] = field(default_factory=lambda: [1])
    new_tokens: list[int] = field(default_factory=lambda: [32])
    prompts_file: Path | None = None
    runs: int = 3
    # --rounds: the whole set of engines and budgets this many times, in reverse order every
    # other round (each round a fresh process per engine); runs are tagged with their round and
    # report.paired gives each engine's TPOT against the first's, round by round
    rounds: int = 1
    cold: bool = True
    plan: Path | None = None
    source: Path | None = None
    json_path: Path | None = None
    device: str = "auto"
    work_dir: Path | None = None
    time_limit_s: float | None = 120.0
    min_tokens: int = 2
    threads: int | None = None
    cgroup: bool = True
    cgroup_move_to_leaf: bool = False  # cgroup v2: move this cgroup's processes into a leaf child (cgroup.detect)
    cold_method: str = "auto"  # auto (drop_caches where permitted, else fadvise), drop_caches, fadvise
    cgroup_slack: int | None = None
    context: int | None = None  # the zipmoe engines' KV cache (decode loop), on top of the budget; None: run_context
    disk_bw: float | None = None
    merge: bool = False
    raw_container: Path | None = None
    profile: Path | None = None
    trace_out: Path | None = None
    prompt_tokens: int = 64
    seed: int = 0  # the synthetic prompt ids of a model without tokenizer (greedy / sample workloads)
    workload: str = "corpus"  # corpus (teacher-forced text), sample or greedy: runtime/plan/workload.py
    sample_seed: int = 0  # --seed: the sample workload's torch seed (set before every run)
    temperature: float = 1.0  # --temperature: the sample workload's
    gguf: Path | None = None  # the llama.cpp engine's GGUF (else converted from the source once)
    llama_cpp_source: Path | None = None  # the folder with llama.cpp's convert_hf_to_gguf.py (else the user cache's, fetched once)
    moe_infinity_site: Path | None = None  # the moe-infinity engine's own Python folder (benchmarks/moe_infinity_build.sh)
    engine_timeout_s: float | None = None  # a worker still running after this long is killed (its finished runs kept)
    pressure: int | None = None  # --pressure: host memory left available, the rest occupied while engines run (pressure.py)
    # the zipmoe engines' zipmoe.load overrides (None: the engine's default; zipmoe-noprefetch turns prefetch off anyway)
    readers: int | None = None
    prefetch: bool | None = None
    # the deepspeed engine: "nvme", "cpu" or None (NVMe where its async-I/O op can be built, else cpu),
    # the op build's time limit (None: deepspeed_engine.BUILD_TIMEOUT_S), the budget during loading too
    deepspeed_offload: str | None = None
    deepspeed_build_timeout_s: float | None = None
    deepspeed_load_in_budget: bool = False
    cache_dir: Path | None = None  # zipmoe's cache folder: `zipmoe plan`'s cached profiles (the I/O floor's bandwidth)

    @property
    def allow_drop_caches(self) -> bool:
        """Cold runs may write /proc/sys/vm/drop_caches (``--cold-method`` auto or drop_caches)."""
        return self.cold_method != "fadvise"


# ----------------------------------------------------------------------------- parsing helpers


def parse_int_list(text: str, what: str) -> list[int]:
    try:
        vals = [int(x) for x in str(text).replace(" ", "").split(",") if x]
    except ValueError:
        raise UsageError(f"cannot read {what} {text!r}: give whole numbers separated by commas, e.g. 1,4,16") from None
    if not vals or any(v <= 0 for v in vals):
        raise UsageError(f"{what} must be positive whole numbers, got {text!r}")
    return vals


def machine_info(device: str) -> dict:
    info = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "device": device,
    }
    try:
        import psutil

        info["ram_bytes"] = psutil.virtual_memory().total
    except Exception:
        pass
    info["cpu"] = cpu_model()
    try:
        import torch
        import transformers

        info["torch"] = torch.__version__
        info["transformers"] = transformers.__version__
        # the GPU's name comes from the workers: a CUDA context here would take GPU memory
    except Exception:
        pass
    try:
        import accelerate

        info["accelerate"] = accelerate.__version__
    except Exception:
        pass
    return info


# ----------------------------------------------------------------------------- preparation


def _container_info(path: Path) -> tuple[dict, dict, str]:
    from zipmoe.codecs.reader import ContainerReader

    with ContainerReader(path) as r:
        return dict(r.config or {}), dict(r.meta or {}), r.container_id


def default_slack(device: str) -> int:
    """The margin on top of the budget and of the process's own baseline: activations, KV cache,
    transformers' transient buffers. The baseline (interpreter, torch, transformers, the CUDA
    context: about 0.5 GiB on the CPU) is measured by each worker once it has imported them; the
    cgroup starts at budget + baseline allowance + margin and is then tightened to
    budget + measured baseline + margin."""
    return (1 << 30) if device == "cuda" else (1 << 28)


START_ALLOWANCE = 4 << 30  # room for the imports before the worker measures its baseline


# ----------------------------------------------------------------------------- workers


def no_report_error(spec: dict, rc: int) -> str:
    """The error of a worker that died without its result line: the status, the signal's name
    when a signal ended it, and for MoE-Infinity the command that shows where it crashed."""
    import signal

    line = f"worker exited with status {rc}"
    if rc < 0:
        try:
            line += f" ({signal.Signals(-rc).name})"
        except ValueError:
            pass
    line += " and no report"
    if rc < 0 and spec.get("engine") == "moe-infinity":
        from zipmoe.runtime.bench.moe_infinity_engine import crash_hint

        line += f"; {crash_hint(spec)}"
    return line


def run_worker(spec: dict, cgroup_support, limit: int | None, log_path: Path, on_progress, timeout_s: float | None = None) -> dict:
    """Run one engine's worker process (inside a memory cgroup when possible); its JSON doc. A
    worker still running after ``timeout_s`` is killed with every process it started
    (:func:`procs.kill_tree`) and reported as timed out, with the runs it finished."""
    env = dict(os.environ)
    if spec.get("engine") == "moe-infinity":  # its own Python folder first: its pinned transformers, never zipmoe's process
        from zipmoe.runtime.bench.moe_infinity_engine import worker_env

        env = worker_env(spec.get("moe_infinity_site"), env)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    cg = None
    if cgroup_support is not None and limit is not None:
        cg = cgroup.MemoryCgroup(cgroup_support, limit)
        env.update(cg.env())
    result_path = Path(spec["result_path"])
    if result_path.exists():
        result_path.unlink()
    t0 = time.perf_counter()
    try:
        with open(log_path, "a") as log:
            proc = subprocess.Popen([sys.executable, "-m", "zipmoe.runtime.bench.worker"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
            expired = threading.Event()

            def kill_on_timeout():
                expired.set()
                kill_tree(proc.pid)  # its children too (a compiler DeepSpeed started, say)

            timer = threading.Timer(timeout_s, kill_on_timeout) if timeout_s else None
            if timer:
                timer.daemon = True
                timer.start()

            def pump():
                try:
                    for line in proc.stderr:
                        if line.startswith("@@progress"):
                            on_progress()
                        else:
                            log.write(line)
                except ValueError:  # the log closed under a straggler's last line
                    pass

            t = threading.Thread(target=pump, daemon=True)
            t.start()
            proc.stdin.write(json.dumps(spec))
            proc.stdin.close()
            out = proc.stdout.read()
            rc = proc.wait()
            if timer:
                timer.cancel()
            t.join(timeout=5)
        doc = None
        for line in reversed(out.strip().splitlines()):
            try:
                doc = json.loads(line)
                break
            except json.JSONDecodeError:
                continue
        if doc is None:  # killed: rebuild what it finished from the per-run file
            runs = []
            if result_path.exists():
                runs = [json.loads(x) for x in result_path.read_text().splitlines() if x.strip()]
            doc = {"engine": spec["engine"], "budget": spec.get("budget"), "ok": False, "runs": runs,
                   "error": no_report_error(spec, rc), "error_type": "Killed" if rc < 0 else "Crashed"}
        if expired.is_set():
            doc.update(ok=False, error_type="Timeout", user_error=True,
                       error=f"engine {spec['engine']} did not finish in {timeout_s:g} s (--engine-timeout); its finished runs are kept")
        doc["returncode"] = rc
        doc["wall_s"] = time.perf_counter() - t0
        doc["log"] = str(log_path)
        if cg is not None:
            doc["cgroup_stats"] = cg.stats()
            if doc["cgroup_stats"].get("oom_kills") or (rc in (-9, 137) and not doc.get("ok") and not expired.is_set()):
                doc["error_type"] = "OOMKilled"
                lim = doc["cgroup_stats"].get("limit_bytes") or limit
                doc["error"] = _oom_line(spec, doc, lim)
                doc["user_error"] = True
        return doc
    finally:
        if cg is not None:
            cg.close()


def _oom_line(spec: dict, doc: dict, lim) -> str:
    """The one line for an engine its cgroup killed, with the limit's parts. A killed worker
    sends no report, so its measured baseline is what the limit holds beyond the other parts."""
    from zipmoe.runtime.bench.worker import kv_allowance

    budget = int(spec.get("budget") or 0)
    margin = int(spec.get("cgroup_margin") or 0)
    kv = kv_allowance(spec)
    base = doc.get("process_base_rss_bytes")
    if base is None and lim:
        base = max(0, int(lim) - budget - margin - kv)
    kv_part = f" + KV cache {format_size(kv)} (--context {spec.get('context')})" if kv else ""
    return (f"engine {spec['engine']} cannot run in budget {format_size(budget)}: killed by the memory cgroup "
            f"at {format_size(lim)} (budget + the process's own {format_size(base or 0)}{kv_part} "
            f"+ margin {format_size(margin)}; raise --cgroup-slack if the margin is too small)")


# ----------------------------------------------------------------------------- the run


def _write_json(path: Path | None, doc: dict) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path)


def _runs_of(results: list[dict]) -> list[dict]:
    return [r for doc in results for r in doc.get("runs", [])]


def finalize(doc: dict) -> dict:
    """(Re)compute summary, ratios and token check from the recorded runs."""
    runs = _runs_of(doc.get("results", []))
    for res in doc.get("results", []):
        if res.get("gpu") and isinstance(doc.get("machine"), dict):
            doc["machine"].setdefault("gpu", res["gpu"])
            doc["machine"].setdefault("gpu_memory_bytes", res.get("gpu_memory_bytes"))
    bw = (doc.get("disk_bw") or {}).get("bytes_per_s")
    rows = report.summarize(runs, bw)
    doc["summary"] = rows
    doc["ratios"] = report.ratios(rows)
    doc["token_check"] = report.token_check(runs)
    order = [e for c in doc.get("configs") or [] for e in c.get("engines") or []]
    doc["paired"] = report.paired(runs, list(dict.fromkeys(order)))
    return doc


def load_results(path: Path) -> dict:
    try:
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file") from None
    except json.JSONDecodeError:
        raise UsageError(f"{path}: not a zipmoe bench JSON file") from None
    if doc.get("schema") != SCHEMA:
        raise UsageError(f"{path}: not a zipmoe bench JSON file (schema {doc.get('schema')!r})")
    return doc


def _trace_path(trace_out, budget, n_budgets: int) -> str | None:
    """The zipmoe engine's activation trace file (one per budget when there are several)."""
    if trace_out is None:
        return None
    p = Path(trace_out)
    if n_budgets > 1:
        p = p.with_name(f"{p.stem}-{budget}{p.suffix or '.jsonl'}")
    return str(p)


def plan_work(cfg: BenchConfig) -> list[tuple[str, int | None]]:
    """(engine, budget) pairs in run order; resident once, without a budget."""
    work = []
    for eng in cfg.engines:
        if engines.engine(eng).budgeted:
            work += [(eng, b) for b in cfg.budgets]
        else:
            work.append((eng, None))
    return work


def round_schedule(pairs: list, rounds: int) -> list[tuple]:
    """``(round, engine, budget)`` in run order: every round the same pairs, in reverse order
    every other round (ABBA), so that a drift of the disk or the machine over the call weighs on
    every engine alike."""
    return [(rnd, eng, budget) for rnd in range(rounds) for eng, budget in (pairs if rnd % 2 == 0 else pairs[::-1])]


def run_bench(cfg: BenchConfig, log=print, progress_factory=None) -> tuple[dict, list[str]]:
    """Run everything; returns (the out.json document, errors as one-line strings)."""
    errors: list[str] = []
    mi_site = str(cfg.moe_infinity_site) if cfg.moe_infinity_site else None  # the moe-infinity engine's folder
    check_workload(cfg.workload)
    device = resolve_device(cfg.device)
    for eng in cfg.engines:
        engines.engine(eng)
    if cfg.container is None or not Path(cfg.container).is_file():
        raise UsageError(f"{cfg.container}: no such .zmoe file")
    if cfg.plan is not None and not Path(cfg.plan).is_file():
        raise UsageError(f"--plan {cfg.plan}: no such file")
    if not cfg.budgets and any(engines.engine(e).budgeted for e in cfg.engines):
        raise UsageError("give at least one --budget SIZE (e.g. --budget 8G)")
    config, meta, cid = _container_info(cfg.container)
    work = Path(cfg.work_dir) if cfg.work_dir else Path(cfg.container).with_name(Path(cfg.container).stem + ".bench")
    work.mkdir(parents=True, exist_ok=True)

    prev = None
    if cfg.merge and cfg.json_path is not None and Path(cfg.json_path).exists():
        prev = load_results(cfg.json_path)
    doc = prev or {"schema": SCHEMA, "results": [], "errors": []}
    doc.update({
        "schema": SCHEMA,
        "command": sys.argv,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "container": str(cfg.container), "container_id": cid, "model": meta.get("model"),
        "device": device, "machine": machine_info(device),
    })
    doc.setdefault("configs", []).append({
        "engines": cfg.engines, "budgets": cfg.budgets, "batches": cfg.batches, "new_tokens": cfg.new_tokens, "runs": cfg.runs,
        **({"rounds": cfg.rounds} if cfg.rounds > 1 else {}),
        "cold": cfg.cold, "plan": str(cfg.plan) if cfg.plan else None, "time_limit_s": cfg.time_limit_s, "threads": cfg.threads,
        "workload": cfg.workload, **({"seed": cfg.sample_seed, "temperature": cfg.temperature} if cfg.workload == "sample" else {}),
        **{k: v for k, v in (("readers", cfg.readers), ("prefetch", cfg.prefetch), ("deepspeed_offload", cfg.deepspeed_offload),
                             ("deepspeed_load_in_budget", cfg.deepspeed_load_in_budget or None),
                             ("moe_infinity_site", mi_site)) if v is not None},
    })

    # engines that cannot run at all: say why, keep going with the others
    runnable = []
    for eng in cfg.engines:
        why = (engines.missing_extra(eng, mi_site)
               or engines.check_runtime_options(eng))
        if why:
            errors.append(why)
            doc["errors"].append({"engine": eng, "error": why})
        else:
            runnable.append(eng)
    if "zipmoe" in runnable and cfg.plan is None:
        log("note: no --plan given: the 'zipmoe' engine runs with the runtime's default pool split")

    # cgroup
    support = (cgroup.detect(move_to_leaf=cfg.cgroup_move_to_leaf) if cfg.cgroup
               else cgroup.CgroupSupport(False, reason="disabled with --no-cgroup"))
    for note in support.notes:
        if note.startswith(cgroup.MOVED_NOTE):  # processes were moved (--cgroup-move-to-leaf): say so on the console too
            log(f"note: {note}")
    doc["cgroup"] = support.to_dict()
    if not support.usable:
        log(f"note: no memory cgroup ({support.reason}); budgets are enforced by the engines' own limits only")
    slack = cfg.cgroup_slack if cfg.cgroup_slack is not None else default_slack(device)
    doc["cgroup"]["slack_bytes"] = slack

    # what the engines read
    needs_source = any(engines.engine(e).needs in ("source", "gguf") for e in runnable) or (
        "uncompressed" in runnable and cfg.raw_container is None)
    source = raw = None
    def _drop(which: str, exc: ZipmoeError) -> list[str]:
        msg = str(exc).splitlines()[0]
        errors.append(msg)
        doc["errors"].append({"engine": "prepare", "error": msg})
        return [e for e in runnable if engines.engine(e).needs not in which]

    if needs_source:
        try:
            source = prepare_source(cfg, work, log)
        except ZipmoeError as exc:
            runnable = _drop(("source", "raw_container", "gguf"), exc)
    gguf_file = None
    if any(engines.engine(e).needs == "gguf" for e in runnable):
        from zipmoe.runtime.bench import llamacpp_convert

        try:
            gguf_file = llamacpp_convert.prepare(source, work, cfg.gguf, log, llama_cpp_source=cfg.llama_cpp_source,
                                                 cache_dir=cfg.cache_dir)
        except ZipmoeError as exc:
            runnable = _drop(("gguf",), exc)
    if "deepspeed" in runnable:  # its NVMe ops are compiled outside the engines' cgroups
        from zipmoe.runtime.bench import deepspeed_engine

        try:
            deepspeed_engine.prepare(device, log, cfg.deepspeed_build_timeout_s, cfg.deepspeed_offload)
        except ZipmoeError as exc:
            msg = str(exc).splitlines()[0]
            errors.append(msg)
            doc["errors"].append({"engine": "deepspeed", "error": msg})
            runnable = [e for e in runnable if e != "deepspeed"]
    if "uncompressed" in runnable:
        try:
            raw = prepare_raw_container(cfg, work, source, log)
        except ZipmoeError as exc:
            runnable = _drop(("raw_container",), exc)

    # disk bandwidth for the floor
    bw = None
    if cfg.disk_bw:
        bw = {"bytes_per_s": float(cfg.disk_bw), "source": "--disk-bw"}
    else:
        bw = cold.profile_bandwidth(cfg.container, cid, device, cfg.profile, cfg.plan, cache_dir=cfg.cache_dir)
        if bw is None:
            cold.make_cold([cfg.container], cfg.allow_drop_caches)
            m = cold.disk_bandwidth(cfg.container)
            bw = {"bytes_per_s": m["bytes_per_s"], "source": "measured by bench: sequential " + ("O_DIRECT" if m["o_direct"] else "buffered (cache dropped)") + f" read of {format_size(m['bytes'])} of the container"}
    doc["disk_bw"] = bw

    tok_folder = source
    tmp_tok = None
    if tok_folder is None:  # tokenizer files from the container
        tmp_tok = work / "tokenizer"
        tmp_tok.mkdir(exist_ok=True)
        try:
            from zipmoe.codecs.reader import ContainerReader

            with ContainerReader(cfg.container) as r:
                for name in r.files:
                    if "/" not in name:
                        (tmp_tok / name).write_bytes(r.read_file(name))
        except Exception:
            pass
        tok_folder = tmp_tok
    tokenizer = load_tokenizer(tok_folder)
    forced = None
    if cfg.workload == "corpus":  # teacher forcing: the corpus passages, or the --prompts lines as texts
        texts = read_prompts(cfg.prompts_file) if cfg.prompts_file else None
        ids, forced, pad, origin = corpus_ids(tokenizer, config, cfg.batches, cfg.new_tokens, texts)
        count, where = (len(texts), str(cfg.prompts_file)) if texts else (len(ids), "built-in corpus (runtime/data/corpus.txt)")
    else:
        prompts = read_prompts(cfg.prompts_file)
        ids, pad, origin = tokenize(prompts, tokenizer, config, cfg.prompt_tokens, cfg.seed)
        count, where = len(prompts), str(cfg.prompts_file) if cfg.prompts_file else "built-in"
    cases = make_cases(ids, pad, cfg.batches, cfg.new_tokens, workload=cfg.workload, forced=forced,
                       temperature=cfg.temperature, seed=cfg.sample_seed)
    doc["prompts"] = {"count": count, "source": where, "ids": origin, "prompt_tokens": [len(x) for x in ids],
                      "workload": cfg.workload}

    cold_paths = [p for p in (cfg.container, raw, source, work / "offload", gguf_file) if p is not None]
    doc["cold_mode"] = cold.cold_mode_available(cold_paths, cfg.allow_drop_caches) if cfg.cold else "warm"
    if cfg.cold and doc["cold_mode"] == "o_direct":
        log("note: cannot drop the page cache here: only engines that read with O_DIRECT (zipmoe) are cold")

    pairs = [(e, b) for e, b in plan_work(cfg) if e in runnable]
    rounds = max(1, int(cfg.rounds))
    total = len(pairs) * len(cases) * cfg.runs * rounds
    prog = progress_factory(total) if progress_factory else None
    ballast = None
    if cfg.pressure and pairs:  # the paper's memory-pressure case: the page cache kept small (pressure.py)
        from zipmoe.runtime.bench.pressure import Ballast

        ballast = Ballast(cfg.pressure, log).__enter__()
        doc["pressure"] = ballast.record
    _write_json(cfg.json_path, finalize(doc))
    # the runs file of an engine and budget is named by its cases too: a later bench of the same
    # engine and budget with another batch or length (a batch-4 stage after batch 1) keeps the first's
    case_tag = "_".join(c["id"] for c in cases) or "none"
    this_call: dict = {}  # (engine, budget) -> its result so far in this call (the rounds add runs to it)
    schedule = round_schedule(pairs, rounds)
    try:
        for rnd, eng, budget in schedule:
            label = f"{eng}" + (f" @ {format_size(budget)}" if budget else "") + (f" · round {rnd + 1}/{rounds}" if rounds > 1 else "")
            if prog:
                prog.describe(label)
            spec = {
                "engine": eng, "device": device, "budget": budget, "container": str(cfg.container),
                "model_type": config.get("model_type"),  # the worker imports its modeling code before measuring its baseline
                "raw_container": str(raw) if raw else None, "source": str(source) if source else None, "gguf": str(gguf_file) if gguf_file else None,
                "plan": str(cfg.plan) if cfg.plan else None, "offload_folder": str(work / "offload" / f"{eng}-{budget}"),
                "threads": cfg.threads, "runs": cfg.runs, "cold": cfg.cold, "cold_paths": [str(p) for p in cold_paths],
                "warmup": True, "allow_drop_caches": cfg.allow_drop_caches, "time_limit_s": cfg.time_limit_s, "min_tokens": cfg.min_tokens, "cases": cases,
                "result_path": str(work / f"runs-{eng}-{budget}-{case_tag}{f'-r{rnd + 1}' if rounds > 1 else ''}.jsonl"),
                "trace": _trace_path(cfg.trace_out, budget, len(cfg.budgets)) if eng == "zipmoe" and rnd == 0 else None,
                "context": cfg.context or run_context(cases),
                "readers": cfg.readers, "prefetch": cfg.prefetch,
                # zipmoe-default fits its plan at load from this profile (or the cache's) like chat does
                "profile": str(cfg.profile) if cfg.profile else None,
                "cache_dir": str(cfg.cache_dir) if cfg.cache_dir else None,
                "deepspeed_offload": cfg.deepspeed_offload, "deepspeed_load_in_budget": cfg.deepspeed_load_in_budget,
                "moe_infinity_site": mi_site,
            }
            from zipmoe.runtime.bench.worker import kv_allowance  # the KV cache comes on top of the budget

            limit = budget + START_ALLOWANCE + slack + kv_allowance(spec) if (support.usable and budget is not None) else None
            spec["cgroup_margin"] = slack
            res = run_worker(spec, support if support.usable else None, limit, work / f"worker-{eng}-{budget}-{case_tag}{f'-r{rnd + 1}' if rounds > 1 else ''}.log",
                             (lambda: prog.advance()) if prog else (lambda: None), timeout_s=cfg.engine_timeout_s)
            res["cgroup_limit_bytes"] = limit
            measured = len(res.get("runs") or [])  # in this round
            if rounds > 1:
                for r in res.get("runs") or []:
                    r["round"] = rnd
                before = this_call.get((eng, budget))
                if before is not None:  # a later round: its runs add to the earlier rounds'
                    res["runs"] = list(before.get("runs") or []) + list(res.get("runs") or [])
                    if before.get("case_errors") and not res.get("case_errors"):
                        res["case_errors"] = before["case_errors"]
            this_call[(eng, budget)] = res
            # an earlier result for the same engine/budget (a re-run with --merge): its runs of the
            # cases this run measured are replaced, the others kept (e.g. batch 1, then batch 4)
            if not res.get("ok") and res.get("error"):
                # the cases it did not finish, with the line, so that a later --merge run that
                # measures other cases keeps saying why these have no figure
                done = {(r.get("batch"), r.get("new_tokens")) for r in res.get("runs") or []}
                res["case_errors"] = {c["id"]: res["error"] for c in cases if (c["batch"], c["new_tokens"]) not in done}
            earlier = [d for d in doc["results"] if d.get("engine") == eng and d.get("budget") == budget]
            doc["results"] = [d for d in doc["results"] if not (d.get("engine") == eng and d.get("budget") == budget)]
            for d in earlier:  # (an earlier round's result of this call adds nothing here: its runs are in res)
                merge_runs(res, d)
            doc["results"].append(res)
            if not res.get("ok"):
                msg = res.get("error") or "failed"
                if not msg.startswith("engine "):
                    msg = f"engine {label}: {msg}"
                if res.get("error_type") in ("MemoryError",) and budget is not None:
                    msg = f"engine {eng} cannot run in budget {format_size(budget)}: {res.get('error')}"
                if not res.get("user_error"):
                    msg += f" (log: {res.get('log')})"
                errors.append(msg)
                doc["errors"].append({"engine": eng, "budget": budget, "error": msg})
                if prog:  # skip the missing steps
                    prog.advance(len(cases) * cfg.runs - measured)
            _write_json(cfg.json_path, finalize(doc))
    finally:
        if prog:
            prog.close()
        if ballast is not None:
            ballast.__exit__(None, None, None)
            doc["pressure"] = ballast.record
        doc["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        _write_json(cfg.json_path, finalize(doc))
        if tmp_tok is not None:
            import shutil

            shutil.rmtree(tmp_tok, ignore_errors=True)
    return doc, errors


def first_error_exception(errors: list[str]) -> ZipmoeError | None:
    if not errors:
        return None
    msg = errors[0] + (f" (and {len(errors) - 1} more, see the JSON)" if len(errors) > 1 else "")
    if "cannot run in budget" in errors[0]:
        return BudgetError(msg)
    return ZipmoeError(msg)
