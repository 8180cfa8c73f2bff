"""Write one synthetic checkpoint: a Hugging Face folder that transformers loads offline.

Streams tensor by tensor (each drawn in chunks, written, dropped), so presets far larger than
memory can be written. Everything lands in a hidden temporary folder next to the output and is
renamed into place at the end: a crash or a full disk leaves no folder that looks complete.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from zipmoe.errors import OutOfSpaceError, UsageError, ZipmoeError
from zipmoe.units import format_size

from .registry import get_family
from .family import BOS_ID, EOS_ID, IM_END_ID, PAD_ID, DiskTensor, tensor_plan
from .shards import MAX_SHARD_BYTES, ShardWriter, index_json, plan_shards
from .tokenizer import save_tokenizer
from .weights import DISTRIBUTIONS, ROUTINGS, Context, entropy_bits, exponent_histogram, generate, natural_skew

#: Headroom on top of the tensor bytes for the free-space check (json, tokenizer, filesystem).
SPACE_MARGIN = 64 << 20


@dataclass
class SynthResult:
    path: Path
    family: str
    preset: str
    params: int
    nbytes: int
    files: list[str]
    seconds: float
    exp_hist: dict = field(default_factory=dict)  # role ("expert", "dense", "all") -> np.ndarray[256]
    tensor_entropy: float = 0.0  # byte-weighted mean of each tensor's own exponent entropy
    routing: str = "skewed"  # "natural" | "skewed"
    skew: float = 1.0  # the Zipf exponent used (solved for routing "natural")

    def entropy(self, role: str = "all") -> float:
        """Exponent-byte entropy (bits) of a sample of the written values: ``per_tensor`` (what
        a per-tensor codec sees; the 2.5-2.8 bits of trained models), or pooled over ``expert``,
        ``dense`` or ``all`` tensors (higher: pooling mixes tensors of different scales)."""
        if role == "per_tensor":
            return self.tensor_entropy
        return entropy_bits(self.exp_hist[role])


def _check_output(out_dir: Path, force: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError(f"{out_dir} exists and is not a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise UsageError(f"{out_dir} is not empty: choose another folder or pass --force to replace it")


def _existing_parent(path: Path) -> Path:
    p = path.resolve()
    while not p.exists():
        p = p.parent
    return p


def check_space(out_dir: Path, needed: int) -> None:
    """Refuse before writing when the disk cannot hold ``needed`` bytes."""
    free = shutil.disk_usage(_existing_parent(out_dir.parent)).free
    if needed > free:
        raise OutOfSpaceError(
            f"not enough disk space for {out_dir}: needs {format_size(needed)}, {format_size(free)} free"
        )


def _temp_dir(out_dir: Path) -> Path:
    return out_dir.parent / f".{out_dir.name}.zipmoe-synth-{os.getpid()}.tmp"


def finish(tmp: Path, out_dir: Path) -> None:
    """Move the finished temporary folder into place (replacing ``out_dir`` if it exists)."""
    old = None
    if out_dir.exists():
        old = out_dir.parent / f".{out_dir.name}.zipmoe-old-{os.getpid()}"
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    fd = os.open(out_dir.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def generation_config(config, family_name: str):
    from transformers import GenerationConfig

    if getattr(config, "is_encoder_decoder", False):
        return GenerationConfig(decoder_start_token_id=PAD_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    return GenerationConfig(bos_token_id=BOS_ID, eos_token_id=[EOS_ID, IM_END_ID], pad_token_id=PAD_ID)


def _cut_encoder_decoder(fam, config, preset: str, layers: int):
    """``--layers N`` of an encoder-decoder (SwitchTransformers): N encoder and N decoder layers,
    every tensor's shape kept, the sparse layers at the preset's own step (every other layer for
    the published models), so N layers hold N // step sparse layers on each side."""
    full = min(config.num_layers, config.num_decoder_layers)
    step_e, step_d = config.encoder_sparse_step, config.decoder_sparse_step
    step = max(step_e, step_d, 1)
    if not step <= layers <= full:
        raise UsageError(f"--layers must be between {step} (one sparse layer on each side) and {full} "
                         f"(the {preset} preset's layers), got {layers}")
    kw = config.to_dict()
    for k in ("encoder_sparse_step", "decoder_sparse_step", "transformers_version", "model_type", "architectures"):
        kw.pop(k, None)
    kw.update(num_layers=layers, num_decoder_layers=layers,
              num_sparse_encoder_layers=layers // step_e if config.num_sparse_encoder_layers else 0,
              num_sparse_decoder_layers=layers // step_d if config.num_sparse_decoder_layers else 0)
    cut = type(config)(**kw)
    if (cut.encoder_sparse_step, cut.decoder_sparse_step) != (step_e, step_d):
        raise UsageError(f"--layers {layers}: the sparse layers of {fam.name}/{preset} would move "
                         f"(every {step_e}/{step_d} layers); give a multiple of {step}")
    return cut


def write(
    family: str,
    out_dir,
    preset: str = "tiny",
    seed: int = 0,
    skew: float | None = None,
    layout: str = "split",
    dtype: str = "bf16",
    force: bool = False,
    *,
    routing: str | None = None,
    dist: str = "normal",
    max_shard_bytes: int = MAX_SHARD_BYTES,
    progress: bool = True,
    layers: int | None = None,
) -> SynthResult:
    """Write the synthetic checkpoint ``family``/``preset`` into ``out_dir``.

    ``routing`` is ``natural`` (the Zipf exponent that gives a trained model's per-layer
    selection entropy for this preset's expert count and top-k) or ``skewed`` (exponent
    ``skew``, default 1; 0 = uniform). Left out: ``skewed`` when ``skew`` is given or the
    preset is ``tiny``, else ``natural``. ``layout`` is ``split``
    (one tensor per expert and projection, the family's usual names) or ``fused``
    (transformers-5 ``mlp.experts.gate_up_proj`` / ``down_proj``); ``dist`` is ``normal`` or
    ``student-t`` (heavier tails). Same arguments, same bytes.
    """
    fam = get_family(family)
    fam.preset(preset)
    if dtype not in ("bf16", "bfloat16"):
        raise UsageError(f"unsupported dtype {dtype!r}: synthetic checkpoints are bf16")
    if dist not in DISTRIBUTIONS:
        raise UsageError(f"unknown distribution {dist!r}: use one of {', '.join(DISTRIBUTIONS)}")
    if routing is None:
        routing = "skewed" if skew is not None else fam.default_routing(preset)
    if routing not in ROUTINGS:
        raise UsageError(f"unknown routing {routing!r}: use natural or skewed")
    if routing == "natural" and skew is not None:
        raise UsageError("--skew sets the exponent of --routing skewed; --routing natural solves its own")
    if skew is None:
        skew = 1.0
    if not skew >= 0:
        raise UsageError(f"--skew must be 0 or more, got {skew}")
    if seed < 0:
        raise UsageError(f"--seed must be 0 or more, got {seed}")
    out_dir = Path(out_dir)
    _check_output(out_dir, force)

    config = fam.config(preset)
    if layers is not None and getattr(config, "is_encoder_decoder", False):
        config = _cut_encoder_decoder(fam, config, preset, int(layers))
    elif layers is not None:
        full = getattr(config, "num_hidden_layers", None)
        if not isinstance(full, int):
            raise UsageError(f"--layers: {fam.name} has no num_hidden_layers to cut")
        if not 1 <= int(layers) <= full:
            raise UsageError(f"--layers must be between 1 and {full} (the {preset} preset's layers), got {layers}")
        config.num_hidden_layers = int(layers)
        for key in ("layer_types", "mlp_only_layers"):  # per-layer lists follow the cut
            v = getattr(config, key, None)
            if isinstance(v, list) and key == "layer_types":
                setattr(config, key, v[:int(layers)])
            elif isinstance(v, list):
                setattr(config, key, [i for i in v if i < int(layers)])
    natural = None
    if routing == "natural":
        from .family import routed_experts

        experts, top_k = routed_experts(config)
        skew = natural_skew(experts, top_k, round(fam.natural_entropy, 6))
        natural = round(fam.natural_entropy * math.log2(experts), 4)
    plan: list[DiskTensor] = tensor_plan(fam, config, layout=layout, dist=dist)
    total = sum(t.nbytes for t in plan)
    check_space(out_dir, total + SPACE_MARGIN)

    config.dtype = "bfloat16"
    config.zipmoe_synth = {
        "note": "synthetic weights drawn by `zipmoe synth`: the shapes of a real model, not a trained one",
        "family": fam.name, "preset": preset, "seed": seed, "skew": skew, "layout": layout, "dist": dist,
    }
    if layers is not None:
        config.zipmoe_synth["layers"] = int(layers)
    if natural is not None:  # (the skewed block stays as it was, so old outputs keep their bytes)
        config.zipmoe_synth.update(routing="natural", target_entropy_bits=natural)
    hidden = getattr(config, "hidden_size", None) or config.d_model
    from .family import num_layers

    ctx = Context(seed=seed, hidden=hidden, skew=float(skew), num_layers=num_layers(config))
    shards = plan_shards([(t.name, "BF16", t.shape, t.nbytes) for t in plan], max_shard_bytes)
    by_name = {t.name: t for t in plan}
    hist = {r: np.zeros(256, dtype=np.int64) for r in ("expert", "dense", "all")}

    weighted = 0.0
    tmp = _temp_dir(out_dir)
    if tmp.exists():
        shutil.rmtree(tmp)
    t0 = time.perf_counter()
    bar = None
    try:
        tmp.mkdir(parents=True)
        config.save_pretrained(str(tmp))
        generation_config(config, fam.name).save_pretrained(str(tmp))
        save_tokenizer(tmp)
        (tmp / "README.md").write_text(_readme(fam.name, preset, seed, skew, layout, dist, config, natural))
        from tqdm.auto import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                   desc=f"{fam.name}/{preset}", disable=not progress, leave=False)
        for sp in shards:
            w = ShardWriter(tmp / sp.filename, sp)
            for name, *_ in sp.tensors:
                t = by_name[name]
                th = np.zeros(256, dtype=np.int64)
                for leaf in t.leaves:
                    for chunk in generate(leaf.name, leaf.shape, leaf.init, ctx):
                        w.write(chunk)
                        th += exponent_histogram(chunk, max(1, len(chunk) // 16384))
                        bar.update(2 * len(chunk))
                hist[t.role] += th
                weighted += t.nbytes * entropy_bits(th)
            w.close()
        hist["all"] = hist["expert"] + hist["dense"]
        if len(shards) > 1:
            (tmp / "model.safetensors.index.json").write_text(index_json(shards))
        bar.close()
        files = sorted(p.name for p in tmp.iterdir())
        finish(tmp, out_dir)
    except OSError as exc:
        if bar is not None:
            bar.close()
        shutil.rmtree(tmp, ignore_errors=True)
        if exc.errno == errno.ENOSPC:
            raise OutOfSpaceError(f"disk full while writing {out_dir} (needs {format_size(total)}); nothing was left behind") from exc
        raise ZipmoeError(f"cannot write {out_dir}: {exc.strerror or exc}") from exc
    except BaseException:
        if bar is not None:
            bar.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    params = total // 2
    return SynthResult(out_dir, fam.name, preset, params, total, files, time.perf_counter() - t0, hist,
                       weighted / max(total, 1), routing, skew)


def _readme(family, preset, seed, skew, layout, dist, config, natural=None) -> str:
    how = (f"--routing natural --layout {layout}` (Zipf exponent {skew}: a selection entropy of {natural} bits "
           "per layer in the idealised router)" if natural is not None else f"--skew {skew} --layout {layout}`")
    return (
        f"# Synthetic {family} checkpoint ({preset})\n\n"
        f"Written by `zipmoe synth {family} --preset {preset} --seed {seed} {how}"
        f" (weights: {dist}).\n\nThe shapes and names are those of the real model family; the weights are random,"
        " drawn with trained-like scales and a skewed router. It is not a trained model: its text is noise.\n"
    )
