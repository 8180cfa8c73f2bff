"""What a family is to `zipmoe synth`, and the tensor plan of one checkpoint.

The tensor list comes from transformers itself: the model is built on the meta device from the
config (no memory), its parameters are listed, and the fused expert parameters of transformers 5
(``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]) are expanded into
the family's usual per-expert on-disk names (layout ``split``) or kept fused (layout ``fused``).
Either way every value is drawn under its per-expert name, so both layouts hold the same numbers.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch

from zipmoe.errors import UsageError

from .weights import Init

# Token ids shared by every synthetic checkpoint (see tokenizer.py).
PAD_ID, EOS_ID, BOS_ID, IM_START_ID, IM_END_ID = 0, 1, 2, 3, 4

LAYOUTS = ("split", "fused")

#: Per-layer selection entropy of a trained model, normalised by log2(experts) (1 = uniform),
#: that routing ``natural`` aims at: Qwen1.5-MoE-A2.7B on GSM8K, 5.88 bits over 60 experts
#: (docs/synth.md says where the figures come from and why every family uses this one).
NATURAL_ENTROPY = 5.88 / math.log2(60)


@dataclass(frozen=True)
class Preset:
    name: str
    config: dict
    note: str = ""
    params: int | None = None  # total parameters (checked against transformers by a test)


@dataclass(frozen=True)
class Family:
    name: str
    config_class: type
    model_class: str  # transformers class that loads it
    presets: dict = field(default_factory=dict)
    # on-disk projection names of one expert: {"gate": "w1", "up": "w3", "down": "w2"}
    expert_projs: dict = field(default_factory=lambda: {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"})
    moe_module: str = "mlp"  # on-disk name of the sparse block (Mixtral: block_sparse_moe)
    fused: bool = True  # has a transformers-5 fused expert layout
    natural_entropy: float = NATURAL_ENTROPY  # routing "natural": normalised selection entropy

    def default_routing(self, preset: str) -> str:
        """``skewed`` for ``tiny`` (the test fixtures are built on its bytes), else ``natural``."""
        return "skewed" if preset == "tiny" else "natural"

    def preset(self, name: str) -> Preset:
        if name not in self.presets:
            raise UsageError(f"unknown preset {name!r} for {self.name}: use one of {', '.join(self.presets)}")
        return self.presets[name]

    def config(self, preset: str):
        """The transformers config object of a preset (ids of the synthetic tokenizer set)."""
        kwargs = dict(self.preset(preset).config)
        kwargs.setdefault("pad_token_id", PAD_ID)
        kwargs.setdefault("eos_token_id", EOS_ID)
        kwargs.setdefault("bos_token_id", BOS_ID)
        kwargs.setdefault("tie_word_embeddings", False)
        cfg = self.config_class(**kwargs)
        cfg.architectures = [self.model_class]
        return cfg


@dataclass(frozen=True)
class Leaf:
    """A unit of generation: one per-expert (or dense) tensor, named as on disk in split layout."""

    name: str
    shape: tuple
    init: Init

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class DiskTensor:
    """One tensor in the safetensors files: the concatenation of its leaves' bytes."""

    name: str
    shape: tuple
    role: str  # "expert" | "dense"
    leaves: tuple

    @property
    def nbytes(self) -> int:
        return 2 * math.prod(self.shape)


def routed_experts(config) -> tuple[int, int]:
    """(routed experts per layer, experts per token) of a config."""
    e = next(getattr(config, a) for a in ("num_local_experts", "n_routed_experts", "num_experts")
             if getattr(config, a, None))
    return int(e), int(getattr(config, "num_experts_per_tok", None) or 1)


def model_class(family: Family):
    import transformers

    return getattr(transformers, family.model_class)


def meta_parameters(family: Family, config) -> list[tuple[str, tuple]]:
    """(name, shape) of every parameter and persistent buffer, tied copies listed once."""
    from transformers.initialization import no_init_weights

    cls = model_class(family)
    with torch.device("meta"), no_init_weights():
        model = cls(config)
    # Tied copies (Switch: encoder/decoder embed_tokens and lm_head are shared.weight) are
    # written once, under the source name, as save_pretrained does.
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    out = [(n, tuple(p.shape)) for n, p in model.named_parameters() if n not in tied]
    seen = {n for n, _ in out} | tied
    all_params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    for n, t in model.state_dict().items():
        if n not in seen and n not in all_params:
            out.append((n, tuple(t.shape)))
    return out


_ROUTER = re.compile(r"\.(mlp|block_sparse_moe)\.gate\.weight$|\.router\.classifier\.weight$")
_RESIDUAL_OUT = ("o_proj.weight", "down_proj.weight", ".w2.weight", ".wo.weight", ".o.weight")


def num_layers(config) -> int:
    if getattr(config, "is_encoder_decoder", False):
        return config.num_layers + config.num_decoder_layers
    return config.num_hidden_layers


def init_for(name: str, shape: tuple, config, dist: str) -> Init:
    """The draw rule of one tensor, from its name and shape."""
    if name.endswith("embed_tokens.weight") or name == "shared.weight":
        return Init("embedding")
    if _ROUTER.search(name):
        return Init("router")
    if len(shape) == 1:
        if "norm" in name:
            return Init("norm")
        return Init("linear", std=0.02)
    if "relative_attention_bias" in name:
        return Init("linear", std=0.1)
    std = 1.0 / math.sqrt(shape[-1])
    if name.endswith(_RESIDUAL_OUT):
        std /= math.sqrt(2 * num_layers(config))
    return Init("linear", std=std, dist=dist)


def tensor_plan(family: Family, config, layout: str = "split", dist: str = "normal") -> list[DiskTensor]:
    """Every tensor of the checkpoint in file order, with the leaves it is drawn from."""
    if layout not in LAYOUTS:
        raise UsageError(f"unknown layout {layout!r}: use split or fused")
    if layout == "fused" and not family.fused:
        raise UsageError(f"{family.name} keeps one module per expert in transformers; it has no fused layout")
    params = meta_parameters(family, config)
    shapes = dict(params)
    plan: list[DiskTensor] = []
    projs = family.expert_projs
    for name, shape in params:
        if name.endswith("mlp.experts.down_proj") and name[: -len("down_proj")] + "gate_up_proj" in shapes:
            continue  # emitted together with gate_up_proj
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("experts.gate_up_proj")]  # "...mlp."
            disk_base = base[: -len("mlp.")] + family.moe_module + "."
            down_name = base + "experts.down_proj"
            e, two_i, h = shape
            i = two_i // 2
            d_shape = shapes[down_name]

            def leaf(ex: int, proj: str, shp: tuple) -> Leaf:
                n = f"{disk_base}experts.{ex}.{projs[proj]}.weight"
                return Leaf(n, shp, init_for(n, shp, config, dist))

            if layout == "split":
                for ex in range(e):
                    for proj, shp in (("gate", (i, h)), ("up", (i, h)), ("down", tuple(d_shape[1:]))):
                        lf = leaf(ex, proj, shp)
                        plan.append(DiskTensor(lf.name, shp, "expert", (lf,)))
            else:
                gu = tuple(leaf(ex, p, (i, h)) for ex in range(e) for p in ("gate", "up"))
                plan.append(DiskTensor(name, shape, "expert", gu))
                dn = tuple(leaf(ex, "down", tuple(d_shape[1:])) for ex in range(e))
                plan.append(DiskTensor(down_name, d_shape, "expert", dn))
            continue
        disk = name
        if family.moe_module != "mlp" and _ROUTER.search(name):
            disk = name.replace(".mlp.gate.", f".{family.moe_module}.gate.")
        # The router is seeded under its on-disk split name in both layouts.
        seed_name = name.replace(".mlp.gate.", f".{family.moe_module}.gate.") if _ROUTER.search(name) else name
        if layout == "fused":
            disk = name
        role = "expert" if ".experts." in name else "dense"
        lf = Leaf(seed_name, shape, init_for(name, shape, config, dist))
        plan.append(DiskTensor(disk, shape, role, (lf,)))
    return plan


def count_parameters(family: Family, config) -> int:
    return sum(math.prod(s) for _, s in meta_parameters(family, config))
