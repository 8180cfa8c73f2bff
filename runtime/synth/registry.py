"""The registry: every family `zipmoe synth` writes, and their presets."""

from __future__ import annotations

import math

from zipmoe.errors import UsageError

from . import deepseek_v2, mixtral, olmoe, qwen2_moe, qwen3_moe, switch_transformers
from .family import Family, count_parameters

FAMILIES: dict[str, Family] = {
    m.FAMILY.name: m.FAMILY for m in (mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v2, switch_transformers)
}


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        raise UsageError(f"unknown family {name!r}: use one of {', '.join(FAMILIES)} (or `demo`)")
    return FAMILIES[name]


def presets(family: str) -> list[str]:
    """Preset names of a family, smallest first."""
    return list(get_family(family).presets)


def preset_table(family: str | None = None) -> list[dict]:
    """Rows for ``zipmoe synth --list``: family, preset, source, parameters, expert share, bf16 bytes.

    Parameter counts come from transformers' own modules built on the meta device (a second or
    two for the largest presets)."""
    from .family import meta_parameters

    rows = []
    for fam in [get_family(family)] if family else FAMILIES.values():
        for name, p in fam.presets.items():
            params = meta_parameters(fam, fam.config(name))
            total = sum(math.prod(s) for _, s in params)
            expert = sum(math.prod(s) for n, s in params if ".experts." in n)
            rows.append(dict(family=fam.name, preset=name, source=p.note, params=total,
                             expert_params=expert, bf16_bytes=2 * total))
    return rows


__all__ = ["FAMILIES", "get_family", "presets", "preset_table", "count_parameters"]
