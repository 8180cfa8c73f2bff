"""Where transformers hands the router's choice to the runtime.

* Fused families: :func:`zipmoe_experts_forward` is registered as ``"zipmoe"`` in
  transformers' ``ALL_EXPERTS_FUNCTIONS`` (``integrations/moe.py``); the loader builds the
  model with ``experts_implementation="zipmoe"``. It computes what transformers' eager experts
  loop computes, float op for float op (experts hit in ascending order, ``F.linear`` with the
  [2I, H] gate_up weight, ``chunk(2)``, ``act_fn(gate) * up``, ``F.linear`` with the [H, I]
  down weight, times the routing weight, ``index_add_``), except that the weights come from the
  runtime and that the experts are computed as their weights become whole; the ``index_add_``
  calls still happen in ascending expert order, after all experts have computed, so the sums
  are the eager sums.
* SwitchTransformers: :class:`SwitchExperts` replaces each ``SwitchTransformersExperts``
  module (a ModuleDict of ``DenseActDense``), computing what its forward computes.

Both read the runtime from ``module._zipmoe_runtime`` and the layer from ``module._zipmoe_layer``
(set by the loader). The math of one expert is :mod:`.expert_math`'s, shared with the CUDA graphs.
While the runtime is intercepting experts calls (``Runtime.intercepted``: a CUDA graph capture
ends a piece there), :func:`zipmoe_experts_forward` hands the call to the interceptor;
:func:`experts_host_path` is the computation itself.

Which tokens each expert gets is worked out on the host, not the device. The eager loop builds
a one_hot mask on the device and calls ``torch.where(expert_mask[e])`` per hit expert: a
``nonzero``, so one device->host synchronisation per expert, on top of the one per layer for
the hit list (an H200 profile showed about 0.38 ms per expert per token in the old function,
~48 ms per olmoe token; not re-measured on a GPU since). Here the router's choice (``tokens x
top_k`` ids, or Switch's ``tokens x 1 x E`` mask) comes to the host once per layer (the one
sync the runtime needs anyway, to know which experts to fetch);
:func:`routed_indices` / :func:`switch_indices` give every hit expert's ``(top_k_pos,
token_idx)`` in the order ``torch.where`` gives them (top_k position first, then token), packed
in one int64 [2, n] tensor that goes to the device in one non-blocking copy (from pinned
memory) and is split per expert. Same index values, so the gathers, the routing weights and
``index_add_`` see the same tensors and the outputs stay bit-identical; per layer the device
syncs go from 1 + (experts hit) to 1. On the CPU the host copy is the tensor itself.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from zipmoe.runtime.engine.expert_math import accumulate, expert_output

__all__ = ["zipmoe_experts_forward", "experts_host_path", "register", "SwitchExperts", "IMPLEMENTATION",
           "routed_indices", "switch_indices", "per_expert", "FAST_IMPLEMENTATION", "zipmoe_grouped_mm_forward"]

IMPLEMENTATION = "zipmoe"
# ``kernels="fast"`` (``--kernels fast``): transformers' own grouped_mm experts function over the
# layer's experts as they sit in the full pool's slot tensor (engine/slots.py); bit-identical to
# transformers with ``experts_implementation="grouped_mm"``, not to the eager loop
FAST_IMPLEMENTATION = "zipmoe_grouped_mm"


def routed_indices(top_k_index: torch.Tensor, num_experts: int, pin_memory: bool = False):
    """Every hit expert's ``torch.where(expert_mask[e])``, computed from host ids without a mask.

    ``top_k_index``: the router's [tokens, top_k] expert ids on the CPU (the value
    ``num_experts`` means no expert, as in the eager loop's ``num_experts + 1`` one_hot).
    Returns ``(experts, index, sizes)``: the experts hit, ascending; an int64 [2, n] tensor,
    row 0 the top_k positions and row 1 the tokens (pinned when ``pin_memory``), the experts'
    columns one after the other; and how many columns each expert has. :func:`per_expert`
    cuts it up: expert ``e``'s pair equals ``torch.where(expert_mask[e])`` with the eager mask
    (``one_hot(top_k_index, num_experts + 1).permute(2, 1, 0)``, [E + 1, top_k, tokens]).
    Numpy, not torch: on tensors this small torch's per-op overhead is most of the cost.
    """
    tokens = top_k_index.shape[0]
    # column-major: element i is (top_k_pos, token) = divmod(i, tokens), the row-major order of
    # expert_mask[e]; a stable sort by expert keeps that order within every expert
    flat = top_k_index.numpy().T.ravel()
    if flat.size and (flat.min() < 0 or flat.max() > num_experts):
        raise ValueError(f"expert ids must lie in [0, {num_experts}], got {flat.min()}..{flat.max()}")
    counts = np.bincount(flat, minlength=num_experts + 1)
    hit = np.flatnonzero(counts[:num_experts])
    n = flat.size - int(counts[num_experts])  # the no-expert slot sorts last: leave it out
    index = torch.empty((2, n), dtype=torch.int64, pin_memory=pin_memory)
    if n:
        order = np.argsort(flat, kind="stable")[:n]
        out = index.numpy()
        np.divmod(order, tokens, out=(out[0], out[1]))
    return hit.tolist(), index, counts[hit].tolist()


def switch_indices(selected_experts: torch.Tensor, pin_memory: bool = False):
    """:func:`routed_indices` for SwitchTransformers' mask (``selected_experts``: [tokens, k, E] on the CPU).

    The experts hit are those whose mask sums above 0 (the eager ``expert_hit``); expert
    ``e``'s pair equals ``torch.where(selected_experts.permute(2, 1, 0)[e])``.
    """
    mask = selected_experts.numpy().transpose(2, 1, 0)
    num_experts = mask.shape[0]
    hit = np.flatnonzero(mask.sum(axis=(1, 2)) > 0)
    e, k, tok = np.nonzero(mask)  # lexicographic (e, k, token): per expert, torch.where's order
    counts = np.bincount(e, minlength=num_experts)
    keep = np.isin(e, hit)  # (entries of experts whose mask sums to 0 or less: none for a 0/1 mask)
    index = torch.empty((2, int(keep.sum())), dtype=torch.int64, pin_memory=pin_memory)
    out = index.numpy()
    out[0] = k[keep]
    out[1] = tok[keep]
    return hit.tolist(), index, counts[hit].tolist()


def per_expert(experts: list, index: torch.Tensor, sizes: list) -> dict:
    """``{expert: (row 0 part, row 1 part)}``: views of ``index`` cut by ``sizes`` (two split calls)."""
    if not experts:
        return {}
    return dict(zip(experts, zip(index[0].split_with_sizes(sizes), index[1].split_with_sizes(sizes))))


def _host_and_device(t: torch.Tensor, device: torch.device):
    """``t`` on the host (one sync on an accelerator; ``t`` itself on the CPU) and whether to pin."""
    if device.type == "cpu":
        return t, False
    return t.to("cpu"), device.type == "cuda"


def _to(index: torch.Tensor, device: torch.device) -> torch.Tensor:
    return index if device.type == "cpu" else index.to(device, non_blocking=True)


def zipmoe_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts module's forward (registered with transformers as ``"zipmoe"``)."""
    intercept = self._zipmoe_runtime.intercept
    if intercept is not None:  # a CUDA graph capture ends a piece here (engine/graphs.py)
        return intercept(self, hidden_states, top_k_index, top_k_weights)
    return experts_host_path(self, hidden_states, top_k_index, top_k_weights)


def experts_host_path(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                      top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts of one sparse block on the host path: the routing to the host, the chosen
    experts fetched by the runtime and computed as they become whole, added in ascending id."""
    rt = self._zipmoe_runtime
    layer = self._zipmoe_layer
    final_hidden_states = torch.zeros_like(hidden_states)
    device = hidden_states.device
    ids, pin = _host_and_device(top_k_index, device)  # the layer's one device sync
    experts, index, sizes = routed_indices(ids, self.num_experts, pin)
    parts = per_expert(experts, _to(index, device), sizes)  # one copy, then views
    outputs: dict[int, tuple] = {}
    act_fn = self.act_fn

    grad = torch.is_grad_enabled()

    def compute(expert_idx: int, weights) -> None:
        gate_up, down = _as_reference(weights, grad)
        top_k_pos, token_idx = parts[expert_idx]  # torch.where(expert_mask[expert_idx])
        outputs[expert_idx] = (token_idx, expert_output(hidden_states, token_idx, top_k_pos, gate_up, down, act_fn,
                                                        top_k_weights))

    rt.run_layer(layer, experts, compute, trace_ids=lambda: ids.tolist(), hidden=hidden_states)
    for expert_idx in experts:  # ascending: the eager accumulation order
        token_idx, current_hidden_states = outputs.pop(expert_idx)
        accumulate(final_hidden_states, token_idx, current_hidden_states)
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


class _LayerWeights:
    """The experts module with its (meta) weights replaced by the layer's slot views."""

    def __init__(self, module, gate_up, down) -> None:
        self._module = module
        self.gate_up_proj = gate_up
        self.down_proj = down

    def __getattr__(self, name):
        return getattr(self._module, name)


def zipmoe_grouped_mm_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                              top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' ``grouped_mm_experts_forward`` with the layer's [E, 2I, H] and [E, H, I]
    weights read from the full pool's slots (every expert resident: ``kernels="fast"`` loads so)."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    gate_up, down = self._zipmoe_runtime.slots.layer_views(self._zipmoe_layer)
    return grouped_mm_experts_forward(_LayerWeights(self, gate_up, down), hidden_states, top_k_index, top_k_weights)


def register() -> None:
    """Register the runtime's experts functions with transformers (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

    if IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ExpertsInterface.register(IMPLEMENTATION, zipmoe_experts_forward)
    if FAST_IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ExpertsInterface.register(FAST_IMPLEMENTATION, zipmoe_grouped_mm_forward)


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
        device = hidden_states.device
        selected, pin = _host_and_device(selected_experts, device)  # the layer's one device sync
        experts, index, sizes = switch_indices(selected, pin)
        parts = per_expert(experts, _to(index, device), sizes)
        outputs: dict[int, tuple] = {}

        grad = torch.is_grad_enabled()

        def compute(e: int, weights) -> None:
            wi, wo = _as_reference(weights, grad)
            idx, top_x = parts[e]  # torch.where(expert_mask[e])
            current_state = hidden_states[None, top_x].reshape(-1, hidden_states.shape[-1])
            current_hidden_states = self._dense_act_dense(current_state, wi, wo) * routing_weights[top_x, idx, None]
            outputs[e] = (top_x, current_hidden_states)

        def trace_ids():
            m = selected.reshape(selected.shape[0], -1)
            return [row.nonzero()[:, 0].tolist() for row in m]

        self._zipmoe_runtime.run_layer(self._zipmoe_layer, experts, compute, trace_ids=trace_ids, hidden=hidden_states)
        for e in experts:
            top_x, current_hidden_states = outputs.pop(e)
            final_hidden_states.index_add_(0, top_x, current_hidden_states.to(hidden_states.dtype))
        return final_hidden_states
