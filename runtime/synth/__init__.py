"""zipmoe.runtime.synth: synthetic checkpoints of every supported family, and the demo model.

    from zipmoe.runtime import synth
    synth.FAMILIES                     # {"mixtral": Family, ...}
    synth.presets("mixtral")           # ["tiny", "small", "mixtral-8x7b", "mixtral-8x22b"]
    synth.write("mixtral", "out/", preset="tiny", seed=0, skew=1.0)   # -> SynthResult
    synth.build_demo("demo/", experts=8, top_k=2)                     # -> DemoResult
"""

from __future__ import annotations

from .registry import FAMILIES, get_family, preset_table, presets
from .writer import SynthResult, write


def build_demo(out_dir, experts: int = 8, top_k: int = 2, **kwargs):
    """Upcycle SmolLM2-135M-Instruct into a Mixtral-architecture MoE (see ``demo.build_demo``)."""
    from .demo import build_demo as _build

    return _build(out_dir, experts=experts, top_k=top_k, **kwargs)


__all__ = ["FAMILIES", "SynthResult", "build_demo", "get_family", "preset_table", "presets", "write"]
