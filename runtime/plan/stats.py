"""Activation statistics for the planner: expert popularity by rank, per sparse layer.

Input: activation traces (runtime.engine.trace, JSON lines: a header ``{"container_id",
"num_layers", "num_experts", "top_k", ...}``, then one line per forward step ``{"layers":
{"<layer>": [[expert ids of token 0], ...]}}``).

Per sparse layer we count how often each expert was chosen, then *sort the counts*: the
planner needs "how often is the hottest expert chosen, the second hottest, ...", not which id
is hot, so that the statistics carry over to prompts where other experts are hot. ``p[r]`` is
the share of all selections in the layer that went to the rank-``r`` expert (``sum(p) == 1``);
a token chooses ``top_k`` experts, so rank ``r`` is chosen by a token with probability
``top_k * p[r]`` (at most 1).

Decode steps only, when the traces mark them. The planner predicts the time per *output*
token, and a decode step's tokens choose experts differently from a prompt's: the prefill of a
prompt spreads its many tokens over most experts, while decoding (one token per step) keeps
returning to fewer. The runtime's cache also ranks experts by the steps that used them (one
count per layer call), which decode steps dominate. So when the traces record each step's
input shape (``sequence == 1``: decode) and hold at least ``MIN_DECODE_STEPS`` decode steps, the
counts come from those steps alone (``ActivationStats.basis == "decode steps"``); otherwise
from every routed token (``"all tokens"``: older traces, prefill-only traces). On the GPU check
of 30 Nov (docs/benchmarks.md §7) counting the prefill made the hottest ranks look less
popular than decoding found them (full-pool hits 3.46 predicted against 3.62 measured per
layer), which made full tensors look worse than they were.

Smoothing (Good-Turing): a short trace does not show every expert, but the ones it never
saw are not never used. The mass the unseen experts share is estimated as ``n1 / N`` (the
selections of experts seen exactly once, over all selections; at least ``1 / N``, at most half
a selection per unseen expert, which is then not more popular than one seen once) and spread
evenly over them; the seen experts keep their observed shares scaled by ``1 - n1 / N``. Where
every expert was seen, nothing is moved. Additive smoothing (``alpha`` pseudo-selections per
expert, the rule before 30 Nov) flattened the hottest ranks on short traces: 0.5 per expert on
60 decode steps of a 60-expert, top-4 model is 30 pseudo-selections against 240 real ones, and
the planner expected 3.35 full-pool hits per layer where the GPU check measured 3.72 (Good-Turing:
3.63; docs/benchmarks.md §7). ``alpha`` is still accepted for that rule.

Layers the trace never shows get the average rank profile of the layers it does show. With no
trace at all the statistics are the uniform prior (``p[r] = 1 / num_experts``), and
``ActivationStats.source == "uniform prior"`` says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from zipmoe.errors import ModelError, UsageError

__all__ = ["ActivationStats", "from_traces", "from_counts", "uniform", "rank_distribution", "MIN_DECODE_STEPS"]

MIN_DECODE_STEPS = 16  # fewer decode steps than this: count every token instead


@dataclass
class ActivationStats:
    container_id: str | None
    num_experts: int
    top_k: int
    layers: list[int]  # sparse layer numbers
    rank_p: dict[int, np.ndarray]  # layer -> p[r], sorted descending, sums to 1
    source: str  # "trace" | "uniform prior"
    tokens: int = 0  # tokens seen (rows routed), summed over files, per layer max
    files: list[str] = field(default_factory=list)
    steps: int = 0
    decode_steps: int = 0  # steps whose input was one token per sequence
    basis: str = "all tokens"  # "decode steps" | "all tokens" (see the module doc)

    def summary(self) -> dict:
        """What plan.json records about where the statistics came from."""
        mean = np.mean([self.rank_p[l] for l in self.layers], axis=0) if self.layers else np.zeros(0)
        k = self.top_k
        top = float(np.sum(mean[:k])) if len(mean) else 0.0
        return {
            "source": self.source,
            "files": self.files,
            "steps": self.steps,
            "decode_steps": self.decode_steps,
            "basis": self.basis,
            "tokens": self.tokens,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "sparse_layers": len(self.layers),
            # share of selections going to the top-k ranks (uniform: k / num_experts)
            "top_k_share": round(top, 6),
            "mean_rank_p": [round(float(x), 6) for x in mean],
        }


def rank_distribution(counts: np.ndarray, alpha: float | None = None) -> np.ndarray:
    """Sorted (hottest first), smoothed, normalised selection shares from per-expert counts
    (Good-Turing for the unseen experts; ``alpha``: add that many pseudo-selections instead)."""
    c = np.asarray(counts, dtype=np.float64)
    n = c.sum()
    if n <= 0:
        return np.full(len(c), 1.0 / max(1, len(c)))
    if alpha is not None:
        c = np.sort(c + float(alpha))[::-1]
        return c / c.sum()
    p = c / n
    unseen = int((c == 0).sum())
    if unseen:
        mass = max(int((c == 1).sum()), 1) / n  # Good-Turing: the singletons' share
        # at most half a selection each: an expert never seen is not more popular than one seen once
        mass = min(mass, 0.5 * unseen / n, 0.5)
        p = p * (1 - mass)
        p[c == 0] = mass / unseen
    return np.sort(p)[::-1]


def _with_mean_profile(rank_p: dict, layers) -> dict:
    """``rank_p`` with every layer of ``layers`` it lacks given the mean profile of those it has."""
    mean = np.mean(list(rank_p.values()), axis=0)
    mean /= mean.sum()
    for l in layers:
        rank_p.setdefault(l, mean.copy())
    return rank_p


def uniform(num_experts: int, top_k: int, layers: list[int], container_id: str | None = None) -> ActivationStats:
    """The uniform prior: every rank equally popular (used when there is no trace)."""
    p = np.full(num_experts, 1.0 / num_experts)
    return ActivationStats(container_id, num_experts, top_k, list(layers), {l: p.copy() for l in layers}, "uniform prior")


def from_traces(paths, *, container_id: str | None, num_experts: int, top_k: int, layers: list[int],
                alpha: float | None = None) -> ActivationStats:
    """Rank statistics from one or more trace files of the model with ``container_id``.

    Raises :class:`ModelError` for a trace recorded on another model (container id, expert
    count or top-k disagree) and :class:`UsageError` for a file that is not a trace.
    """
    from zipmoe.runtime.engine.trace import read_trace

    counts = {l: np.zeros(num_experts, dtype=np.int64) for l in layers}
    decode = {l: np.zeros(num_experts, dtype=np.int64) for l in layers}
    tokens = {l: 0 for l in layers}
    files, steps, decode_steps = [], 0, 0
    for path in paths:
        path = Path(path)
        header, lines = read_trace(path, with_input=True)
        if not isinstance(header, dict) or "container_id" not in header:
            raise UsageError(f"{path} is not a zipmoe trace (its first line has no container_id)")
        if container_id is not None and header["container_id"] != container_id:
            raise ModelError(f"trace {path} was recorded on another model (container {header['container_id']}, "
                             f"this one is {container_id})")
        if header.get("num_experts") not in (None, num_experts):
            raise ModelError(f"trace {path} has {header.get('num_experts')} experts per layer, the container {num_experts}")
        if header.get("top_k") not in (None, top_k):
            raise ModelError(f"trace {path} was recorded with top_k={header.get('top_k')}, the container has {top_k}")
        files.append(str(path))
        for step, shape in lines:
            if not isinstance(step, dict):
                raise UsageError(f"{path} is not a zipmoe trace (a step is not an object)")
            steps += 1
            is_decode = isinstance(shape, list) and len(shape) == 2 and shape[1] == 1
            decode_steps += is_decode
            for key, rows in step.items():
                try:
                    layer = int(key)
                except ValueError:
                    raise UsageError(f"{path} is not a zipmoe trace (layer key {key!r})") from None
                if layer not in counts:
                    raise ModelError(f"trace {path} has layer {layer}, which is not a sparse layer of this model")
                c = counts[layer]
                for ids in rows:
                    if not ids:
                        continue  # dropped by a capacity limit
                    try:
                        a = np.asarray(ids, dtype=np.int64)
                    except (TypeError, ValueError):
                        raise UsageError(f"{path} is not a zipmoe trace (expert ids {ids!r})") from None
                    if a.min() < 0 or a.max() >= num_experts:
                        raise ModelError(f"trace {path} names expert {int(a.max())}, the model has {num_experts} per layer")
                    np.add.at(c, a, 1)
                    if is_decode:
                        np.add.at(decode[layer], a, 1)
                    tokens[layer] += 1
    seen = [l for l in layers if counts[l].sum() > 0]
    if not seen:
        raise UsageError(f"no routed tokens in {', '.join(files) or 'the traces'}")
    basis = "all tokens"
    if decode_steps >= MIN_DECODE_STEPS and all(decode[l].sum() > 0 for l in seen):
        counts, basis = decode, "decode steps"
    rank_p = _with_mean_profile({l: rank_distribution(counts[l], alpha) for l in seen}, layers)
    return ActivationStats(container_id, num_experts, top_k, list(layers), rank_p, "trace",
                           tokens=max(tokens.values()), files=files, steps=steps, decode_steps=decode_steps, basis=basis)


def from_counts(counts: dict, *, container_id: str | None, num_experts: int, top_k: int, layers: list[int],
                calls: int = 0, source: str = "earlier runs") -> ActivationStats:
    """Rank statistics from per-layer expert use counts (``{layer: {expert: uses}}``, one use per
    sparse layer call that chose the expert: the runtime's ``counters.uses``, what its LFU cache
    ranks by), as the default plan keeps them across runs (runtime/plan/default.py). Layers
    without counts get the mean profile; no counts at all: the uniform prior."""
    rows = {}
    for key, per in (counts or {}).items():
        layer = int(key)
        if layer not in layers:
            continue
        c = np.zeros(num_experts, dtype=np.int64)
        for e, n in (per or {}).items():
            e = int(e)
            if 0 <= e < num_experts and int(n) > 0:
                c[e] += int(n)
        if c.sum() > 0:
            rows[layer] = c
    if not rows:
        return uniform(num_experts, top_k, layers, container_id)
    rank_p = _with_mean_profile({l: rank_distribution(c) for l, c in rows.items()}, layers)
    return ActivationStats(container_id, num_experts, top_k, list(layers), rank_p, source,
                           tokens=int(calls), steps=int(calls), basis="layer calls")
