"""What differs between the transformers 5 releases zipmoe supports (``transformers>=5.0,<6``).

Since 5.2x a model's forward (and ``generate``'s model keywords) take the KV cache as
``cache=``; earlier 5.x releases (5.17, the GPU box's) take ``past_key_values=``, which the newer
ones still accept with a deprecation warning until its removal. :func:`cache_kw` gives the
keyword this model's forward takes, so the decode loop, the CUDA graphs and the tests pass the
same cache object under the right name on either.
"""

from __future__ import annotations

import inspect
from functools import lru_cache

__all__ = ["cache_kw"]


@lru_cache(maxsize=None)
def _kw_of(forward_cls: type) -> str:
    params = inspect.signature(forward_cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_kw(model) -> str:
    """``"cache"`` or ``"past_key_values"``: the keyword ``model``'s forward takes the KV cache by."""
    return _kw_of(type(model))
