"""Numbers and presentation for `zipmoe bench`: summaries, ratios, the I/O floor, table, plot.

Input: the records the workers wrote (one per run, see runtime/bench/worker.py), grouped by
(engine, budget, batch, new tokens). Output:

- :func:`summarize`: median / min / max over runs of TTFT, TPOT, throughput, end-to-end
  latency, bytes read per output token, peak RSS; and the **I/O floor**: the bytes that had to
  be read per output token during decoding divided by the measured disk bandwidth (the
  fastest a run that misses its cache could go). ``tpot_over_floor`` = TPOT / floor.
- :func:`ratios`: for each zipmoe engine against each baseline at the same budget, batch and
  token count: ``tpot_x`` = baseline TPOT / engine TPOT ("x times shorter"), ``throughput_x``
  = engine throughput / baseline throughput, ``ttft_x``. The resident baseline has no budget
  and is compared at every budget.
- :func:`token_check`: every engine's greedy tokens against the reference (resident when run,
  else the first engine), over the common prefix (a baseline stopped by the time limit makes
  fewer tokens). Under teacher forcing (the ``corpus`` workload) every engine's tokens are the
  forced stream, so the check compares the model's own argmax at every forced step
  (``argmax_tokens``) instead.
- the workload diagnostics (runtime/bench/diagnostics.py): per row ``distinct_tokens``,
  ``cycle`` (:func:`cycle_warnings` names every run whose tokens loop), and for zipmoe engines
  ``distinct_experts``, the hit rate of the first and last quarter of the decode steps and the
  hit rate Belady's MIN reaches with the same capacity.
- :func:`render_table` (rich) and :func:`plot` (matplotlib, optional: a clear message when it
  is not installed).
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from zipmoe.errors import UsageError
from zipmoe.runtime.engine.states import STATES

ZIPMOE_ENGINES = ("zipmoe", "zipmoe-default", "zipmoe-noprefetch", "zipmoe-pools", "zipmoe-basic")
BASELINE_ORDER = ("accelerate", "uncompressed", "resident", "deepspeed", "llama.cpp", "moe-infinity")
ENGINE_ORDER = ("zipmoe", "zipmoe-default", "zipmoe-noprefetch", "zipmoe-pools", "zipmoe-basic", "uncompressed", "accelerate", "deepspeed", "llama.cpp", "moe-infinity", "resident")
# engines computing with other kernels: their tokens agreeing is a figure (tables.token_agreement), not part of the check
AGREEMENT_ONLY = ("llama.cpp",)

# per-run workload diagnostics (runtime/bench/diagnostics.py; the hit rates and MIN for zipmoe engines)
DIAG_METRICS = ("distinct_tokens", "distinct_experts", "hit_rate_first_quarter", "hit_rate_last_quarter", "belady_hit_rate",
                "lru_hit_rate", "predicted_tpot_s", "model_tpot_s")
METRICS = ("ttft_s", "tpot_s", "e2e_s", "tokens_per_s", "decode_tokens_per_s", "bytes_per_token", "peak_rss_run_bytes", "floor_tpot_s", "tpot_over_floor")


def stats(values) -> dict | None:
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def bytes_per_token(run: dict) -> float | None:
    """Bytes read per output token while decoding: the runtime's counters when it has them
    (exactly what it fetched), else what the kernel charged the process (/proc/self/io)."""
    n = (run.get("generated") or 0) - 1
    if n <= 0:
        return None
    b = run.get("decode_bytes_read_engine")
    if b is None:
        b = run.get("decode_bytes_read_io")
    if b is None:
        return None
    return b / n


def io_floor_tpot(bytes_per_tok: float | None, disk_bw: float | None) -> float | None:
    """The I/O floor of time per output token: bytes that had to be read / disk bandwidth."""
    if bytes_per_tok is None or not disk_bw or disk_bw <= 0:
        return None
    return bytes_per_tok / disk_bw


def workload_of(run: dict) -> str:
    """The workload a run measured (``corpus``, ``sample``, ``greedy``; runs recorded before
    workloads existed were greedy), without the note a run may carry after it."""
    return str(run.get("workload") or "greedy").split(" (", 1)[0]


def _key(run: dict) -> tuple:
    return (run["engine"], run.get("budget"), int(run["batch"]), int(run["new_tokens"]), workload_of(run))


def enrich(run: dict, disk_bw: float | None) -> dict:
    r = dict(run)
    r["bytes_per_token"] = bytes_per_token(run)
    r["floor_tpot_s"] = io_floor_tpot(r["bytes_per_token"], disk_bw)
    if r["floor_tpot_s"] and r.get("tpot_s"):
        r["tpot_over_floor"] = r["tpot_s"] / r["floor_tpot_s"]
    else:
        r["tpot_over_floor"] = None
    return r


def _hits(runs: list[dict]) -> dict | None:
    """Hits per pool summed over runs, when the runtime's counters carry a ``hits`` mapping."""
    total: dict = defaultdict(float)
    found = False
    for r in runs:
        c = r.get("counters")
        h = c.get("hits") if isinstance(c, dict) else None
        if isinstance(h, dict):
            for k, v in h.items():
                if isinstance(v, (int, float)):
                    total[k] += v
                    found = True
    return dict(total) if found else None


def _host_work(runs: list[dict]) -> dict | None:
    """The serving thread's work per fetched tensor over the runs together (counters'
    :func:`~zipmoe.runtime.engine.counters.host_work`), None where no run has zipmoe's counters."""
    from zipmoe.runtime.engine.counters import host_work

    return host_work([r["counters"] for r in runs if isinstance(r.get("counters"), dict)
                      and isinstance(r["counters"].get("hits"), dict)])


def summarize(runs: list[dict], disk_bw: float | None) -> list[dict]:
    """One row per (engine, budget, batch, new tokens) with median/min/max of every metric."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for run in runs:
        groups[_key(run)].append(enrich(run, disk_bw))
    rows = []
    for key, rs in groups.items():
        engine, budget, batch, new_tokens, workload = key
        row = {"engine": engine, "budget": budget, "batch": batch, "new_tokens": new_tokens, "workload": workload, "runs": len(rs),
               "generated": min(r.get("generated") or 0 for r in rs),
               "stopped_by_time_limit": any(r.get("stopped_by_time_limit") and (r.get("generated") or 0) < r["new_tokens"] for r in rs),
               "cold_mode": sorted({str(r.get("cold_mode")) for r in rs})}
        for m in METRICS:
            row[m] = stats(r.get(m) for r in rs)
        row["hits"] = _hits(rs)
        row["host_work"] = _host_work(rs)
        notes = sorted({str(r["workload"]) for r in rs if r.get("workload") and str(r["workload"]) != workload})
        if notes:
            row["workload_notes"] = notes
        for m in DIAG_METRICS:
            row[m] = stats(r.get(m) for r in rs)
        cyc = [r.get("cycle") for r in rs if r.get("cycle") is not None]
        row["cycle"] = min(cyc) if cyc else None
        row["capacity_upper_bound"] = any(r.get("capacity_upper_bound") for r in rs)
        for m in ("predicted_hits", "model_hits"):  # per state, experts per decode layer call: the runs' mean
            hs = [r[m] for r in rs if isinstance(r.get(m), dict)]
            row[m] = {k: statistics.mean(h.get(k, 0.0) for h in hs) for k in STATES} if hs else None
        by = sorted({str(r["predicted_by"]) for r in rs if r.get("predicted_by")})
        row["predicted_by"] = by[0] if len(by) == 1 else (", ".join(by) or None)
        # the budget's own count (allocator rounding included) beside the GPU allocator's peak
        held = [r["memory"]["peak_counted_bytes"] for r in rs if isinstance(r.get("memory"), dict)]
        gpu = [r["cuda_peak_bytes"] for r in rs if r.get("cuda_peak_bytes")]
        row["peak_counted_bytes"] = max(held) if held else None
        row["cuda_peak_bytes"] = max(gpu) if gpu else None
        used = [r["gpu_used_bytes"] for r in rs if r.get("gpu_used_bytes")]  # the device's, every allocator's
        row["gpu_used_bytes"] = max(used) if used else None
        rows.append(row)
    rows.sort(key=lambda r: (r["workload"], r["batch"], r["new_tokens"], r["budget"] or 0, _order(r["engine"])))
    return rows


def _order(engine: str) -> int:
    return ENGINE_ORDER.index(engine) if engine in ENGINE_ORDER else len(ENGINE_ORDER)


def _med(row: dict | None, metric: str) -> float | None:
    if row is None or row.get(metric) is None:
        return None
    return row[metric]["median"]


def ratios(rows: list[dict]) -> list[dict]:
    """zipmoe engines against each baseline at the same (budget, batch, new tokens)."""
    index = {(r["engine"], r["budget"], r["batch"], r["new_tokens"], r.get("workload")): r for r in rows}
    resident = {(r["batch"], r["new_tokens"], r.get("workload")): r for r in rows if r["engine"] == "resident"}
    out = []
    for r in rows:
        if r["engine"] not in ZIPMOE_ENGINES:
            continue
        for base in BASELINE_ORDER:
            wk = r.get("workload")
            b = resident.get((r["batch"], r["new_tokens"], wk)) if base == "resident" else index.get((base, r["budget"], r["batch"], r["new_tokens"], wk))
            if b is None:
                continue
            out.append({
                "engine": r["engine"], "baseline": base, "budget": r["budget"], "batch": r["batch"], "new_tokens": r["new_tokens"],
                "workload": wk,
                "tpot_x": _ratio(_med(b, "tpot_s"), _med(r, "tpot_s")),
                "ttft_x": _ratio(_med(b, "ttft_s"), _med(r, "ttft_s")),
                "throughput_x": _ratio(_med(r, "tokens_per_s"), _med(b, "tokens_per_s")),
            })
    return out


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den == 0:
        return None
    return num / den


def token_check(runs: list[dict]) -> dict:
    """Do all engines produce the same greedy tokens? Compared per (batch, new tokens) case and
    row, over the common prefix, against the reference engine (resident, else the first)."""
    by_case: dict[tuple, dict[tuple, list]] = defaultdict(dict)
    forced = False
    for r in runs:
        if r.get("tokens") is None or r.get("engine") in AGREEMENT_ONLY:
            continue
        toks = r["tokens"]
        if r.get("argmax_tokens") is not None:  # teacher forcing: the tokens are the stream; the argmax is the model's
            toks, forced = r["argmax_tokens"], True
        by_case[(r["batch"], r["new_tokens"], r.get("case"), workload_of(r))].setdefault((r["engine"], r.get("budget")), toks)
    mismatches = []
    compared = 0
    for case, per_engine in by_case.items():
        if len(per_engine) < 2:
            continue
        engines = sorted(per_engine, key=lambda e: (e[0] != "resident", _order(e[0]), e[1] or 0))
        ref_key = engines[0]
        ref = per_engine[ref_key]
        for other in engines[1:]:
            toks = per_engine[other]
            compared += 1
            for row, (a, b) in enumerate(zip(ref, toks)):
                n = min(len(a), len(b))
                if a[:n] != b[:n]:
                    first = next(i for i in range(n) if a[i] != b[i])
                    mismatches.append({"batch": case[0], "new_tokens": case[1], "row": row, "reference": f"{ref_key[0]}@{ref_key[1]}",
                                       "engine": f"{other[0]}@{other[1]}", "first_difference_at": first})
                    break
    if compared == 0:
        message = "tokens not compared (fewer than two engines ran a case)"
    elif mismatches:
        m = mismatches[0]
        message = f"tokens DIFFER: {len(mismatches)} engine/case pairs, e.g. {m['engine']} vs {m['reference']} at batch {m['batch']} row {m['row']} token {m['first_difference_at']}"
    elif forced:
        message = (f"all engines gave the same greedy tokens: the argmax at every teacher-forced step "
                   f"({compared} engine/case comparisons, common prefix)")
    else:
        message = f"all engines gave the same greedy tokens ({compared} engine/case comparisons, common prefix)"
    return {"same": compared > 0 and not mismatches, "compared": compared, "mismatches": mismatches, "message": message,
            "compared_on": "argmax under teacher forcing" if forced else "tokens"}


def cycle_warnings(runs: list[dict]) -> list[str]:
    """One line per (engine, budget, case) whose generated tokens loop (``cycle`` is a period):
    its cache figures measure a loop, not serving."""
    seen: dict[tuple, dict] = {}
    for r in runs:
        if r.get("cycle") is not None:
            seen.setdefault((r.get("engine"), r.get("budget"), r.get("batch"), r.get("new_tokens")), r)
    out = []
    for (eng, budget, batch, n), r in seen.items():
        out.append(f"WARNING: {eng} @ {_fmt_budget(budget)} batch {batch} x {n} tokens ({r.get('workload') or 'greedy'}): "
                   f"the tokens cycle with period {r['cycle']} in {r.get('cycle_rows') or 1} row(s): its cache hits measure a loop "
                   "(use --workload corpus)")
    return out


# ----------------------------------------------------------------------------- presentation


def _fmt_s(v: float | None) -> str:
    if v is None:
        return "–"
    if v >= 1:
        return f"{v:.2f} s"
    return f"{v * 1000:.1f} ms"


def _fmt_hits(h: dict | None) -> str:
    """Hits per pool as percentages of expert-tensor accesses: full·compressed·sm_only·e_only·none."""
    if not h:
        return ""
    total = sum(h.values())
    if not total:
        return ""
    return "·".join(f"{100 * h.get(k, 0) / total:.0f}" for k in STATES)


def _fmt_int(v) -> str:
    return "–" if v is None else f"{v:.0f}"


def _fmt_pct(v) -> str:
    return "–" if v is None else f"{100 * v:.0f}%"


def _fmt_quarters(a, b) -> str:
    if a is None and b is None:
        return "–"
    return f"{_fmt_pct(a)}→{_fmt_pct(b)}"


def _fmt_x(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}x"


def _fmt_budget(b) -> str:
    if b is None:
        return "none"
    from zipmoe.units import format_size

    return format_size(b).replace(".00 ", " ").replace("iB", "")


COMPACT = ("engine", "budget", "batch", "tokens", "TPOT", "×floor")


# engines that allocate GPU memory outside torch's allocator: their GPU figure is the device's memory in use
GPU_OUTSIDE_TORCH = ("moe-infinity",)


def _fmt_held(r: dict) -> str:
    """Peak bytes the budget counted (allocator rounding included) · the GPU allocator's peak. An
    engine without the budget's count shows its peak RSS instead (``rss``); one that allocates
    outside torch (MoE-Infinity) the device's memory in use (``dev``)."""
    h, g = r.get("peak_counted_bytes"), r.get("cuda_peak_bytes")
    left = _fmt_budget(h) if h is not None else None
    rss = _med(r, "peak_rss_run_bytes")
    if left is None and r.get("engine") in GPU_OUTSIDE_TORCH and rss:
        left = f"rss {_fmt_budget(rss)}"
    right = _fmt_budget(g) if g is not None else None
    if r.get("engine") in GPU_OUTSIDE_TORCH and r.get("gpu_used_bytes"):
        right = f"dev {_fmt_budget(r['gpu_used_bytes'])}"
    if left is None and right is None:
        return "–"
    return f"{left or '–'} · {right or '–'}"


def render_table(rows: list[dict], rats: list[dict], console=None, title: str = "zipmoe bench", compact: bool = False):
    """The rich table: one line per engine/budget/batch/tokens, ratios against the baselines.
    ``compact``: engine, budget, batch, tokens, TPOT, ×floor and the ratios only."""
    from rich.table import Table

    rindex = {(x["engine"], x["baseline"], x["budget"], x["batch"], x["new_tokens"], x.get("workload")): x for x in rats}
    bases = [b for b in BASELINE_ORDER if any(x["baseline"] == b for x in rats)]
    t = Table(title=title, show_lines=False, pad_edge=False)
    cols = ("engine", "budget", "batch", "tokens", "TTFT", "TPOT", "TPOT min–max", "tok/s", "MiB/tok", "floor", "×floor", "peak RSS",
            "held · GPU peak", "hits % F·C·S·E·miss", "distinct tok", "experts", "hit ¼ first→last", "MIN")
    keep = [i for i, c in enumerate(cols) if not compact or c in COMPACT]
    for i in keep:
        t.add_column(cols[i], justify="left" if cols[i] == "engine" else "right", no_wrap=True)
    for b in bases:
        t.add_column(f"vs {b}", justify="right", no_wrap=True)
    several = len({r.get("workload") for r in rows}) > 1  # a JSON holding runs of several workloads: say which
    for r in rows:
        tp = r.get("tpot_s")
        bpt = _med(r, "bytes_per_token")
        rss = _med(r, "peak_rss_run_bytes")
        cells = [
            r["engine"] + (f" [{r.get('workload')}]" if several else ""), _fmt_budget(r["budget"]), str(r["batch"]),
            f"{r['generated']}/{r['new_tokens']}" + ("*" if r.get("stopped_by_time_limit") else ""),
            _fmt_s(_med(r, "ttft_s")), _fmt_s(_med(r, "tpot_s")),
            "–" if tp is None else f"{_fmt_s(tp['min'])}–{_fmt_s(tp['max'])}",
            "–" if _med(r, "tokens_per_s") is None else f"{_med(r, 'tokens_per_s'):.2f}",
            "–" if bpt is None else f"{bpt / 2**20:.1f}",
            _fmt_s(_med(r, "floor_tpot_s")), _fmt_x(_med(r, "tpot_over_floor")),
            "–" if rss is None else _fmt_budget(rss),
            _fmt_held(r),
            _fmt_hits(r.get("hits")),
            _fmt_int(_med(r, "distinct_tokens")) + (f" ↻{r['cycle']}" if r.get("cycle") else ""),
            _fmt_int(_med(r, "distinct_experts")),
            _fmt_quarters(_med(r, "hit_rate_first_quarter"), _med(r, "hit_rate_last_quarter")),
            _fmt_pct(_med(r, "belady_hit_rate")) + ("≤" if r.get("capacity_upper_bound") and _med(r, "belady_hit_rate") is not None else ""),
        ]
        cells = [cells[i] for i in keep]
        for b in bases:
            x = rindex.get((r["engine"], b, r["budget"], r["batch"], r["new_tokens"], r.get("workload")))
            cells.append(_fmt_x(x["tpot_x"]) if x else "")
        t.add_row(*cells)
    if console is not None:
        console.print(t)
    return t


def _per_layer(h: dict | None) -> str:
    """Experts per decode layer call in each state, as ``full·…·miss`` (F·C·S·E·miss)."""
    if not h:
        return "–"
    return "·".join(f"{h.get(s, 0.0):.2f}" for s in STATES)


def measured_hits_per_layer(row: dict, top_k: int | None) -> dict | None:
    """A row's hits as experts per layer call (the counters count tensors, prefill included):
    their shares times ``top_k``, comparable with the predicted and modelled figures."""
    h = row.get("hits")
    if not h or not top_k:
        return None
    total = sum(h.values())
    return {k: top_k * h.get(k, 0) / total for k in STATES} if total else None


def render_predictions(rows: list[dict], top_k: int | None = None, console=None):
    """Predicted against measured, for the runs that have a prediction: the plan's (made before,
    from the calibration: ``predicted``), and the cost model charged for the run's own routing
    (``model``: the profile's served state costs on the hits a replay of that routing gives, which
    are the run's); each with measured / predicted, and the experts per layer call in each state
    (predicted, measured). None when no run has one."""
    from rich.table import Table

    keep = [r for r in rows if _med(r, "predicted_tpot_s") is not None or _med(r, "model_tpot_s") is not None]
    if not keep:
        return None
    t = Table(title="predicted against measured (time per output token)", title_justify="left", pad_edge=False)
    for c in ("engine", "budget", "batch", "tokens", "TPOT", "predicted", "×", "model", "×", "predicted by",
              "F·C·S·E·miss predicted", "measured"):
        t.add_column(c, justify="left" if c in ("engine", "predicted by") else "right", no_wrap=True)
    for r in keep:
        tp, pr, mo = _med(r, "tpot_s"), _med(r, "predicted_tpot_s"), _med(r, "model_tpot_s")
        t.add_row(r["engine"], _fmt_budget(r["budget"]), str(r["batch"]), f"{r['generated']}/{r['new_tokens']}", _fmt_s(tp),
                  _fmt_s(pr), _fmt_x(_ratio(tp, pr)), _fmt_s(mo), _fmt_x(_ratio(tp, mo)), r.get("predicted_by") or "–",
                  _per_layer(r.get("predicted_hits")), _per_layer(measured_hits_per_layer(r, top_k)))
    if console is not None:
        console.print(t)
    return t


def paired(runs: list[dict], engines: list[str] | None = None) -> list[dict]:
    """``--rounds``: every engine's TPOT against the first engine's (``engines`` order) at the same
    budget, batch, new tokens and workload, **round by round** (runs tagged ``round``), then the
    median and range of those per-round ratios. Engines that ran in one round share that
    round's disk and machine state, so the ratio of a round does not carry the drift between
    rounds that pooled medians do (docs/bench.md, "Rounds"). Empty without two rounds."""
    by: dict[tuple, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for r in runs:
        if r.get("round") is None or r.get("tpot_s") is None:
            continue
        engine, budget, batch, new_tokens, workload = _key(r)
        by[(budget, batch, new_tokens, workload, int(r["round"]))][engine].append(float(r["tpot_s"]))
    order = list(engines or [])
    groups: dict[tuple, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for (budget, batch, new_tokens, workload, rnd), per in by.items():
        names = [e for e in order if e in per] + sorted(e for e in per if e not in order)
        ref = names[0]
        t_ref = statistics.median(per[ref])
        for e in names[1:]:
            if t_ref > 0:
                groups[(budget, batch, new_tokens, workload, ref)][e].append((rnd, statistics.median(per[e]) / t_ref))
    rows = []
    for (budget, batch, new_tokens, workload, ref), per in groups.items():
        for e, xs in per.items():
            xs.sort()
            vals = [x for _, x in xs]
            if len(vals) < 2:
                continue
            rows.append({"engine": e, "against": ref, "budget": budget, "batch": batch, "new_tokens": new_tokens,
                         "workload": workload, "rounds": len(vals), "tpot_x": statistics.median(vals),
                         "min": min(vals), "max": max(vals), "per_round": vals})
    rows.sort(key=lambda r: (r["budget"] or 0, r["batch"], r["new_tokens"], r["engine"]))
    return rows


def render_paired(rows: list[dict], console=None):
    """The table of :func:`paired`; None when there is nothing to show."""
    from rich.table import Table

    from zipmoe.units import format_size

    if not rows:
        return None
    t = Table(title="TPOT against the first engine, round by round (--rounds)", title_justify="left", pad_edge=False)
    for c in ("engine", "against", "budget", "batch", "tokens", "rounds", "× median", "× min–max", "per round"):
        t.add_column(c, justify="left" if c in ("engine", "against", "per round") else "right", no_wrap=True)
    for r in rows:
        t.add_row(r["engine"], r["against"], format_size(r["budget"]) if r["budget"] else "–", str(r["batch"]),
                  str(r["new_tokens"]), str(r["rounds"]), f"{r['tpot_x']:.3f}", f"{r['min']:.3f}–{r['max']:.3f}",
                  " ".join(f"{x:.3f}" for x in r["per_round"]))
    if console is not None:
        console.print(t)
    return t


def render_host_work(rows: list[dict], console=None):
    """The serving thread's work per fetched tensor (``row["host_work"]``), for the rows that
    have it; None when none has."""
    from rich.table import Table

    keep = [r for r in rows if r.get("host_work")]
    if not keep:
        return None
    names = sorted({k for r in keep for k in (r["host_work"].get("parts") or {}) if k != "other"})
    t = Table(title="the serving thread's work per fetched tensor (µs)", title_justify="left", pad_edge=False)
    cols = ["engine", "budget", "batch", "tokens", "fetched/run", "host", "admit", *names, "other", "predict", "wait",
            "decode (workers)"]
    for c in cols:
        t.add_column(c, justify="left" if c == "engine" else "right", no_wrap=True)
    for r in keep:
        h = r["host_work"]
        p = h.get("parts") or {}
        cells = [f"{h[k]:.0f}" for k in ("host", "admit")] + [f"{p[k]:.0f}" if k in p else "–" for k in names]
        cells += [f"{p['other']:.0f}" if "other" in p else "–", f"{h['predict']:.0f}", f"{h['wait']:.0f}",
                  f"{h['decode']:.0f}" if h.get("decode") is not None else "–"]
        t.add_row(r["engine"], _fmt_budget(r["budget"]), str(r["batch"]), f"{r['generated']}/{r['new_tokens']}",
                  f"{h['fetched']:.0f}", *cells)
    if console is not None:
        console.print(t)
    return t


def plot(rows: list[dict], path: str) -> str:
    """TPOT (median) by budget, one line per engine, one panel per (batch, new tokens).

    Raises :class:`UsageError` when matplotlib is missing (the ``bench`` extra installs it).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'zipmoe[bench]' (the table and --json still work)") from None
    cases = sorted({(r["batch"], r["new_tokens"]) for r in rows})
    if not cases:
        raise UsageError("nothing to plot: no successful runs")
    fig, axes = plt.subplots(1, len(cases), figsize=(5 * len(cases), 4), squeeze=False)
    for ax, (batch, nt) in zip(axes[0], cases):
        sub = [r for r in rows if r["batch"] == batch and r["new_tokens"] == nt and _med(r, "tpot_s") is not None]
        budgets = sorted({r["budget"] for r in sub if r["budget"] is not None})
        for eng in sorted({r["engine"] for r in sub}, key=_order):
            pts = sorted((r["budget"], _med(r, "tpot_s")) for r in sub if r["engine"] == eng and r["budget"] is not None)
            if pts:
                ax.plot([b / 2**30 for b, _ in pts], [v for _, v in pts], marker="o", label=eng)
            elif budgets:  # resident: no budget, a horizontal line
                v = next(_med(r, "tpot_s") for r in sub if r["engine"] == eng)
                ax.axhline(v, linestyle="--", color="grey", label=f"{eng} (no budget)")
        floor = sorted((r["budget"], _med(r, "floor_tpot_s")) for r in sub if r["engine"] == "zipmoe" and _med(r, "floor_tpot_s"))
        if floor:
            ax.plot([b / 2**30 for b, _ in floor], [v for _, v in floor], linestyle=":", color="black", label="I/O floor (zipmoe)")
        ax.set_xlabel("budget (GiB)")
        ax.set_ylabel("time per output token (s)")
        ax.set_yscale("log")
        ax.set_title(f"batch {batch}, {nt} new tokens")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
