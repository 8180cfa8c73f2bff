"""The KV cache's size from a model's config.json alone (no torch): for the bench's memory
cgroups, which are set before the model is loaded. An upper bound: sliding-window layers are
counted at the full context (the decode loop's own ``kv_bytes`` is what it allocated)."""

from __future__ import annotations

__all__ = ["kv_cache_bytes_upper", "effective_context"]


def _text(cfg: dict) -> dict:
    return cfg.get("text_config") or cfg


def effective_context(cfg: dict, context: int) -> int:
    """``context`` clamped to the model's ``max_position_embeddings`` (when it has one)."""
    limit = _text(cfg).get("max_position_embeddings")
    return min(int(context), int(limit)) if isinstance(limit, int) and limit > 0 else int(context)


def kv_cache_bytes_upper(cfg: dict, *, batch: int, context: int, itemsize: int) -> int:
    """Bytes of keys and values for ``batch`` rows of ``context`` positions in every decoder
    layer; 0 for encoder-decoder models (the decode loop does not serve them)."""
    if cfg.get("is_encoder_decoder"):
        return 0
    t = _text(cfg)
    layers = t.get("num_hidden_layers")
    heads = t.get("num_attention_heads")
    if not isinstance(layers, int) or not isinstance(heads, int) or heads <= 0:
        return 0
    if t.get("kv_lora_rank") and t.get("qk_rope_head_dim"):  # DeepSeek MLA: the latent and the rotary key
        per_token = int(t["kv_lora_rank"]) + int(t["qk_rope_head_dim"])
    else:
        kv = t.get("num_key_value_heads") or heads
        hd = t.get("head_dim") or (int(t["hidden_size"]) // heads)
        per_token = 2 * int(kv) * int(hd)
    return int(batch) * effective_context(cfg, context) * int(layers) * per_token * int(itemsize)
