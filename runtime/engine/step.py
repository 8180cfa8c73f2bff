"""The decode step's one forward: what :class:`~zipmoe.runtime.engine.loop.DecodeLoop` runs eagerly
and what :class:`~zipmoe.runtime.engine.graphs.GraphedStep` captures, the same call with the same
arguments, so that a step's bits cannot depend on whether it replayed from a graph.

A step feeds one new token per row at ``position_ids`` over a transformers ``StaticCache`` of
``context`` positions, with the attention mask in its static form ``[batch, context]``
(:func:`static_mask`: 1 for every position written so far and the new one); transformers builds
the same 4-D mask from it as from the ``[batch, seen]`` mask ``generate`` passes (it pads that
with zeros to the cache's length itself, ``prepare_padding_mask``), and a graph can replay it
(its shape never changes). ``logits_to_keep=1``, as ``generate`` asks.

The attention kernels are part of the step (:func:`attention_kernels`): on CUDA with
``attention="reproducible"`` (``EngineSettings``' default) ``scaled_dot_product_attention`` may
use the flash, memory-efficient or math kernel, not cuDNN's, which PyTorch prefers on Hopper and
itself calls non-deterministic (it refuses it under ``torch.use_deterministic_algorithms``):
over a long static cache the same step then rounded differently from run to run on the H200
(docs/benchmarks.md §21, §23). A graph captures the kernels chosen inside the context, so
eager and graphed steps run the same ones; a reference computed by transformers for a
comparison runs inside the same context (``with attention_kernels("reproducible", device):``).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from zipmoe.runtime.engine.hf_compat import cache_kw
from zipmoe.runtime.engine.settings import check_attention

__all__ = ["forward", "static_mask", "attention_kernels", "attention_of"]


def attention_of(model) -> str:
    """The attention choice of ``model``: its runtime's ``EngineSettings.attention``, or
    ``reproducible`` for a model that is not a zipmoe model (a reference)."""
    return getattr(getattr(getattr(model, "zipmoe", None), "settings", None), "attention", "reproducible")


def attention_kernels(attention: str, device):
    """The context a step's attention runs in: ``reproducible`` on CUDA restricts
    ``scaled_dot_product_attention`` to its flash, memory-efficient and math kernels (PyTorch's
    order among them); ``pytorch``, or any other device, leaves PyTorch's choice alone."""
    if check_attention(attention) == "pytorch" or torch.device(device).type != "cuda":
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def static_mask(attention_mask, position_ids, context: int) -> torch.Tensor:
    """A step's mask as ``[batch, context]`` int64.

    ``attention_mask``: None (no padding: every position up to ``position_ids``) or the
    ``[batch, kv_length]`` mask of every position so far, the new one included.
    ``position_ids``: ``[batch, 1]``."""
    b = position_ids.shape[0]
    if attention_mask is None:
        ar = torch.arange(context, device=position_ids.device)[None]
        return (ar <= position_ids.reshape(b, -1)[:, -1:]).to(torch.int64)
    n = attention_mask.shape[-1]
    if n > context:
        raise ValueError(f"attention_mask has {n} positions; the static cache holds {context}")
    out = torch.zeros((b, context), dtype=torch.int64, device=attention_mask.device)
    out[:, :n] = attention_mask
    return out


def forward(model, cache, input_ids, position_ids, attention_mask, keep_last: bool = True,
            attention: str = "reproducible") -> torch.Tensor:
    """One forward over ``cache``: ``[batch, n]`` ids at ``position_ids`` -> ``[batch, vocab]``
    logits of the last position (model dtype). ``keep_last``: pass ``logits_to_keep=1`` (models
    whose forward takes it). ``attention``: :func:`attention_kernels`."""
    kw = {"logits_to_keep": 1} if keep_last else {}
    with attention_kernels(attention, input_ids.device):
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True,
                    **{cache_kw(model): cache}, **kw)
    return out.logits[:, -1]
