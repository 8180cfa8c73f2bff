"""``zipmoe bench --merge``: one engine and budget's new result over an earlier one in the same
JSON document, keeping the cases the new run did not measure and why earlier ones failed."""

from __future__ import annotations

__all__ = ["merge_runs", "case_key"]


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
