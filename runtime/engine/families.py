"""The model families the runtime serves, and how each one exposes its experts.

Two kinds of integration:

* ``fused``: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2/V3 keep the experts of a layer
  in one module decorated with transformers' ``@use_experts_implementation`` (parameters
  ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]). The runtime registers its own
  experts function as ``"zipmoe"`` in ``ALL_EXPERTS_FUNCTIONS`` and builds the model with
  ``experts_implementation="zipmoe"``; the parameters stay on the meta device.
* ``modules``: SwitchTransformers keeps experts as modules (``mlp.experts.expert_N.wi/wo``);
  the runtime replaces each ``SwitchTransformersExperts`` with its own module.

Each family also says which transformers auto class builds it. Unknown architectures raise
:class:`~zipmoe.errors.ModelError` listing the supported ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from zipmoe.errors import ModelError

__all__ = ["Family", "FAMILIES", "family_for", "supported_names"]


@dataclass(frozen=True)
class Family:
    name: str  # zipmoe's family id (what `zipmoe synth` calls it)
    model_types: tuple  # config.json "model_type" values
    auto: str  # "causal" (AutoModelForCausalLM) or "seq2seq" (AutoModelForSeq2SeqLM)
    kind: str  # "fused" (ExpertsInterface) or "modules" (module replacement)
    # compute units per expert, in order: name -> projections of the container that fill it
    # (in order along dim 0 of the compute tensor)
    units: tuple = (("gate_up", ("gate", "up")), ("down", ("down",)))


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("mixtral", ("mixtral",), "causal", "fused"),
        Family("qwen2_moe", ("qwen2_moe",), "causal", "fused"),
        Family("qwen3_moe", ("qwen3_moe",), "causal", "fused"),
        Family("olmoe", ("olmoe",), "causal", "fused"),
        Family("deepseek_v2", ("deepseek_v2",), "causal", "fused"),
        Family("deepseek_v3", ("deepseek_v3",), "causal", "fused"),
        Family(
            "switch_transformers",
            ("switch_transformers",),
            "seq2seq",
            "modules",
            units=(("up", ("up",)), ("down", ("down",))),
        ),
    )
}


def supported_names() -> list[str]:
    return sorted(FAMILIES)


def family_for(config: dict, meta: dict | None = None) -> Family:
    """The family of a model from its config.json (and the container's meta, if given)."""
    model_type = (config or {}).get("model_type")
    family_hint = ((meta or {}).get("model") or {}).get("family")
    for fam in FAMILIES.values():
        if model_type in fam.model_types:
            return fam
    if family_hint in FAMILIES and model_type is None:
        return FAMILIES[family_hint]
    arch = ((config or {}).get("architectures") or [model_type])[0]
    raise ModelError(
        f"unsupported architecture {arch!r} (model_type {model_type!r}); zipmoe serves: "
        + ", ".join(supported_names())
    )
