"""The paper's tables, as `zipmoe bench` measures them: ``zipmoe bench ... --paper`` (or
``zipmoe bench --report out.json --paper``) prints them, ``--paper-json`` writes them,
``--paper-plot`` draws them.

Built from one bench document (out.json; several runs merged with ``--merge``):

- ``latency``: decoder-only TTFT and TPOT per engine and budget (batch 1; the case with the
  most new tokens, so TPOT averages over the most steps);
- ``throughput``: output tokens per second at each batch size measured (the paper: 1, 4, 16);
- ``e2e``: end-to-end latency per number of new tokens measured (the paper: 32, 128, 512), batch 1;
- ``ablation``: zipmoe-basic (basic eviction only), zipmoe-pools (+heterogeneous pools),
  zipmoe-noprefetch (+planning), zipmoe (+prefetch across layers): TPOT and speed-up over
  basic, per budget;
- ``agreement``: how far each engine's greedy tokens agree with zipmoe's (share of equal
  positions over the common length, first difference). For llama.cpp this is a figure, not a
  check: same bits in, other kernels.

A cell is a figure or says why there is none: ``cannot run`` (the engine's one-line error is
in the notes and in the cell's ``why``: a missing package, a budget it cannot keep, a device it
does not run on), ``not measured``
when that engine, budget or case was not part of the run. A figure measured while the engine
broke the budget (DeepSpeed offloading to CPU memory) carries ``†`` and the reason in the notes.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from zipmoe.errors import UsageError
from zipmoe.runtime.bench.merge import case_key

SCHEMA = "zipmoe-bench-tables/1"
MULTI_SCHEMA = "zipmoe-bench-tables-models/1"  # several models: {"schema", "models": [one SCHEMA document each]}
ORDER = ("zipmoe", "zipmoe-default", "zipmoe-noprefetch", "zipmoe-pools", "zipmoe-basic", "uncompressed", "accelerate", "deepspeed", "llama.cpp", "moe-infinity", "resident")
ABLATION = (("zipmoe-basic", "basic"), ("zipmoe-pools", "+pools"), ("zipmoe-noprefetch", "+planning"),
            ("zipmoe", "+prefetch"))


def _order(e: str) -> int:
    return ORDER.index(e) if e in ORDER else len(ORDER)


def _med(row: dict | None, metric: str):
    if not row or not row.get(metric):
        return None
    return row[metric]["median"]


def _short(msg: str, limit: int = 90) -> str:
    msg = " ".join(str(msg).split())
    return msg if len(msg) <= limit else msg[: limit - 1] + "…"


def _status(doc: dict) -> dict:
    """(engine, budget) -> {"error": line} or {"budget_broken": line}; (engine, None) for engine-wide errors."""
    out: dict = {}
    for e in doc.get("errors") or []:
        eng = e.get("engine")
        if eng and eng != "prepare":
            out.setdefault((eng, e.get("budget")), {})["error"] = e.get("error")
    for r in doc.get("results") or []:
        key = (r.get("engine"), r.get("budget"))
        if r.get("ok") and key in out:  # a later run (--merge) replaced the failed one
            out[key].pop("error", None)
        if not r.get("ok") and r.get("error"):
            out.setdefault(key, {})["error"] = r["error"]
        if r.get("budget_broken"):
            out.setdefault(key, {})["budget_broken"] = r["budget_broken"]
        for cid, line in (r.get("case_errors") or {}).items():  # per case, kept across --merge
            out.setdefault(key, {}).setdefault("cases", {})[case_key(cid)] = line
    return out


def _engines_budgets(doc: dict) -> tuple[list[str], list]:
    engines, budgets = set(), set()
    for c in doc.get("configs") or []:
        engines.update(c.get("engines") or [])
        budgets.update(b for b in c.get("budgets") or [] if b is not None)
    for r in doc.get("summary") or []:
        engines.add(r["engine"])
        if r.get("budget") is not None:
            budgets.add(r["budget"])
    return sorted(engines, key=_order), sorted(budgets)


def _budget_of(engine: str, budget):
    return None if engine == "resident" else budget


def _cell(doc_status: dict, rows: dict, engine: str, budget, key: tuple, metric: str) -> dict:
    """{"value": float|None, "text": str, "flag": "†"|""} for one table cell."""
    b = _budget_of(engine, budget)
    st = doc_status.get((engine, b)) or doc_status.get((engine, None)) or {}
    row = rows.get((engine, b) + key)
    v = _med(row, metric)
    flag = "†" if st.get("budget_broken") else ""
    if v is not None:
        cell = {"value": v, "text": "", "flag": flag, "generated": row.get("generated"), "stopped_by_time_limit": row.get("stopped_by_time_limit")}
        if row.get("machine"):  # merged sittings on several machines (build_all marks the rows)
            cell["machine"] = row["machine"]
        return cell
    why = (st.get("cases") or {}).get(tuple(key)) or st.get("error")
    if why:
        return {"value": None, "text": "cannot run", "why": why, "flag": flag}
    return {"value": None, "text": "not measured", "flag": flag}


def _per_token_cells(status: dict, rows: dict, engine: str, budget, case: tuple, metrics: tuple) -> dict:
    """The cells of per-token figures at ``case`` (batch, new tokens); an engine that did not run
    it shows its own longest run at that batch, the cells marked with its length (``new_tokens``,
    rendered ``@N``): a time per token or to the first token compares across lengths."""
    b = _budget_of(engine, budget)
    if (engine, b) + case not in rows:
        own = [k[3] for k in rows if k[:3] == (engine, b, case[0])]
        if own:
            case = (case[0], max(own))
            cells = {m: _cell(status, rows, engine, budget, case, m) for m in metrics}
            for c in cells.values():
                c["new_tokens"] = case[1]
            return cells
    return {m: _cell(status, rows, engine, budget, case, m) for m in metrics}


def _usual_length(rows: dict, batch) -> int | None:
    """The new tokens most engines and budgets ran at ``batch`` (ties: the longest); None when none ran it."""
    counts = defaultdict(int)
    for (_e, _bud, b, n) in rows:
        if b == batch:
            counts[n] += 1
    return max(counts, key=lambda n: (counts[n], n)) if counts else None


def _index(summary: list[dict]) -> dict:
    return {(r["engine"], r.get("budget"), r["batch"], r["new_tokens"]): r for r in summary}


def token_agreement(runs: list[dict], reference: str = "zipmoe") -> list[dict]:
    """Per engine and budget: share of positions where its greedy tokens equal the reference's
    (same case, row and run index; over the common length), and the first difference."""
    by = defaultdict(dict)
    for r in runs:
        if r.get("tokens") is None:
            continue
        # under teacher forcing the tokens are the forced stream: compare the model's argmax at each step
        toks = r["argmax_tokens"] if r.get("argmax_tokens") is not None else r["tokens"]
        by[(r["batch"], r["new_tokens"], r.get("case"))].setdefault((r["engine"], r.get("budget")), toks)
    ref_engine = reference if any(k[0] == reference for v in by.values() for k in v) else "resident"
    acc: dict = defaultdict(lambda: {"equal": 0, "compared": 0, "first_difference": None, "rows": 0})
    for case, per in by.items():
        refs = {b: t for (e, b), t in per.items() if e == ref_engine}
        if not refs:
            continue
        for (eng, budget), toks in per.items():
            if eng == ref_engine:
                continue
            ref = refs.get(budget) or next(iter(refs.values()))
            a = acc[(eng, budget)]
            for x, y in zip(ref, toks):
                n = min(len(x), len(y))
                eq = sum(1 for i in range(n) if x[i] == y[i])
                a["equal"] += eq
                a["compared"] += n
                a["rows"] += 1
                diff = next((i for i in range(n) if x[i] != y[i]), None)
                if diff is not None and (a["first_difference"] is None or diff < a["first_difference"]):
                    a["first_difference"] = diff
    out = []
    for (eng, budget), a in sorted(acc.items(), key=lambda kv: (_order(kv[0][0]), kv[0][1] or 0)):
        out.append({"engine": eng, "budget": budget, "reference": ref_engine, "agreement": a["equal"] / a["compared"] if a["compared"] else None,
                    "positions": a["compared"], "rows": a["rows"], "first_difference_at": a["first_difference"]})
    return out


def build(doc: dict) -> dict:
    """Every table as JSON-able data (a summary row's ``machine``, set by :func:`build_all` where
    merged sittings ran on several machines, marks its cells)."""
    summary = doc.get("summary") or []
    rows = _index(summary)
    status = _status(doc)
    engines, budgets = _engines_budgets(doc)
    if not budgets:
        budgets = [None]
    cases = sorted({(r["batch"], r["new_tokens"]) for r in summary})
    tables: dict = {}

    # TTFT / TPOT, batch 1: at the length most engines and budgets ran (ties: the longest); an engine
    # that did not run it shows its own longest batch-1 run, its length in the cell (TPOT is per token)
    b1 = [n for b, n in cases if b == 1]
    bt = 1 if b1 else (min(b for b, _ in cases) if cases else None)
    nt = _usual_length(rows, bt)
    if nt is None:
        nt = max(n for _, n in cases) if cases else None
    lat = []
    for e in engines:
        for bud in ([None] if e == "resident" else budgets):
            lat.append({"engine": e, "budget": bud, **_per_token_cells(status, rows, e, bud, (bt, nt), ("ttft_s", "tpot_s"))})
    encdec = _encoder_decoder(doc)
    kind = ("encoder-decoder: TTFT is the encoder's pass over the prompt and the first decoder step, TPOT a decoder step"
            if encdec else "decoder-only")
    tables["latency"] = {"title": f"TTFT and TPOT (batch {bt}, {nt} new tokens; {kind})", "batch": bt, "new_tokens": nt, "rows": lat,
                         "encoder_decoder": encdec}

    # throughput by batch
    batches = sorted({b for b, _ in cases})
    usual = {b: _usual_length(rows, b) for b in batches}
    thr = []
    for e in engines:
        for bud in ([None] if e == "resident" else budgets):
            cells = {}
            for b in batches:
                # the engine's own longest generation at this batch (engines run different lengths); marked
                # with its length (@N) where that is not the batch's usual one (a 512-token run beside 64s)
                mine = [n for (ee, bb_, b2, n) in rows if ee == e and bb_ == bud and b2 == b]
                ns = mine or [n for bb, n in cases if bb == b]
                cells[str(b)] = _cell(status, rows, e, bud, (b, max(ns)), "tokens_per_s")
                if cells[str(b)]["value"] is not None and max(ns) != usual[b]:
                    cells[str(b)]["new_tokens"] = max(ns)
            thr.append({"engine": e, "budget": bud, "by_batch": cells})
    tables["throughput"] = {"title": "throughput (output tokens/s) by batch size (each engine's longest run at that batch; "
                                     "@N: a run of N new tokens where the batch's others ran another length)",
                            "batches": batches, "rows": thr}

    # end-to-end latency by new tokens, batch 1 (or the smallest batch)
    lens = sorted({n for b, n in cases if b == bt}) if bt is not None else []
    e2e = []
    for e in engines:
        for bud in ([None] if e == "resident" else budgets):
            e2e.append({"engine": e, "budget": bud, "by_new_tokens": {str(n): _cell(status, rows, e, bud, (bt, n), "e2e_s") for n in lens}})
    tables["e2e"] = {"title": f"end-to-end latency by new tokens (batch {bt})", "batch": bt, "new_tokens": lens, "rows": e2e}

    # ablation: at the longest generation of batch bt that zipmoe-basic ran (the variants are
    # usually run together, on fewer tokens than the e2e table's longest)
    na = max((n for (e, _b, b, n) in rows if e == "zipmoe-basic" and b == bt), default=nt)
    variants = list(ABLATION)
    if not _prefetch_on(doc):  # prefetch was off in zipmoe's runs (the CPU default): zipmoe is +planning
        variants = [(e, lab) for e, lab in ABLATION if e not in ("zipmoe-noprefetch", "zipmoe")] + [("zipmoe", "+planning")]
    abl = []
    for bud in budgets:
        base_row = rows.get(("zipmoe-basic", bud, bt, na))
        base, base_mark = _med(base_row, "tpot_s"), (base_row or {}).get("machine")
        for eng, label in variants:
            c = _cell(status, rows, eng, bud, (bt, na), "tpot_s")
            # a speed-up only between runs of one machine (merged sittings: other machines, other code)
            speed = (base / c["value"]) if (base and c["value"] and c.get("machine") == base_mark) else None
            abl.append({"variant": label, "engine": eng, "budget": bud, "tpot_s": c, "speedup_over_basic": speed})
    names = " / ".join(lab for _, lab in variants)
    tables["ablation"] = {"title": f"ablation: {names} (TPOT, batch {bt}, {na} new tokens)", "rows": abl}

    runs = [r for d in doc.get("results") or [] for r in d.get("runs") or []]
    tables["agreement"] = {"title": "greedy tokens agreeing with zipmoe's (a figure: other kernels may round differently)",
                           "rows": token_agreement(runs)}
    notes = sorted({f"† {e} @ {_fmt_budget(b)}: {st['budget_broken']}" for (e, b), st in status.items() if st.get("budget_broken")})
    notes += sorted({f"{e}" + (f" @ {_fmt_budget(b)}" if b is not None else "") + f" cannot run: {st['error']}"
                     for (e, b), st in status.items() if st.get("error")})
    return {"schema": SCHEMA, "container": doc.get("container"), "model": doc.get("model"), "device": doc.get("device"),
            "machine": doc.get("machine"), "tables": tables, "notes": notes}


def _encoder_decoder(doc: dict) -> bool:
    model = doc.get("model") or {}
    return model.get("model_type") == "switch_transformers" or "ConditionalGeneration" in str(model.get("architecture") or "")


def _model_name(doc: dict) -> str:
    """The model the tables are of: the synth preset and its layer cut where recorded, else the
    container's file name."""
    model = doc.get("model") or {}
    name = Path(str(doc.get("container") or "?")).stem
    bits = [b for b in (model.get("model_type"), f"{model.get('num_layers')} layers" if model.get("num_layers") else None) if b]
    return f"{name} ({', '.join(bits)})" if bits else name


def pressure_table(normal: dict | None, pressed: dict) -> dict:
    """The memory-pressure case (``bench --pressure``): each engine and budget's TPOT and TTFT
    without and with the host's memory occupied, at the case both measured (batch 1 where
    there, the most new tokens), and the slow-down under pressure."""
    p_rows = _index(pressed.get("summary") or [])
    n_rows = _index((normal or {}).get("summary") or [])
    st_p, st_n = _status(pressed), _status(normal or {})
    rec = pressed.get("pressure") or {}
    out = []
    for (e, bud) in sorted({(k[0], k[1]) for k in p_rows} | {(k[0], k[1]) for k in st_p if k[0]},
                           key=lambda k: (_order(k[0]), k[1] or 0)):
        mine = sorted((k[2], k[3]) for k in p_rows if k[:2] == (e, bud))
        both = [c for c in mine if (e, bud) + c in n_rows]
        b1 = [c for c in (both or mine) if c[0] == 1] or (both or mine)
        case = max(b1, key=lambda c: c[1]) if b1 else (1, 0)
        cells = {**_per_token_cells(st_n, n_rows, e, bud, case, ("tpot_s", "ttft_s")),  # without pressure
                 "tpot_pressure_s": _cell(st_p, p_rows, e, bud, case, "tpot_s"), "ttft_pressure_s": _cell(st_p, p_rows, e, bud, case, "ttft_s")}
        a, b = cells["tpot_s"]["value"], cells["tpot_pressure_s"]["value"]
        same = cells["tpot_s"].get("machine") == cells["tpot_pressure_s"].get("machine")  # merged sittings: one machine's
        out.append({"engine": e, "budget": bud, "batch": case[0], "new_tokens": case[1], **cells,
                    "slowdown": (b / a) if (a and b and same) else None})
    left = rec.get("leave_bytes")
    title = ("memory pressure: TPOT without and with the host's memory occupied"
             + (f" ({_fmt_budget(rec.get('occupied_bytes'))} occupied, {_fmt_budget(left)} left available)" if left else ""))
    notes = []
    if rec and rec.get("held_to_the_end") is False:
        notes.append("the ballast ended before the last engine finished (the OOM killer?): later runs were not under pressure")
    if rec.get("swap_bytes"):
        notes.append(f"the host has {_fmt_budget(rec['swap_bytes'])} of swap: the occupied memory could be paged out"
                     + ("" if rec.get("mlocked") else " (mlock was refused)"))
    return {"title": title, "pressure": rec, "rows": out, "notes": notes}


def build_all(docs: list[dict]) -> dict:
    """The tables of several bench documents: grouped by model (container id), the documents
    of one model combined in order (merge.combine), those measured under ``--pressure`` kept
    apart as that model's memory-pressure table. One model: :func:`build`'s document (with
    ``tables.pressure`` when there); several: ``{"schema": MULTI_SCHEMA, "models": [...]}``."""
    from zipmoe.runtime.bench.merge import combine
    from zipmoe.runtime.bench.run import finalize

    groups: dict = {}
    for d in docs:
        key = d.get("container_id") or d.get("container")
        groups.setdefault(key, {"main": [], "pressure": []})["pressure" if d.get("pressure") else "main"].append(d)
    models = []
    for g in groups.values():
        main = finalize(combine(g["main"])) if g["main"] else None
        pressed = finalize(combine(g["pressure"])) if g["pressure"] else None
        marks, machines_notes = _machine_marks(g["main"], g["pressure"])
        for doc, own in ((main, marks.get("main")), (pressed, marks.get("pressure"))):
            for row in ((doc or {}).get("summary") or []) if own else []:
                row["machine"] = own.get((row["engine"], row.get("budget"), row["batch"], row["new_tokens"]))
        t = build(main if main is not None else pressed)
        t["name"] = _model_name(main if main is not None else pressed)
        first = (g["main"] or g["pressure"])[0].get("device")
        for d in g["main"][1:]:  # e.g. llama.cpp's CPU build beside the GPU engines
            if d.get("device") != first:
                names = ", ".join(sorted({r.get("engine") for r in d.get("results") or []}))
                t["notes"] = list(t.get("notes") or []) + [f"{names}: measured with --device {d.get('device')} (the other engines: {first})"]
        t["notes"] = list(t.get("notes") or []) + machines_notes
        if marks:
            t["machines"] = sorted({m for own in marks.values() for m in own.values()})
        if pressed is not None:
            t["tables"]["pressure"] = pressure_table(main, pressed)
            t["notes"] = list(t.get("notes") or []) + t["tables"]["pressure"]["notes"]
        models.append(t)
    if len(models) == 1:
        return models[0]
    return {"schema": MULTI_SCHEMA, "models": models}


def _machine_of(doc: dict) -> str:
    """Where a bench document ran, in words: the GPU's name (else the CPU's) and the day it started."""
    m = doc.get("machine") or {}
    where = m.get("gpu") or m.get("cpu") or "an unnamed machine"
    day = str(doc.get("started") or "")[:10]
    return f"{where}, {day}" if day else where


def _machine_marks(main: list[dict], pressure: list[dict]) -> tuple[dict, list[str]]:
    """When a model's documents (sittings merged with ``--report``) ran on more than one machine:
    ``({"main": marks, "pressure": marks}, notes)``, each marks mapping (engine, budget, batch, new
    tokens) to a letter per machine (in order of appearance; combine keeps the later document's run
    of a case), the notes naming each letter's machine. ``({}, [])`` when they all ran on one."""
    labels = list(dict.fromkeys(_machine_of(d) for d in main + pressure))
    if len(labels) < 2:
        return {}, []
    letter = {m: chr(ord("A") + i) for i, m in enumerate(labels)}
    marks: dict = {"main": {}, "pressure": {}}
    for name, docs in (("main", main), ("pressure", pressure)):
        for d in docs:  # in order: a later document's run of a case replaces an earlier one's (merge.combine)
            for r in d.get("results") or []:
                for run in r.get("runs") or []:
                    marks[name][(r.get("engine"), r.get("budget"), run.get("batch"), run.get("new_tokens"))] = letter[_machine_of(d)]
    used = {m for own in marks.values() for m in own.values()}
    notes = [f"[{letter[m]}] measured on {m} (sittings merged: compare figures of one letter; the ablation's "
             "speed-ups and the slow-downs under pressure are given only within one)" for m in labels if letter[m] in used]
    return marks, notes


def _models(tables: dict) -> list[dict]:
    return tables["models"] if tables.get("schema") == MULTI_SCHEMA else [tables]


def _prefetch_on(doc: dict) -> bool:
    """Whether zipmoe's runs had prefetch across layers on (the runtime's describe(), recorded at
    load); True when unknown (older documents)."""
    for d in doc.get("results") or []:
        if d.get("engine") == "zipmoe":
            rt = (d.get("load_info") or {}).get("runtime")
            if isinstance(rt, dict) and "prefetch" in rt:
                return bool(rt["prefetch"])
    return True


# ----------------------------------------------------------------------------- presentation


def _fmt_budget(b) -> str:
    if b is None:
        return "none"
    from zipmoe.units import format_size

    return format_size(b).replace(".00 ", " ").replace("iB", "")


def _fmt_s(v) -> str:
    if v is None:
        return "–"
    return f"{v:.2f} s" if v >= 1 else f"{v * 1000:.1f} ms"


def _text(c: dict, fmt) -> str:
    if c["value"] is None:
        return c["text"] + c.get("flag", "")
    s = fmt(c["value"]) + c.get("flag", "")
    if c.get("stopped_by_time_limit"):
        s += "*"
    if c.get("new_tokens") is not None:  # another length than the table's (its own longest run)
        s += f" @{c['new_tokens']}"
    if c.get("machine"):  # merged sittings on several machines: which one measured it (the notes name them)
        s += f" [{c['machine']}]"
    return s


def grids(model: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """One model's tables as (title, headers, rows of text): what the console and the markdown
    show alike."""
    T = model["tables"]
    out = []
    lat = T["latency"]
    out.append((lat["title"], ["engine", "budget", "TTFT", "TPOT"],
                [[r["engine"], _fmt_budget(r["budget"]), _text(r["ttft_s"], _fmt_s), _text(r["tpot_s"], _fmt_s)] for r in lat["rows"]]))
    thr = T["throughput"]
    out.append((thr["title"], ["engine", "budget"] + [f"batch {b}" for b in thr["batches"]],
                [[r["engine"], _fmt_budget(r["budget"])] + [_text(r["by_batch"][str(b)], lambda v: f"{v:.2f}") for b in thr["batches"]]
                 for r in thr["rows"]]))
    e2e = T["e2e"]
    out.append((e2e["title"], ["engine", "budget"] + [f"{n} tokens" for n in e2e["new_tokens"]],
                [[r["engine"], _fmt_budget(r["budget"])] + [_text(r["by_new_tokens"][str(n)], _fmt_s) for n in e2e["new_tokens"]]
                 for r in e2e["rows"]]))
    abl = T["ablation"]
    out.append((abl["title"], ["budget", "variant", "TPOT", "speed-up over basic"],
                [[_fmt_budget(r["budget"]), r["variant"], _text(r["tpot_s"], _fmt_s),
                  "–" if r["speedup_over_basic"] is None else f"{r['speedup_over_basic']:.2f}x"] for r in abl["rows"]]))
    if T.get("pressure"):
        pr = T["pressure"]
        out.append((pr["title"], ["engine", "budget", "case", "TPOT", "TPOT under pressure", "slow-down", "TTFT", "TTFT under pressure"],
                    [[r["engine"], _fmt_budget(r["budget"]), f"b{r['batch']} n{r['new_tokens']}", _text(r["tpot_s"], _fmt_s),
                      _text(r["tpot_pressure_s"], _fmt_s), "–" if r["slowdown"] is None else f"{r['slowdown']:.2f}x",
                      _text(r["ttft_s"], _fmt_s), _text(r["ttft_pressure_s"], _fmt_s)] for r in pr["rows"]]))
    agr = T["agreement"]
    out.append((agr["title"], ["engine", "budget", "agreement", "positions", "first difference at"],
                [[r["engine"], _fmt_budget(r["budget"]), "–" if r["agreement"] is None else f"{100 * r['agreement']:.1f}%", str(r["positions"]),
                  "none" if r["first_difference_at"] is None else f"token {r['first_difference_at']}"] for r in agr["rows"]]))
    return out


def _footnotes(model: dict) -> list[str]:
    notes = list(model.get("notes") or [])
    T = model["tables"]
    if any(c.get("stopped_by_time_limit") for r in T["latency"]["rows"] for c in (r["ttft_s"], r["tpot_s"])):
        notes.append("* stopped by --time-limit before all new tokens were made (figures are per token)")
    if any(c.get("new_tokens") is not None for r in T["latency"]["rows"] for c in (r["ttft_s"], r["tpot_s"])):
        notes.append("@N: that engine did not run the table's length; its longest run at that batch, of N new tokens")
    return notes


def render(tables: dict, console) -> None:
    from rich.table import Table

    several = tables.get("schema") == MULTI_SCHEMA
    for model in _models(tables):
        if several:
            console.print(f"\n{model.get('name') or model.get('container')}", style="bold", markup=False)
        for title, head, rows in grids(model):
            t = Table(title=title, pad_edge=False)
            for i, col in enumerate(head):
                t.add_column(col, justify="left" if i == 0 or col in ("engine", "variant") else "right", overflow="fold")
            for r in rows:
                t.add_row(*r)
            console.print(t)
        for n in _footnotes(model):
            console.print(f"  {n}", style="dim", markup=False)


def markdown(tables: dict) -> str:
    """Every model's tables as markdown (a heading per model, a bold title per table), as
    docs/benchmarks.md quotes them."""
    def cell(x: str) -> str:
        return x.replace("|", "\\|")

    lines = []
    for model in _models(tables):
        lines += [f"### {model.get('name') or model.get('container')}", ""]
        mach = model.get("machine") or {}
        where = ", ".join(str(x) for x in (mach.get("gpu") or mach.get("cpu"), model.get("device")) if x)
        if model.get("machines"):
            lines += [f"Measured on {len(model['machines'])} machines, marked {', '.join('[' + m + ']' for m in model['machines'])} "
                      "(the notes below name them).", ""]
        elif where:
            lines += [f"Measured on {where}.", ""]
        for title, head, rows in grids(model):
            lines += [f"**{cell(title)}**", "", "| " + " | ".join(cell(h) for h in head) + " |",
                      "|" + "|".join("---" if i == 0 else "---:" for i in range(len(head))) + "|"]
            lines += ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows]
            lines.append("")
        lines += [f"- {cell(n)}" for n in _footnotes(model)]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def plot(tables: dict, path) -> str:
    """Four panels per model (a row each): TPOT by engine and budget, throughput by batch, e2e by length, ablation."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--paper-plot needs matplotlib: pip install 'zipmoe[bench]'") from None
    models = _models(tables)
    fig, grid = plt.subplots(len(models), 4, figsize=(22, 4.5 * len(models)), squeeze=False)
    for axes, model in zip(grid, models):
        T = model["tables"]
        ax = axes[0]
        rows = [r for r in T["latency"]["rows"]]
        labels = [f"{r['engine']}\n{_fmt_budget(r['budget'])}" for r in rows]
        vals = [r["tpot_s"]["value"] or 0 for r in rows]
        bars = ax.bar(range(len(rows)), vals, color=["C0" if r["tpot_s"]["value"] else "lightgrey" for r in rows])
        for i, r in enumerate(rows):
            if r["tpot_s"]["value"] is None:
                ax.text(i, 0.02, r["tpot_s"]["text"], rotation=90, ha="center", va="bottom", fontsize=7, transform=ax.get_xaxis_transform())
            elif r["tpot_s"].get("flag"):
                bars[i].set_hatch("//")
        ax.set_xticks(range(len(rows)), labels, fontsize=7, rotation=60)
        ax.set_yscale("log")
        ax.set_ylabel("TPOT (s)")
        ax.set_title(T["latency"]["title"], fontsize=9)
        for ax, key, sub, xl, yl in ((axes[1], "throughput", "by_batch", "batch", "tokens/s"), (axes[2], "e2e", "by_new_tokens", "new tokens", "end-to-end (s)")):
            xs = T[key]["batches"] if key == "throughput" else T[key]["new_tokens"]
            for r in T[key]["rows"]:
                pts = [(x, r[sub][str(x)]["value"]) for x in xs if r[sub][str(x)]["value"] is not None]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{r['engine']} {_fmt_budget(r['budget'])}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel(xl)
            ax.set_ylabel(yl)
            ax.set_title(T[key]["title"], fontsize=9)
            ax.legend(fontsize=6)
        ax = axes[3]
        ab = T["ablation"]["rows"]
        ax.bar(range(len(ab)), [r["tpot_s"]["value"] or 0 for r in ab], color=["C1", "C2", "C3"] * (len(ab) // 3 + 1))
        ax.set_xticks(range(len(ab)), [f"{r['variant']}\n{_fmt_budget(r['budget'])}" for r in ab], fontsize=7)
        ax.set_ylabel("TPOT (s)")
        ax.set_title(T["ablation"]["title"], fontsize=9)
        if len(models) > 1:
            axes[0].set_title(f"{model.get('name')}\n{T['latency']['title']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(str(path), dpi=110)
    plt.close(fig)
    return str(path)


def emit(doc: dict, show: bool = True, json_path=None, plot_path=None, console=None, md_path=None) -> dict:
    return _emit(build(doc), show, json_path, plot_path, console, md_path)


def emit_all(docs: list[dict], show: bool = True, json_path=None, plot_path=None, console=None, md_path=None) -> dict:
    """The tables of one or several bench documents (:func:`build_all`)."""
    return _emit(build_all(docs), show, json_path, plot_path, console, md_path)


def _emit(tables: dict, show, json_path, plot_path, console, md_path) -> dict:
    if show:
        if console is None:
            import sys

            from rich.console import Console

            console = Console(width=None if sys.stdout.isatty() else 200)
        render(tables, console)
    for opt, path, text in (("--paper-json", json_path, lambda: json.dumps(tables, indent=1)), ("--paper-md", md_path, lambda: markdown(tables))):
        if path is None:
            continue
        p = Path(path)
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text())
        except OSError as exc:
            raise UsageError(f"{opt} {p}: cannot write it ({exc.strerror or exc})") from None
    if plot_path is not None:
        plot(tables, plot_path)
    return tables
