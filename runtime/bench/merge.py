"""``zipmoe bench --merge``: one engine and budget's new result over an earlier one in the same
JSON document, keeping the cases the new run did not measure and why earlier ones failed."""

from __future__ import annotations

__all__ = ["merge_runs", "case_key", "combine"]


def merge_runs(new: dict, old: dict) -> dict:
    """Keep in ``new`` (one engine/budget's result) the runs of ``old`` whose case (batch, new
    tokens) ``new`` did not measure, so that ``--merge`` adds cases instead of dropping them."""
    seen = {(r.get("batch"), r.get("new_tokens")) for r in new.get("runs") or []}
    kept = [r for r in old.get("runs") or [] if (r.get("batch"), r.get("new_tokens")) not in seen]
    if kept:
        new["runs"] = kept + list(new.get("runs") or [])
    # the old result's failed cases that the new one neither measured nor failed itself
    errs = {k: v for k, v in (old.get("case_errors") or {}).items()
            if k not in (new.get("case_errors") or {}) and case_key(k) not in seen}
    if errs:
        new["case_errors"] = {**errs, **(new.get("case_errors") or {})}
    return new


def case_key(case_id: str) -> tuple:
    """``"b4-n32"`` (``inputs.make_cases``' ids) -> (4, 32); (None, None) for anything else."""
    try:
        b, n = case_id.split("-")
        return int(b[1:]), int(n[1:])
    except ValueError:
        return (None, None)


def combine(docs: list[dict]) -> dict:
    """Several bench documents of one model (sittings, stages) as one, in the given order: a later
    document's engine/budget result goes over an earlier one as ``--merge`` would put it (its
    cases replace the same cases, the others kept); errors and configs are kept from all. The
    caller recomputes the summary (``run.finalize``)."""
    import copy

    out = copy.deepcopy(docs[0])
    for d in docs[1:]:
        # an earlier failure of an engine that this document tried again (at that budget, or at any budget
        # for an engine-wide one: a build that failed) is no longer the engine's state: its run overcame it,
        # or its own error is the state now (DeepSpeed on Switch: a build error of 4 Dec, then on 8 Dec, the
        # build fixed, a budget too small for its swap buffers)
        tried = {(r.get("engine"), r.get("budget")) for r in d.get("results") or [] if r.get("ok")}
        tried |= {(e.get("engine"), e.get("budget")) for e in d.get("errors") or []}
        out["errors"] = [e for e in out.get("errors") or []
                         if (e.get("engine"), e.get("budget")) not in tried
                         and not (e.get("budget") is None and any(k[0] == e.get("engine") for k in tried))]
        for res in d.get("results") or []:
            key = (res.get("engine"), res.get("budget"))
            res = copy.deepcopy(res)
            for old in [r for r in out["results"] if (r.get("engine"), r.get("budget")) == key]:
                merge_runs(res, old)
            out["results"] = [r for r in out["results"] if (r.get("engine"), r.get("budget")) != key] + [res]
        out["errors"] = list(out.get("errors") or []) + list(d.get("errors") or [])
        out["configs"] = list(out.get("configs") or []) + list(d.get("configs") or [])
        if d.get("disk_bw") and not out.get("disk_bw"):  # the first document's measure, else the first there is
            out["disk_bw"] = d["disk_bw"]
    return out
