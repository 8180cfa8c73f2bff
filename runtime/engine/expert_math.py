"""One expert of transformers' eager experts loop, op for op: the only place zipmoe computes it.

transformers' eager ``experts.forward`` (fused families, e.g. ``Qwen2MoeExperts``) computes, for
each hit expert in ascending id::

    current_state = hidden_states[token_idx]
    gate, up = nn.functional.linear(current_state, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
    current_hidden_states = self.act_fn(gate) * up
    current_hidden_states = nn.functional.linear(current_hidden_states, self.down_proj[expert_idx])
    current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
    final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))

:func:`expert_output` is the first five lines (:func:`expert_rows` the same once the caller
has gathered the expert's rows and routing weights), :func:`accumulate` the last. The experts hook
(the host path, weights from the cache or a fetch) and the CUDA graphs (batch 1 and batch > 1,
weights gathered from the full pool's slots) both call these two functions, so that the bits
of a sparse block cannot depend on which path computed it. The weights must be laid out as
transformers' are: a contiguous ``[2I, H]`` and ``[H, I]`` tensor each (a view of a larger
buffer is fine; cuBLAS sees the same shapes and strides).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

__all__ = ["expert_output", "expert_rows", "accumulate"]


def expert_output(hidden_states: torch.Tensor, token_idx: torch.Tensor, top_k_pos: torch.Tensor,
                  gate_up: torch.Tensor, down: torch.Tensor, act_fn, top_k_weights: torch.Tensor) -> torch.Tensor:
    """The routed, weighted output of one expert for the tokens ``token_idx`` (its rows of the
    layer's output, before they are added in)."""
    return expert_rows(hidden_states[token_idx], gate_up, down, act_fn, top_k_weights[token_idx, top_k_pos, None])


def expert_rows(current_state: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act_fn,
                coef: torch.Tensor) -> torch.Tensor:
    """:func:`expert_output` once its two gathers are done: ``current_state`` the expert's
    ``[m, H]`` rows of the hidden states, ``coef`` their ``[m, 1]`` routing weights (exact copies
    however they were gathered: a contiguous ``[m, H]`` block, 256-byte aligned, is what cuBLAS
    sees in the eager loop too)."""
    gate, up = F.linear(current_state, gate_up).chunk(2, dim=-1)
    current_hidden_states = act_fn(gate) * up
    current_hidden_states = F.linear(current_hidden_states, down)
    return current_hidden_states * coef


def accumulate(final_hidden_states: torch.Tensor, token_idx: torch.Tensor, current_hidden_states: torch.Tensor) -> None:
    """Add one expert's output into the layer's output (call in ascending expert id)."""
    final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))
