"""The dtype a served model computes in, by name (torch-free, so that the planner sizes with it).

``auto`` is config.json's dtype (``dtype`` or ``torch_dtype``; bfloat16 when it names none the
runtime computes in); ``bfloat16``/``bf16``, ``float16``/``fp16``, ``float32``/``fp32`` name
themselves; anything else is a :class:`~zipmoe.errors.UsageError`. The loader turns the name into
a torch dtype (:func:`zipmoe.runtime.engine.loader.resolve_dtype`), the planner into bytes per value.
"""

from __future__ import annotations

from zipmoe.errors import UsageError

__all__ = ["ITEMSIZE", "compute_dtype"]

ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _name(d) -> str:
    d = str(d).lower().replace("torch.", "")
    return _ALIASES.get(d, d)


def compute_dtype(dtype, config: dict) -> str:
    """The canonical name (``bfloat16``, ``float16`` or ``float32``) of what the model computes in."""
    d = _name(dtype or "auto")
    if d == "auto":
        d = _name(config.get("dtype") or config.get("torch_dtype") or "bfloat16")
        return d if d in ITEMSIZE else "bfloat16"
    if d not in ITEMSIZE:
        raise UsageError(f"unknown dtype {dtype!r} (use auto, bfloat16 or float32)")
    return d
