"""Where transformers hands the router's choice to the runtime.

* Fused families: :func:`zipmoe_experts_forward` is registered as ``"zipmoe"`` in
  transformers' ``ALL_EXPERTS_FUNCTIONS`` (``integrations/moe.py``); the loader builds the
  model with ``experts_implementation="zipmoe"``. It is transformers' eager experts loop op for
  op (one_hot mask, experts hit in ascending order, ``F.linear`` with the [2I, H] gate_up
  weight, ``chunk(2)``, ``act_fn(gate) * up``, ``F.linear`` with the [H, I] down weight, times
  the routing weight, ``index_add_``), except that the weights come from the runtime and that
  the experts are computed as their weights become whole; the ``index_add_`` calls still happen
  in ascending expert order, after all experts have computed, so the sums are the eager sums.
* SwitchTransformers: :class:`SwitchExperts` replaces each ``SwitchTransformersExperts``
  module (a ModuleDict of ``DenseActDense``), computing what its forward computes.

Both read the runtime from ``module._zipmoe_runtime`` and the layer from ``module._zipmoe_layer``
(set by the loader).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["zipmoe_experts_forward", "register", "SwitchExperts", "IMPLEMENTATION"]

IMPLEMENTATION = "zipmoe"


def zipmoe_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor) -> torch.Tensor:
    rt = self._zipmoe_runtime
    layer = self._zipmoe_layer
    num_experts = self.num_experts
    final_hidden_states = torch.zeros_like(hidden_states)
    with torch.no_grad():
        expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=num_experts + 1)
        expert_mask = expert_mask.permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    experts = [e for e in expert_hit[:, 0].tolist() if e != num_experts]
    outputs: dict[int, tuple] = {}
    act_fn = self.act_fn

    grad = torch.is_grad_enabled()

    def compute(expert_idx: int, weights) -> None:
        gate_up, down = _as_reference(weights, grad)
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
        current_state = hidden_states[token_idx]
        gate, up = nn.functional.linear(current_state, gate_up).chunk(2, dim=-1)
        current_hidden_states = act_fn(gate) * up
        current_hidden_states = nn.functional.linear(current_hidden_states, down)
        current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
        outputs[expert_idx] = (token_idx, current_hidden_states)

    rt.run_layer(layer, experts, compute, trace_ids=lambda: top_k_index.tolist())
    for expert_idx in experts:  # ascending: the eager accumulation order
        token_idx, current_hidden_states = outputs.pop(expert_idx)
        final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))
    return final_hidden_states


def _as_reference(weights, grad: bool):
    """The weights with the autograd flag the eager reference's weights would have.

    In transformers the expert weight is a view of a Parameter: it requires grad exactly when
    grad mode is on. aten's linear chooses its kernel path partly by that flag, so ours must
    match (under ``torch.no_grad()``, as in ``generate``, it is off). With grad mode on, the
    outputs keep the expert weights alive as long as the autograd graph lives: serve under
    ``torch.no_grad()`` (or ``inference_mode``) to stay inside the budget.
    """
    out = []
    for w in weights:
        if grad and w.is_inference():  # cached under torch.inference_mode(), used with grad on
            w = w.clone()
        if w.requires_grad != grad and w.is_leaf:
            w.requires_grad_(grad)
        out.append(w)
    return out


def register() -> None:
    """Register the runtime's experts function with transformers (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

    if IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ExpertsInterface.register(IMPLEMENTATION, zipmoe_experts_forward)


class SwitchExperts(nn.Module):
    """Stands in for ``SwitchTransformersExperts``: same forward, weights from the runtime."""

    def __init__(self, runtime, layer: int, num_experts: int, hidden_size: int, act, dropout_p: float) -> None:
        super().__init__()
        self._zipmoe_runtime = runtime
        self._zipmoe_layer = layer
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.act = act
        self.dropout = nn.Dropout(dropout_p)

    def extra_repr(self) -> str:
        return f"layer={self._zipmoe_layer}, num_experts={self.num_experts} (served by zipmoe)"

    def _dense_act_dense(self, hidden_states, wi, wo):
        # SwitchTransformersDenseActDense.forward with nn.Linear(bias=False) as F.linear
        hidden_states = F.linear(hidden_states, wi)
        hidden_states = self.act(hidden_states)
        hidden_states = self.dropout(hidden_states)
        if hidden_states.dtype != wo.dtype and wo.dtype != torch.int8:
            hidden_states = hidden_states.to(wo.dtype)
        return F.linear(hidden_states, wo)

    def forward(self, hidden_states: torch.Tensor, selected_experts: torch.Tensor,
                routing_weights: torch.Tensor) -> torch.Tensor:
        final_hidden_states = torch.zeros_like(hidden_states)
        expert_mask = selected_experts.permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        experts = expert_hit[:, 0].tolist()
        outputs: dict[int, tuple] = {}

        grad = torch.is_grad_enabled()

        def compute(e: int, weights) -> None:
            wi, wo = _as_reference(weights, grad)
            idx, top_x = torch.where(expert_mask[e])
            current_state = hidden_states[None, top_x].reshape(-1, hidden_states.shape[-1])
            current_hidden_states = self._dense_act_dense(current_state, wi, wo) * routing_weights[top_x, idx, None]
            outputs[e] = (top_x, current_hidden_states)

        def trace_ids():
            m = selected_experts.reshape(selected_experts.shape[0], -1)
            return [row.nonzero()[:, 0].tolist() for row in m]

        self._zipmoe_runtime.run_layer(self._zipmoe_layer, experts, compute, trace_ids=trace_ids)
        for e in experts:
            top_x, current_hidden_states = outputs.pop(e)
            final_hidden_states.index_add_(0, top_x, current_hidden_states.to(hidden_states.dtype))
        return final_hidden_states
