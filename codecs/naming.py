"""Recognise expert tensors by name, per model family.

``classify(name, shape, config)`` says whether a tensor belongs to a routed expert (and which
layer, expert and projection) or is dense (everything else: attention, norms, embeddings,
routers/gates, shared experts, dense FFNs).

Recognised layouts (``L`` layer, ``N`` expert)::

    Mixtral               ...layers.L.block_sparse_moe.experts.N.w1|w2|w3.weight   w1 gate, w3 up, w2 down
    Qwen2-MoE, Qwen3-MoE, ...layers.L.mlp.experts.N.gate_proj|up_proj|down_proj.weight
      OLMoE, DeepSeek-V2/V3, Jamba (feed_forward.experts.N...), and any `experts.N.<proj>`
    SwitchTransformers    encoder|decoder.block.B.layer.J.mlp.experts.expert_N.wi|wo.weight   wi up, wo down
    NLLB-MoE style        model.encoder|decoder.layers.B.ffn.experts.expert_N.fc1|fc2.weight  fc1 up, fc2 down
    fused (transformers 5) ...layers.L.mlp.experts.gate_up_proj [E, 2I, H], ...experts.down_proj [E, H, I]
                           (also with suffixes such as _bias or _scale_inv): fused=True, expert=None

The ``experts`` path segment must match exactly: ``shared_expert.`` / ``shared_experts.``
(Qwen2-MoE, DeepSeek) are dense, as are routers (``mlp.gate``, ``router.classifier``,
``e_score_correction_bias``).

Layer numbers. For decoder-only models ``layer`` is the index of the transformer block
(``layers.L``); blocks without experts (DeepSeek's first dense layers, Qwen2-MoE's
``mlp_only_layers``) simply leave gaps. SwitchTransformers has two stacks, so its layers are
numbered by the *global block index in module order*: encoder block ``B`` is layer ``B``,
decoder block ``B`` is layer ``num_layers + B`` where ``num_layers`` is the encoder depth from
config.json (``SWITCH_DECODER_OFFSET_NO_CONFIG`` = 1000 when there is no config, which keeps
the numbers unique for any real depth). The same holds for ``encoder.layers.B`` /
``decoder.layers.B`` when config.json has ``is_encoder_decoder`` (encoder depth from
``encoder_layers``). :func:`switch_layer` is the one place that computes
it; the runtime uses it too.
"""

from __future__ import annotations

import re
from typing import NamedTuple

__all__ = ["TensorRole", "classify", "num_experts", "switch_layer", "SWITCH_DECODER_OFFSET_NO_CONFIG"]

SWITCH_DECODER_OFFSET_NO_CONFIG = 1000

#: Per-expert projection names, normalised.
_PROJ = {
    "gate_proj": "gate", "up_proj": "up", "down_proj": "down",
    "w1": "gate", "w3": "up", "w2": "down",  # Mixtral
    "wi": "up", "wo": "down",  # SwitchTransformers
    "fc1": "up", "fc2": "down",  # NLLB-MoE style
    "gate_up_proj": "gate_up",
}

#: Fused (all experts in one parameter) names, by prefix of the segment after ``experts``.
_FUSED = (("gate_up_proj", "gate_up"), ("down_proj", "down"), ("gate_proj", "gate"), ("up_proj", "up"))

_EXPERT_ID = re.compile(r"^(?:expert_)?(\d+)$")
_LAYER_SEGMENTS = ("layers", "h", "blocks", "layer")


class TensorRole(NamedTuple):
    role: str  # "expert" | "dense"
    layer: int | None
    expert: int | None
    proj: str | None  # "gate" | "up" | "down" | "gate_up" | None
    fused: bool


DENSE = TensorRole("dense", None, None, None, False)


def num_experts(config: dict | None) -> int | None:
    """Routed experts per layer according to config.json, if it says."""
    if not config:
        return None
    for key in ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"):
        v = config.get(key)
        if isinstance(v, int) and v > 0:
            return v
    tc = config.get("text_config")
    return num_experts(tc) if isinstance(tc, dict) else None


def switch_layer(stack: str, block: int, config: dict | None) -> int:
    """Global layer number of a block of an encoder-decoder model (``stack``: "encoder" or
    "decoder"): encoder blocks keep their index, decoder blocks follow the encoder's.

    The encoder depth is config.json's ``num_layers`` (T5/SwitchTransformers) or
    ``encoder_layers`` (BART/NLLB-MoE style); ``SWITCH_DECODER_OFFSET_NO_CONFIG`` without one.
    """
    if stack == "encoder":
        return block
    cfg = config or {}
    n_enc = cfg.get("encoder_layers") if "encoder_layers" in cfg else cfg.get("num_layers")
    if not isinstance(n_enc, int) or n_enc < 0:
        n_enc = SWITCH_DECODER_OFFSET_NO_CONFIG
    return n_enc + block


def _layer_of(parts: list[str], upto: int, config: dict | None) -> int | None:
    # Encoder-decoder: encoder|decoder . block . B (T5 family: always two stacks), or
    # encoder|decoder . layers . B when config.json says is_encoder_decoder (NLLB-MoE style;
    # decoder-only models such as OPT also name their stack "decoder").
    enc_dec = bool((config or {}).get("is_encoder_decoder"))
    for i in range(upto - 2):
        if (parts[i] in ("encoder", "decoder") and parts[i + 2].isdigit()
                and (parts[i + 1] == "block" or (enc_dec and parts[i + 1] == "layers"))):
            return switch_layer(parts[i], int(parts[i + 2]), config)
    for i in range(upto - 1):
        if parts[i] in _LAYER_SEGMENTS and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def classify(name: str, shape: tuple, config: dict | None = None) -> TensorRole:
    """Role of one tensor: ``TensorRole(role, layer, expert, proj, fused)``.

    Dense tensors carry their layer when the name has one (``layers.3.self_attn...``) and
    ``expert=None, proj=None``. A fused tensor must have at least 2 dimensions (the first is
    the expert axis); a 1-D tensor named like one is dense.
    """
    parts = name.split(".")
    try:
        k = parts.index("experts")
    except ValueError:
        return DENSE._replace(layer=_layer_of(parts, len(parts), config))
    layer = _layer_of(parts, k, config)
    if k + 1 >= len(parts):
        return DENSE._replace(layer=layer)
    nxt = parts[k + 1]
    m = _EXPERT_ID.match(nxt)
    if m:
        proj = _PROJ.get(parts[k + 2]) if k + 2 < len(parts) else None
        return TensorRole("expert", layer, int(m.group(1)), proj, False)
    for prefix, proj in _FUSED:
        if nxt.startswith(prefix):
            if len(shape) < 2:
                break
            return TensorRole("expert", layer, None, proj, True)
    return DENSE._replace(layer=layer)
