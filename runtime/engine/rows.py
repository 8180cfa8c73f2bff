"""Rows that join and leave one static KV cache between decode steps (continuous batching).

:class:`RowBatch` holds, per layer, one key and one value tensor of ``[rows, heads, columns,
dim]`` and decodes the rows in its first ``n`` slots together, one token per row per step, as
llama-server's slots and vLLM's scheduler do: a request joins between two steps without the
others being re-padded, and a finished one leaves without the others being recomputed.

The layout. Every row is written at the same column per step (the cache's *cursor*: a
transformers ``StaticCache`` writes every row at its ``cumulative_length``), and a row's
positions are the contiguous columns ``[start, cursor)``; the ``[rows, columns]`` mask holds 1
there and 0 elsewhere, and each row has its own position ids (0 at its first token). So:

* **joining**: a row of ``p`` positions (its prompt, prefilled alone on the decode loop, as
  chat prefills it, or a lone row that was decoding there) is copied into the next free slot
  at ``[cursor - p, cursor)``; when the cursor is not that far yet, every row moves right by
  the difference first (one copy, rare: a long prompt joining young rows);
* **leaving**: the rows that stay move down into the first slots, in order (the ones past a
  gap are copied, the others stay where they are);
* **room**: the columns grow in chunks (:data:`CHUNK`, doubling) up to the context limit, and
  the slots in powers of two up to ``max_rows``, so the cache takes what the rows need, not
  ``max_rows`` × context; at the limit every row moves left to the earliest start still in use.

Every move is a copy (``torch.equal`` keys and values), and masked columns hold finite values
(zeros, or a departed row's keys and values) that attention weighs with exactly zero.

Bit identity of a batched row: its logits are ``torch.equal`` to transformers computing the
same forward: the same rows in the same order over a ``StaticCache`` of the same ``[rows,
columns]`` holding the same keys and values, the same mask, position ids and kernels
(``tests/test_rows.py`` runs the same :class:`RowBatch` over a transformers model loaded with
``from_pretrained(..., experts_implementation="eager")`` and over zipmoe's, step for step). They
are not the bits of the row decoded alone: other matrix shapes (``rows`` × hidden) and another
column layout may round differently in the last bits. A row's first token comes from its
prefill, which is chat's computation exactly.

CUDA graphs: for each row count ``n`` that :func:`zipmoe.runtime.engine.graphs.why_not` allows,
a :class:`~zipmoe.runtime.engine.graphs.GraphedStep` is captured over views of the first ``n``
slots (the first step at a count runs eager, the second captures), and replays from then on;
growing the cache drops them (their addresses change).
"""

from __future__ import annotations

import torch

from zipmoe.errors import UsageError
from zipmoe.runtime.engine.kvsize import CHUNK, chunked, kv_shapes, plain_static
from zipmoe.runtime.engine.step import attention_of, forward as step_forward

__all__ = ["RowBatch", "CHUNK", "supported"]

def supported(model) -> bool:
    """Whether ``model``'s static cache is plain ``StaticLayer``s of known shapes (no sliding
    windows, no other layer kinds), which :class:`RowBatch` lays out itself."""
    return plain_static(model.config)


class RowBatch:
    """Up to ``max_rows`` rows of at most ``context`` positions each, over one static cache.

    ``graphs``: as the decode loop's (``"auto"`` | ``"off"``; None: the runtime's
    ``EngineSettings.graphs``); ``attention``: the kernels, engine/step.py."""

    def __init__(self, model, *, context: int, max_rows: int, graphs=None, attention=None) -> None:
        from zipmoe.runtime.engine.loop import _forward_params

        self.model = model
        self.context = int(context)
        self.max_rows = int(max_rows)
        if self.context < 2 or self.max_rows < 1:
            raise UsageError("a row batch needs at least 2 positions and 1 row")
        self.shapes = kv_shapes(model.config)
        rt = getattr(model, "zipmoe", None)
        self.device = rt.device if rt is not None else next(p for p in model.parameters() if p.device.type != "meta").device
        self.dtype = model.dtype
        self.attention = attention_of(model) if attention is None else attention
        if graphs is None:
            graphs = getattr(getattr(rt, "settings", None), "graphs", "auto")
        self._graphs_on = graphs not in ("off", False) and self.device.type == "cuda"
        self._keep = "logits_to_keep" in _forward_params(model)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.mask = torch.zeros((0, 0), dtype=torch.long, device=self.device)
        self.pos = torch.zeros((0,), dtype=torch.long, device=self.device)  # next position id per slot
        self.starts: list[int] = []  # first column of each row in use
        self.cursor = 0
        self._views: dict[int, object] = {}  # rows -> StaticCache over views of the first slots
        self._graphed: dict[int, object] = {}
        self.steps = 0

    # ------------------------------------------------------------------ size
    @property
    def rows(self) -> int:
        return len(self.starts)

    @property
    def capacity(self) -> tuple[int, int]:
        """(slots, columns) allocated."""
        return (int(self.mask.shape[0]), int(self.mask.shape[1]))

    @property
    def kv_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def lengths(self) -> list[int]:
        """Positions each row holds."""
        return [self.cursor - s for s in self.starts]

    def clear(self) -> None:
        """Forget every row (the tensors stay allocated)."""
        self.starts = []
        self.cursor = 0

    def _reserve(self, rows: int, columns: int) -> None:
        """At least ``rows`` slots and ``columns`` columns, keeping what the slots in use hold."""
        have_r, have_c = self.capacity
        if rows <= have_r and columns <= have_c:
            return
        if rows > self.max_rows or columns > self.context:
            raise UsageError(f"a row batch holds {self.max_rows} rows of {self.context} positions")
        r = max(have_r, chunked(rows, 1, self.max_rows))
        c = max(have_c, chunked(columns, CHUNK, self.context))
        n, used = self.rows, self.cursor
        keys, values = [], []
        for i, (heads, kd, vd) in enumerate(self.shapes):
            k = torch.zeros((r, heads, c, kd), dtype=self.dtype, device=self.device)
            v = torch.zeros((r, heads, c, vd), dtype=self.dtype, device=self.device)
            if self.keys and n and used:
                k[:n, :, :used] = self.keys[i][:n, :, :used]
                v[:n, :, :used] = self.values[i][:n, :, :used]
            keys.append(k)
            values.append(v)
        mask = torch.zeros((r, c), dtype=torch.long, device=self.device)
        pos = torch.zeros((r,), dtype=torch.long, device=self.device)
        if n:
            mask[:n, :used] = self.mask[:n, :used]
            pos[:n] = self.pos[:n]
        self.keys, self.values, self.mask, self.pos = keys, values, mask, pos
        self._views.clear()
        self._graphed.clear()

    def _shift(self, by: int) -> None:
        """Move every row's columns ``by`` to the right (negative: to the left)."""
        n, c = self.rows, self.cursor
        if by == 0 or n == 0:  # no row to move: only the cursor
            self.cursor = c + by
            return
        lo = min(self.starts)
        src = slice(lo, c)
        dst = slice(lo + by, c + by)
        for t in self.keys + self.values:
            t[:n, :, dst] = t[:n, :, src].clone()
        m = self.mask[:n, src].clone()
        self.mask[:n] = 0
        self.mask[:n, dst] = m
        self.starts = [s + by for s in self.starts]
        self.cursor = c + by

    # ------------------------------------------------------------------ rows
    @torch.inference_mode()
    def add(self, cache, length: int, next_position: int) -> None:
        """Copy a row of ``length`` positions from row 0 of ``cache`` (a batch-1 ``StaticCache``:
        the decode loop's) into the next slot; its next token goes at ``next_position``."""
        length = int(length)
        if not 0 < length < self.context:
            raise UsageError(f"a row of {length} positions does not fit {self.context}")
        if self.rows >= self.max_rows:
            raise UsageError(f"the row batch is full ({self.max_rows} rows)")
        if length > self.cursor:
            self._reserve(self.rows + 1, length + 1)
            self._shift(length - self.cursor)
        else:
            self._reserve(self.rows + 1, self.cursor + 1)
        j, c = self.rows, self.cursor
        for i, layer in enumerate(cache.layers):
            self.keys[i][j, :, c - length:c] = layer.keys[0, :, :length]
            self.values[i][j, :, c - length:c] = layer.values[0, :, :length]
        self.mask[j] = 0
        self.mask[j, c - length:c] = 1
        self.pos[j] = int(next_position)
        self.starts.append(c - length)

    @torch.inference_mode()
    def keep(self, keep: list[int]) -> None:
        """Keep only these rows (ascending indices), moved down to the first slots in this order."""
        keep = list(keep)
        if keep != sorted(set(keep)) or (keep and not 0 <= keep[0] <= keep[-1] < self.rows):
            raise ValueError(f"rows to keep must be ascending indices below {self.rows}: {keep}")
        c = self.cursor
        for j, src in enumerate(keep):
            if src == j:
                continue
            lo = self.starts[src]
            for t in self.keys + self.values:
                t[j, :, lo:c] = t[src, :, lo:c]
            self.mask[j] = self.mask[src]
            self.pos[j] = self.pos[src]
        self.starts = [self.starts[i] for i in keep]
        if not self.starts:
            self.cursor = 0

    # ------------------------------------------------------------------ step
    def _view(self, n: int):
        """A transformers ``StaticCache`` over the first ``n`` slots (views: the same storage)."""
        cache = self._views.get(n)
        if cache is not None:
            return cache
        from transformers import StaticCache

        cols = self.capacity[1]
        cache = StaticCache(config=self.model.config, max_cache_len=cols)
        for layer, k, v in zip(cache.layers, self.keys, self.values):
            layer.keys, layer.values = k[:n], v[:n]
            layer.device = k.device
            layer.batch_size, layer.num_heads = n, k.shape[1]
            layer.k_head_dim, layer.v_head_dim = k.shape[-1], v.shape[-1]
            layer.cumulative_length = torch.tensor(0, dtype=torch.long, device=k.device)
            layer.is_initialized = True
        self._views[n] = cache
        return cache

    @torch.inference_mode()
    def step(self, token_ids) -> torch.Tensor:
        """Feed one token per row (``[rows]``); returns the float32 ``[rows, vocab]`` logits of
        each row's next position."""
        n = self.rows
        if n == 0:
            raise UsageError("step() with no rows")
        if self.cursor >= self.capacity[1]:
            if self.capacity[1] < self.context:
                self._reserve(n, self.cursor + 1)
            else:
                lo = min(self.starts)
                if lo == 0:
                    raise UsageError(f"a row holds all {self.context} positions")
                self._shift(-lo)
        c = self.cursor
        cache = self._view(n)
        for layer in cache.layers:
            layer.cumulative_length.fill_(c)
        self.mask[:n, c] = 1
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device).reshape(n, 1)
        pos = self.pos[:n].reshape(n, 1).clone()
        mask = self.mask[:n].clone()
        try:
            logits = self._forward(n, cache, ids, pos, mask)
        except BaseException:
            self.mask[:n, c] = 0
            raise
        self.cursor = c + 1
        self.pos[:n] += 1
        self.steps += 1
        return logits.to(copy=True, dtype=torch.float32)

    def _forward(self, n, cache, ids, pos, mask):
        g = self._graphed.get(n)
        if g is None and self._graphs_on:
            from zipmoe.runtime.engine import graphs as mod

            if mod.why_not(self.model, n) is None:
                g = self._graphed[n] = mod.GraphedStep(self.model, cache, batch=n, attention=self.attention)
        if g is not None:
            return g(ids, pos, mask)
        return step_forward(self.model, cache, ids, pos, mask, keep_last=self._keep, attention=self.attention)
