"""The model's context length and its KV cache's size, from its config: one module for the
decode loop (what it allocates), the load-time memory check (``memlimit``) and the bench's
memory cgroups (set before the model is loaded, from config.json alone).

Every function takes a config object (``model.config``) or a config.json dict; nothing here
imports torch at module level (:func:`static_cache_bytes` imports transformers when called).

Per position, a decoder layer caches keys and values of ``num_key_value_heads`` heads of
``head_dim`` (``hidden_size // num_attention_heads`` when the config has none); DeepSeek's
multi-head latent attention caches its compressed latent instead (transformers 5: one head of
``kv_lora_rank`` as keys and one of ``qk_rope_head_dim`` as values); an encoder-decoder model's
decoder layer holds a self-attention and a cross-attention cache (``num_heads`` of ``d_kv``).
"""

from __future__ import annotations

__all__ = ["CHUNK", "chunked", "growth_peak", "kv_cache_bytes", "kv_cache_bytes_upper", "kv_shapes", "max_context", "plain_static",
           "static_cache_bytes"]

CHUNK = 256  # the positions a growing KV cache first takes (the decode loop's, the row batch's), doubling from there

_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def _get(cfg, key: str):
    return cfg.get(key) if isinstance(cfg, dict) else getattr(cfg, key, None)


def _text(cfg):
    """The decoder's (text) config of ``cfg``."""
    if isinstance(cfg, dict):
        return cfg.get("text_config") or cfg
    return cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg


def max_context(cfg) -> int | None:
    """The model's own limit on positions (``max_position_embeddings`` or what the config calls
    it), None when it has none."""
    t = _text(cfg)
    for key in _CONTEXT_KEYS:
        v = _get(t, key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def _int(v) -> int | None:
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else None


def kv_shapes(cfg) -> list[tuple[int, int, int]] | None:
    """``(heads, key dim, value dim)`` of every cache the model's decoder keeps per position (one
    per decoder layer; two, self- and cross-attention, per decoder layer of an encoder-decoder
    model); None when the config does not say."""
    t = _text(cfg)
    if _get(cfg, "is_encoder_decoder"):
        layers = _int(_get(t, "num_decoder_layers")) or _int(_get(t, "num_layers"))
        heads = _int(_get(t, "num_heads")) or _int(_get(t, "num_attention_heads"))
        if not layers or not heads:
            return None
        hidden = _int(_get(t, "d_model")) or _int(_get(t, "hidden_size")) or 0
        hd = _int(_get(t, "d_kv")) or hidden // heads
        return [(heads, hd, hd)] * (2 * layers)
    layers = _int(_get(t, "num_hidden_layers")) or _int(_get(t, "num_layers"))
    heads = _int(_get(t, "num_attention_heads"))
    if not layers or not heads:
        return None
    if _get(t, "kv_lora_rank") and _get(t, "qk_rope_head_dim"):  # DeepSeek MLA: the latent and the rotary key
        return [(1, int(_get(t, "kv_lora_rank")), int(_get(t, "qk_rope_head_dim")))] * layers
    kv = _int(_get(t, "num_key_value_heads")) or heads
    hd = _int(_get(t, "head_dim")) or (int(_get(t, "hidden_size")) // heads)
    return [(kv, hd, hd)] * layers


def kv_cache_bytes(cfg, *, context: int, itemsize: int, batch: int = 1, clamp: bool = True,
                   lengths: list[int] | None = None) -> int:
    """Bytes of keys and values for ``batch`` rows of ``context`` positions (clamped to the
    model's limit unless ``clamp`` is False) in every cache :func:`kv_shapes` names; ``lengths``:
    the positions each layer holds instead (a sliding-window layer's window). 0 when the config
    does not say."""
    shapes = kv_shapes(cfg)
    if not shapes:
        return 0
    limit = max_context(cfg) if clamp else None
    n = min(int(context), limit) if limit else int(context)
    lengths = list(lengths) if lengths is not None else [n] * len(shapes)
    return sum(int(batch) * heads * int(length) * (kd + vd) * int(itemsize)
               for (heads, kd, vd), length in zip(shapes, lengths))


def kv_cache_bytes_upper(cfg, *, batch: int, context: int, itemsize: int, clamp: bool = True) -> int:
    """The decode loop's KV cache for ``batch`` rows of ``context`` positions, from config.json
    alone (the bench's memory cgroups): an upper bound, sliding-window layers counted at the
    full context; 0 for encoder-decoder models (the decode loop does not serve them).
    ``clamp``: ``context`` clamped to the model's limit (False: a growth's peak, which counts two
    caches' positions)."""
    if _get(cfg, "is_encoder_decoder"):
        return 0
    return kv_cache_bytes(cfg, batch=batch, context=context, itemsize=itemsize, clamp=clamp)


def static_cache_bytes(config, *, batch: int, context: int, itemsize: int) -> int:
    """Exactly what a transformers ``StaticCache`` of ``context`` positions allocates for
    ``batch`` rows of this decoder-only model (a sliding-window layer holds its window only)."""
    from transformers import StaticCache

    cache = StaticCache(config=config, max_cache_len=int(context))
    return kv_cache_bytes(config, batch=batch, context=context, itemsize=itemsize, clamp=False,
                          lengths=[int(layer.max_cache_len) for layer in cache.layers])


def chunked(n: int, first: int, limit: int) -> int:
    """The smallest of ``first``, 2·first, 4·first, ... that holds ``n``, at most ``limit``: the
    size a growing cache takes (columns from :data:`CHUNK`, the row batch's slots from 1)."""
    v = max(1, int(first))
    while v < n:
        v *= 2
    return min(v, int(limit))


def growth_peak(context: int, first: int = CHUNK) -> int:
    """Positions a cache growing by doublings of ``first`` up to ``context`` holds at its most:
    during its last growth the old cache (the largest doubling below ``context``) and the new one
    (``context``) are both alive while the positions are copied."""
    context = int(context)
    before = 0
    v = max(1, int(first))
    while v < context:
        before = v
        v *= 2
    return context + before


def plain_static(config) -> bool:
    """Whether this decoder-only model's ``StaticCache`` is plain ``StaticLayer``s of the shapes
    :func:`kv_shapes` gives (no sliding windows, no other layer kinds): a cache zipmoe can lay out,
    grow and copy itself (the decode loop's growing cache, the row batch)."""
    from transformers import StaticCache

    shapes = kv_shapes(config)
    if shapes is None or _get(config, "is_encoder_decoder"):
        return False
    cache = StaticCache(config=config, max_cache_len=2)
    return len(shapes) == len(cache.layers) and all(type(layer).__name__ == "StaticLayer" for layer in cache.layers)
