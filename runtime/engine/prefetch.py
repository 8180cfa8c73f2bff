"""Which experts the next sparse layer will choose, guessed while this layer computes.

When layer L's router has chosen, :class:`RouterPredictor` applies the router of the next sparse
layer L' to layer L's expert input (the hidden state its router saw), takes the top-k per token
and returns the union: the experts L' will probably choose. This is the cheap predictor of
Pre-gated MoE / mixtral-offloading / Fate: the real input of L''s router is L''s own
post-attention hidden state, which does not exist yet; consecutive layers' hidden states are
close (the residual stream changes little per layer), so L''s gate on L's input agrees with
L''s real choice for most tokens. The counters measure how often (``prediction_by_layer``:
precision and recall per layer).

The fetcher reads and decodes the predicted experts that are not whole in the cache at a
lower priority than the layer's own fetches, in window slots the budget already counts
(:mod:`.fetcher`). Predictions only move bytes: the layer computes with what its router chose,
from fetches whose bytes were checked as any fetch's; a predicted expert that is not chosen is
dropped unused (its errors too), one that is chosen is used as if fetched on demand.

Routers found per family (the sparse block's ``gate`` or ``router``): a 2-D weight
``[num_experts, hidden]`` (``gate.weight``; Switch: ``router.classifier.weight``). Softmax,
normalisation and group-limited routing (DeepSeek-V2's ``group_limited_greedy``) are left out:
they do not change a plain top-k by logits (softmax is monotone), and where they would the
prediction is only a little worse.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

__all__ = ["RouterPredictor", "find_router"]


def find_router(experts_module_name: str, model, num_experts: int):
    """The router weight ``[num_experts, hidden]`` of the sparse block holding this experts module, or None."""
    parent_name = experts_module_name.rpartition(".")[0]
    try:
        parent = model.get_submodule(parent_name) if parent_name else model
    except AttributeError:
        return None
    for attr in ("gate", "router"):
        m = getattr(parent, attr, None)
        if m is None:
            continue
        for w in (getattr(m, "weight", None), getattr(getattr(m, "classifier", None), "weight", None)):
            if isinstance(w, torch.Tensor) and w.dim() == 2 and w.shape[0] == num_experts and w.device.type != "meta":
                return w
    return None


class RouterPredictor:
    """``predict(layer, hidden) -> (next layer, experts)`` from the next sparse layer's router."""

    def __init__(self, routers: dict, order: list, top_k: int) -> None:
        self.routers = dict(routers)  # layer -> weight [E, H]
        self.order = list(order)  # sparse layers in the order a forward step runs them
        self.top_k = max(1, int(top_k))
        self._next = {a: b for a, b in zip(self.order, self.order[1:])}

    def next_layer(self, layer):
        return self._next.get(layer)

    @torch.no_grad()
    def predict(self, layer, hidden: torch.Tensor):
        nxt = self._next.get(layer)
        w = self.routers.get(nxt)
        if nxt is None or w is None or hidden is None:
            return None, []
        h = hidden.reshape(-1, hidden.shape[-1])
        if h.shape[-1] != w.shape[1]:
            return None, []
        logits = F.linear(h.to(w.dtype), w)
        k = min(self.top_k, logits.shape[-1])
        ids = torch.topk(logits, k, dim=-1).indices
        return nxt, sorted(set(ids.reshape(-1).tolist()))
