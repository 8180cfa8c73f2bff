"""What differs between the transformers 5 releases zipmoe supports (``transformers>=5.0,<5.25``:
up to the newest release CI tests).

Since 5.2x a model's forward (and ``generate``'s model keywords) take the KV cache as
``cache=``; earlier 5.x releases (5.17, the GPU box's) take ``past_key_values=``, which the newer
ones still accept with a deprecation warning until its removal. :func:`cache_kw` gives the
keyword this model's forward takes, so the decode loop, the CUDA graphs and the tests pass the
same cache object under the right name on either.

A ``StaticCache`` is cropped with ``cache.crop(-n)`` since 5.2x (each ``StaticLayer`` moves its
``cumulative_length`` back; the stale positions are overwritten by the next update); 5.17's
``StaticLayer`` has the same ``cumulative_length`` but no ``crop``. :func:`crop` does the same
on either.

``generate`` with a compileable (static) cache on CUDA compiles the model's forward by itself
(``generation_config.disable_compile`` turns that off): compiled kernels are not the kernels
zipmoe computes with, so the tests' transformers references pass :data:`NO_AUTO_COMPILE`.
"""

from __future__ import annotations

import inspect
from functools import lru_cache

__all__ = ["cache_kw", "crop", "NO_AUTO_COMPILE"]

NO_AUTO_COMPILE = {"disable_compile": True}


@lru_cache(maxsize=None)
def _kw_of(forward_cls: type) -> str:
    params = inspect.signature(forward_cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_kw(model) -> str:
    """``"cache"`` or ``"past_key_values"``: the keyword ``model``'s forward takes the KV cache by."""
    return _kw_of(type(model))


def crop(cache, tokens: int) -> None:
    """Drop the last ``tokens`` positions of ``cache`` (a ``StaticCache`` or a dynamic one), in place."""
    if tokens <= 0:
        return
    if hasattr(cache, "layers") and any(not hasattr(layer, "crop") for layer in cache.layers):
        for layer in cache.layers:  # 5.17's StaticLayer: what 5.2x's StaticLayer.crop does
            if getattr(layer, "is_initialized", False):
                layer.cumulative_length.sub_(tokens)
        return
    cache.crop(-tokens)
