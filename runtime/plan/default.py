"""The plan ``chat``, ``serve`` and ``bench --engine zipmoe`` use when no ``--plan`` is given.

:func:`default_plan` fits one at load, without measuring anything (loading must stay quick):

* the machine's cached hardware profile of this container (the one ``zipmoe plan`` measured
  and left in the cache folder, runtime/plan/profile.py ``default_profile_path``). Without one
  (or a stale one) there are no measured costs to weigh pools against each other, and the
  default is **full tensors only**: the plan that needs no decompression and that every
  measurement so far found no slower than the mixed default split (docs/benchmarks.md §22);
* the activation statistics of earlier runs of this container: per sparse layer, how often each
  expert was used (the runtime's ``counters.uses``), kept in ``<cache>/stats/<container id>.json``
  and added to by :func:`record_usage` when a run ends (chat and serve call it). Until they hold
  ``MIN_CALLS_PER_LAYER`` calls per layer the default is **full tensors only** too: the plan fitted
  on the uniform prior put the whole budget into SM-only slots on the H200 (every expert equally
  hot, so a full slot's CUDA-graph gain looks small) and measured 1.24x slower than full tensors
  only at 6G (docs/benchmarks.md §22), while the plans fitted on recorded routing beat full
  tensors only at both budgets measured. A corrupt or foreign file: a warning and a fresh start,
  never a crash.

Refit: every load fits again from the statistics kept so far, so the plan follows the routing
as runs accumulate. ``--plan FILE`` always wins. The line :func:`default_plan` returns says which
case it was (the CLI prints it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from zipmoe.units import format_size

__all__ = ["STATS_FORMAT", "stats_path", "read_stats", "read_usage", "read_routing", "record_usage", "default_plan", "full_only_plan", "find_profile"]

STATS_FORMAT = "zipmoe-stats/1"
#: fewer recorded layer calls per sparse layer than this: the statistics are not used yet
MIN_CALLS_PER_LAYER = 64


def stats_path(cache_dir, container_id: str) -> Path:
    return Path(cache_dir) / "stats" / f"{container_id}.json"


def read_stats(path, container_id: str) -> tuple[dict, int, list, str | None]:
    """The kept statistics in one read: ``(counts {layer: {expert: uses}}, layer calls recorded,
    the most recent layer calls [(layer, (experts, ...)), ...] oldest first, warning or None)``;
    a missing file is empty without a warning, an unreadable one empty with one."""
    p = Path(path)
    if not p.exists():
        return {}, 0, [], None
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
        if not isinstance(doc, dict) or doc.get("format") != STATS_FORMAT:
            raise ValueError(f"not a {STATS_FORMAT} file")
        if doc.get("container_id") != container_id:
            raise ValueError(f"it belongs to container {doc.get('container_id')}")
        counts = {str(int(l)): {str(int(e)): int(n) for e, n in per.items()} for l, per in doc["uses"].items()}
        calls = int(doc.get("layer_calls", 0))
        routing = [(int(layer), tuple(int(e) for e in experts)) for layer, experts in doc.get("routing") or []]
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        return {}, 0, [], f"activation statistics {p} are unusable ({exc}); starting afresh"
    return counts, calls, routing, None


def read_usage(path, container_id: str) -> tuple[dict, int, str | None]:
    """``(counts, layer calls recorded, warning or None)`` of :func:`read_stats`."""
    counts, calls, _routing, warn = read_stats(path, container_id)
    return counts, calls, warn


def read_routing(path, container_id: str) -> list:
    """The most recent layer calls of :func:`read_stats` (empty when the file is unusable)."""
    return read_stats(path, container_id)[2]


def record_usage(cache_dir, container_id: str, uses: dict, calls: int, routing=None) -> Path | None:
    """Add a run's ``counters.uses`` (or a delta of two snapshots) to the kept statistics, with
    ``calls`` the run's calls per sparse layer (``counters.layer_calls / sparse layers``); written
    atomically. ``routing``: the run's most recent layer calls (``counters.recent_calls``), kept
    after those kept before, the last ``RECENT_CALLS`` of them, for :func:`default_plan` to judge a
    mixed plan by. Returns the path, or None when nothing was written (no uses, unwritable folder)."""
    from zipmoe.runtime.engine.counters import RECENT_CALLS

    if not uses or cache_dir is None:
        return None
    path = stats_path(cache_dir, container_id)
    counts, kept, recent, _warn = read_stats(path, container_id)
    recent = recent + [(int(layer), tuple(int(e) for e in experts)) for layer, experts in (routing or [])]
    added = 0
    for layer, per in uses.items():
        row = counts.setdefault(str(int(layer)), {})
        for e, n in per.items():
            row[str(int(e))] = row.get(str(int(e)), 0) + int(n)
            added += int(n)
    if not added:
        return None
    doc = {"format": STATS_FORMAT, "container_id": container_id, "uses": counts,
           "layer_calls": kept + int(calls), "routing": [[layer, list(ex)] for layer, ex in recent[-RECENT_CALLS:]]}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(doc), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        return None
    return path


def full_only_plan(layout, budget: int, workers: int) -> dict:
    """Every pool byte to full tensors (what the runtime does by itself when every expert fits)."""
    return {"container_id": layout.container_id, "pools": {"full": int(layout.pool_bytes(budget, workers)),
                                                           "compressed": 0, "sm_only": 0, "e_only": 0},
            "source": "full tensors only"}


def find_profile(path, container_id: str, device: str, dtype: str, cache_dir, *, profile_path=None,
                 readers: int | None = None, why: list | None = None) -> dict | None:
    """The profile with served state costs (``step_costs``) that fits this machine, file, device and
    dtype (and reader count, when given): ``profile_path`` when given, else the cache's; None when
    there is none, it is stale or it cannot be read. ``why``: a list that gets the reason when a
    profile that fits has no served costs (its served passes failed, or the runtime did not run)."""
    from zipmoe.errors import ZipmoeError
    from zipmoe.runtime.plan.profile import PROFILE_REVISION, check_profile, default_profile_path, load_profile

    if cache_dir is None and profile_path is None:
        return None
    p = Path(profile_path) if profile_path is not None else default_profile_path(container_id, device, dtype, cache_dir=cache_dir)
    try:
        prof = load_profile(p) if p.exists() else None
    except ZipmoeError:
        return None
    if prof is None:
        return None
    # another machine, file, device or dtype; or measured before today's passes (revision 4: the
    # admission rate): `zipmoe plan` measures again
    if check_profile(prof, path, container_id, device, dtype) is not None or prof.get("revision", 1) < PROFILE_REVISION:
        return None
    if not prof.get("step_costs"):
        if why is not None:
            rt = prof.get("runtime") or {}
            failed = rt.get("serving_error") or rt.get("error")
            why.append("the cached profile has no per-state costs: "
                       + (f"its served passes failed ({failed}); " if failed else "it was measured without the served passes; ")
                       + f"`zipmoe plan {Path(path).name} --remeasure` measures again")
        return None
    if readers is not None and prof.get("disk", {}).get("readers") != readers:
        return None
    return prof


def default_plan(path, budget: int, device: str, workers: int, cache_dir, *, readers: int | None = None,
                 dtype: str = "bfloat16", profile_path=None, batch: int = 1) -> tuple[dict | None, str]:
    """``(plan or None, one line saying what it is)``. None: the runtime's own split is right
    (every expert fits as a full tensor) or the container cannot be planned. ``profile_path``: a
    profile file to use instead of the cache's (bench's ``--profile``), when it fits. ``batch``:
    the rows served together (``bench --batch N``); more than one is fitted by
    :func:`_batch_default`."""
    from zipmoe.codecs.reader import ContainerReader
    from zipmoe.errors import ZipmoeError
    from zipmoe.runtime.plan.layout import container_layout
    from zipmoe.runtime.plan.planner import make_plan
    from zipmoe.runtime.plan.stats import from_counts

    try:
        with ContainerReader(path) as reader:
            layout = container_layout(reader, dtype, device)
    except ZipmoeError:
        return None, "default plan: none (the container has no experts to plan)"
    cid, dtype = layout.container_id, layout.dtype  # "auto" resolved as the runtime resolves it
    if budget < layout.min_budget(workers):
        return None, "default plan: none (the budget is below the model's minimum)"
    if layout.pool_bytes(budget, workers) >= layout.total_expert_full:
        return None, "default plan: every expert fits as a full tensor"
    why: list = []
    prof = find_profile(path, cid, device, dtype, cache_dir, profile_path=profile_path, readers=readers, why=why)
    if prof is None and why:  # a current profile without served costs: the line says why
        return full_only_plan(layout, budget, workers), f"default plan: full tensors only ({why[0]})"
    if prof is None:
        return (full_only_plan(layout, budget, workers),
                "default plan: full tensors only (no current profile of this machine and file cached; "
                f"`zipmoe plan {Path(path).name} --budget {format_size(budget).replace(' ', '')}` measures one, then the pools are fitted at load)")
    counts, calls, recent, warn = read_stats(stats_path(cache_dir, cid), cid) if cache_dir is not None else ({}, 0, [], None)
    if calls < MIN_CALLS_PER_LAYER or not counts:
        line = ("default plan: full tensors only (no routing of this file recorded yet: the pools are fitted at load "
                "once earlier runs have recorded it)")
        return full_only_plan(layout, budget, workers), (warn + "\n" + line) if warn else line
    stats = from_counts(counts, container_id=cid, num_experts=layout.num_experts, top_k=layout.top_k,
                        layers=layout.sparse_layers, calls=calls)
    if int(batch) > 1:
        plan, line = _batch_default(path, layout, budget, stats, prof, workers, device, recent, int(batch), profile_path)
        return plan, (warn + "\n" + line) if warn else line
    try:
        plan = make_plan(layout, budget, stats, prof, workers=workers, device=device, profile_source="cached")
    except ZipmoeError as exc:
        return full_only_plan(layout, budget, workers), f"default plan: full tensors only ({exc})"
    what = f"the activations of {calls} earlier layer calls of this file"
    if any(int(v) for k, v in plan["pools"].items() if k != "full"):
        plan, verdict = _confirm_mix(path, layout, budget, stats, prof, workers, device, plan, recent, singles=True)
        if verdict:
            what += f"; {verdict}"
    elif _compressed_worth_replaying(plan, recent, layout):
        # the rank model kept full tensors only, with compressed only close behind: the replay of
        # the recorded routing, which `zipmoe plan` judges every single-pool plan by, decides
        alt = make_plan(layout, budget, stats, prof, workers=workers, device=device, profile_source="cached",
                        only="compressed")
        chosen, verdict = _confirm_mix(path, layout, budget, stats, prof, workers, device, alt, recent, name="compressed only")
        if chosen is alt:
            plan = alt
        what += f"; {verdict}"
    pools = ", ".join(f"{k} {format_size(v)}" for k, v in plan["pools"].items() if v)
    line = (f"default plan: fitted at load from the cached profile and {what}: {pools or 'no pools'}, "
            f"predicted {1e3 * plan['expected_tpot_s']:.1f} ms per token")
    from zipmoe.runtime.plan.busy import busy_warning

    busy = busy_warning(prof)
    for w in (busy, warn):
        if w:
            line = w + "\n" + line
    plan["source"] = "default"
    return plan, line


#: recorded decode calls the default plan needs before it replays them to judge a mix
MIN_REPLAY_DECODE_CALLS = 256
#: where the rank model keeps full tensors only but predicts compressed only within this share of
#: it, the default replays compressed only too (on the CPU box at 300M the rank model put it 1.1%
#: ahead, the replay 3.8%, and it ran 1.08x faster: docs/benchmarks.md §22r)
REPLAY_COMPRESSED_WITHIN = 0.10


def _decode_calls(recent: list, layout) -> int:
    """The recorded layer calls a replay would judge by: decode calls (at most ``top_k`` experts) of sparse layers."""
    sparse = set(layout.sparse_layers)
    return sum(1 for layer, ex in recent if layer in sparse and len(ex) <= layout.top_k)


def _recorded_replay(path, layout, recent: list) -> tuple[list, dict]:
    """``(layer calls, expert tensors)``: the recorded routing of the sparse layers as a replay
    takes it (runtime/plan/replay.py), and the container's tensors it is replayed over."""
    from zipmoe.codecs.reader import ContainerReader
    from zipmoe.runtime.plan.layout import expert_tensors
    from zipmoe.runtime.plan.replay import LayerCall

    sparse = set(layout.sparse_layers)
    calls = [LayerCall(layer, tuple(sorted(ex)), len(ex) <= layout.top_k) for layer, ex in recent if layer in sparse]
    with ContainerReader(path) as reader:
        return calls, expert_tensors(reader, compute_itemsize=layout.compute_itemsize)


def _compressed_worth_replaying(plan: dict, recent: list, layout) -> bool:
    """Whether a full-tensors-only fit should have compressed only judged on the recorded routing:
    the rank model predicts it within ``REPLAY_COMPRESSED_WITHIN`` of full tensors only and there
    are enough recorded decode calls to replay."""
    alts = plan.get("alternatives") or {}
    c, f = (alts.get("compressed only") or {}).get("expected_tpot_s"), (alts.get("full only") or {}).get("expected_tpot_s")
    if not c or not f or float(c) > (1 + REPLAY_COMPRESSED_WITHIN) * float(f):
        return False
    return _decode_calls(recent, layout) >= MIN_REPLAY_DECODE_CALLS


def _confirm_mix(path, layout, budget: int, stats, prof: dict, workers: int, device: str, plan: dict,
                 recent: list, name: str = "the mix", singles: bool = False) -> tuple[dict, str]:
    """The rank model chose a mixed plan (its steady state has no churn, so it admits nothing):
    judge it against full tensors only on the recorded routing, replayed through the runtime's
    cache with the host pools' admission copies charged (runtime/plan/planner.py ``beats_full``,
    the rule ``zipmoe plan`` applies: ``margin_for`` the mix faster on the whole replay and on each half). Without
    enough recorded routing the mix is not trusted: full tensors only (on the H100 box the default
    fitted so chose a mix that ran 4.7% slower than full tensors only, docs/benchmarks.md §22k).
    ``singles``: the fitted plan's single-pool alternatives are judged beside it on the same replay
    and the choice is ``zipmoe plan``'s (``Planner.leave_full``: the fastest that gains its margin
    over full tensors only, and of those within ``SIMPLER_WITHIN`` of it the one with fewest pools;
    on the CPU box at 500M the default fitted full and compressed slots, replayed 5.5% ahead of
    full tensors only, and ran 6% behind them, where `zipmoe plan` chose compressed only,
    docs/benchmarks.md §22v). ``name``: what the line calls ``plan``. Returns ``(plan, what was
    decided, for the line)``."""
    from zipmoe.runtime.plan.planner import Planner, pct, margin_for

    full = full_only_plan(layout, budget, workers)
    full["expected_tpot_s"] = float((plan.get("alternatives", {}).get("full only") or {}).get("expected_tpot_s", 0.0))
    decode = _decode_calls(recent, layout)
    if decode < MIN_REPLAY_DECODE_CALLS:
        return full, (f"the mix it fitted is not used: {decode} recorded decode layer calls to judge it by "
                      f"(at least {MIN_REPLAY_DECODE_CALLS})")
    calls, ets = _recorded_replay(path, layout, recent)
    planner = Planner(layout, stats, prof, workers, layout.window(budget, workers))
    planner.use_replay(calls, ets, slots=str(device).startswith("cuda"))
    mix, only = plan["slots"]["per_layer"], plan["alternatives"]["full only"]["slots"]
    if singles:  # the single pools beside the mix, chosen among as `zipmoe plan` chooses
        pools = {k[:-len(" only")]: alt["slots"] for k, alt in plan["alternatives"].items()
                 if k.endswith(" only") and k != "full only"}
        chosen, _halves, _fastest = planner.leave_full([mix, *pools.values()], only)
        pool = None
        if chosen is not None and dict(chosen) != dict(mix):
            pool = next(p for p, sl in pools.items() if dict(sl) == dict(chosen))
        if pool is not None:
            from zipmoe.runtime.plan.planner import make_plan

            alt = make_plan(layout, budget, stats, prof, workers=workers, device=device, profile_source="cached", only=pool)
            t_alt, t_mix, t_full = planner.judged_s(chosen), planner.judged_s(mix), planner.judged_s(only)
            alt["expected_tpot_s"] = t_alt
            return alt, (f"replayed {decode} recorded decode layer calls: {pool} only {1e3 * t_alt:.1f} ms, the mix "
                         f"{1e3 * t_mix:.1f} ms, full tensors only {1e3 * t_full:.1f} ms: {pool} only")
        ok = chosen is not None
    else:
        ok, _halves = planner.beats_full(mix, only)
    t_mix, t_full = planner.judged_s(mix), planner.judged_s(only)
    judged = f"replayed {decode} recorded decode layer calls: {name} {1e3 * t_mix:.1f} ms, full tensors only {1e3 * t_full:.1f} ms"
    if ok:
        plan["expected_tpot_s"] = t_mix
        return plan, judged
    full["expected_tpot_s"] = t_full
    return full, judged + f" (it must be {pct(margin_for(mix))}% faster): full tensors only"


def _batch_default(path, layout, budget: int, stats, prof: dict, workers: int, device: str, recent: list,
                   batch: int, profile_path=None) -> tuple[dict, str]:
    """The default plan for ``batch`` rows served together: ``zipmoe plan --batch N``'s choice
    (:func:`make_plan` with ``batch``: the costs served at N rows, the recorded routing replayed as
    N rows call the layers, the same rule for leaving full tensors) when the profile holds costs
    served at N rows and enough routing is recorded; else **full tensors only**, without
    measuring at load. A plan fitted for one row is not used for several: on the CPU box at 500M
    the batch-1 plan (compressed only) lost 4% to full tensors only at four rows, where the plan
    for four rows kept full tensors (docs/benchmarks.md §22r, §22t); the rows' union of experts
    changes what each pool costs."""
    from zipmoe.errors import ZipmoeError
    from zipmoe.runtime.plan.batched import has_batch
    from zipmoe.runtime.plan.planner import make_plan

    full = full_only_plan(layout, budget, workers)
    rows = f"for {batch} rows"
    if not has_batch(prof, batch):
        return full, (f"default plan: full tensors only {rows} (the cached profile has no costs served at {batch} rows: "
                      f"`zipmoe plan {Path(path).name} --profile-only --batch {batch}"
                      f"{f' --profile {profile_path}' if profile_path is not None else ''}` measures them once, then the pools "
                      f"are fitted at load)")
    decode = _decode_calls(recent, layout)
    if decode < MIN_REPLAY_DECODE_CALLS:
        return full, (f"default plan: full tensors only {rows} ({decode} recorded decode layer calls to replay as "
                      f"{batch} rows call the layers; at least {MIN_REPLAY_DECODE_CALLS})")
    try:
        plan = make_plan(layout, budget, stats, prof, workers=workers, device=device, profile_source="cached",
                         replay=_recorded_replay(path, layout, recent), batch=batch)
    except (ZipmoeError, ValueError) as exc:
        return full, f"default plan: full tensors only {rows} ({exc})"
    pools = ", ".join(f"{k} {format_size(v)}" for k, v in plan["pools"].items() if v)
    plan["source"] = "default"
    return plan, (f"default plan: fitted at load {rows} from the costs the cached profile served at {batch} rows and "
                  f"{decode} recorded decode layer calls of this file replayed as {batch} rows: {pools or 'no pools'}, "
                  f"predicted {1e3 * plan['expected_tpot_s']:.1f} ms per step of {batch} tokens")
