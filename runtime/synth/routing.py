"""Which experts a model's routers pick: for the skew test and for a look at a checkpoint.

Hooks every router module (``...mlp.gate`` / ``block_sparse_moe.gate`` / ``router.classifier``),
takes its input, and recomputes the top-k choice from the router weight, so it works the same
for every family without depending on what the router module returns.
"""

from __future__ import annotations

import re

import numpy as np
import torch

_ROUTER_MODULE = re.compile(r"\.(mlp|block_sparse_moe)\.gate$|\.router\.classifier$")


def router_modules(model) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if _ROUTER_MODULE.search(n) and hasattr(m, "weight")}


def expert_counts(model, top_k: int, run) -> dict[str, np.ndarray]:
    """Run ``run()`` (a forward pass) and count, per router, how often each expert is in a
    token's top-k. Returns {router module name: counts[num_experts]}."""
    counts: dict[str, np.ndarray] = {}
    handles = []
    for name, mod in router_modules(model).items():
        def hook(m, args, _name=name):
            x = args[0].reshape(-1, args[0].shape[-1]).float()
            logits = x @ m.weight.float().T
            idx = logits.topk(top_k, dim=-1).indices.reshape(-1)
            c = np.bincount(idx.numpy(), minlength=m.weight.shape[0])
            counts[_name] = counts.get(_name, 0) + c

        handles.append(mod.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    return counts


def popularity_stats(counts: dict[str, np.ndarray]) -> dict[str, float]:
    """Mean over routers of: the top expert's share of choices, and the normalised entropy of
    the choice distribution (1 = uniform)."""
    top, ent = [], []
    for c in counts.values():
        p = c / c.sum()
        top.append(float(p.max()))
        nz = p[p > 0]
        ent.append(float(-(nz * np.log(nz)).sum() / np.log(len(p))))
    return {"top_share": float(np.mean(top)), "entropy": float(np.mean(ent))}
