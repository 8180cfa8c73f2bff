"""The one seam between the server's batching engine and the model: prefill, step, drop, join.

The batching engine (:mod:`.batcher`) never calls the model itself; it talks to a *stepper*
through four calls, so that the decode loop underneath can be swapped by changing this module
only:

* ``prefill(prompts, alone=False) -> (batch, logits)``: run a batch of prompts (lists of token
  ids, any lengths; left-padded with an attention mask when they differ) and return an opaque
  batch state and the next-token logits of every row (``[rows, vocab]``, float32);
* ``step(batch, tokens) -> logits``: feed one token per row, return the next logits;
* ``select(batch, keep) -> batch``: keep only these rows (finished or cancelled rows leave;
  padding columns no row needs any more are trimmed away);
* ``join(running, new) -> batch``: append the rows of a freshly prefilled batch to a running
  one (the shorter one is left-padded), so that a request arriving while a batch decodes joins
  it at the next step. ``can_join`` is False for caches this module cannot re-pad; the engine
  then queues newcomers until the running batch has finished.

All four run under ``torch.inference_mode()`` (no autograd graph is kept between steps), and
``sampler(prompt_len, temperature=, top_p=)`` gives a request the decode loop's
:class:`~zipmoe.runtime.engine.sampling.Sampler` (chat's sampling over the model's generation
config), so that a lone request picks the tokens chat picks.

**A lone request** (``alone=True``: the engine asks so when nothing else runs and the request
fits :meth:`TransformersStepper.fits_loop`) decodes on zipmoe's own decode loop
(:class:`zipmoe.runtime.engine.loop.DecodeLoop`: a static KV cache of ``context`` positions,
allocated once, CUDA graphs where they apply) exactly as ``zipmoe chat`` decodes a turn, so its
greedy tokens are ``zipmoe chat --greedy``'s, and the loop's KV cache is kept between requests:
a request whose prompt extends the last one (the whole previous prompt, then more: a
conversation's next turn, with the previous answer in it) keeps the longest common prefix of
the cache and the prompt and prefills only the rest, as chat's next turn does (``reused`` says
how many prompt tokens came from the cache). Any other prompt is prefilled from an empty
cache, so that it computes what a fresh ``zipmoe chat`` computes (a shared system prompt alone
is not reused: that would change the prefill's matrix shapes, and so its bits).

**Several requests** decode together on zipmoe's own row batch
(:class:`zipmoe.runtime.engine.rows.RowBatch`: one static cache with a slot per row up to
``max_batch``, continuous batching): each newcomer's prompt is prefilled alone on the decode
loop (chat's prefill: its first token is the one chat picks) and its keys and values are copied
into the next slot; a lone row that was decoding on the loop moves into the first slot the
same way; finished rows leave between steps without the others being re-padded; CUDA graphs
are captured per row count. A batched row's logits are ``torch.equal`` to transformers
computing the same rows over the same cache layout (engine/rows.py), not to the row decoded
alone: other matrix shapes may round differently in the last bits (docs/serve.md). Models whose
cache the row batch cannot lay out (sliding-window layers), and a stepper without a loop
(``context=None``), batch on transformers' forward with a ``DynamicCache`` instead: the prompts
left-padded into one prefill, rows joined by re-padding.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from zipmoe.runtime.engine.kvsize import max_context
from zipmoe.runtime.engine import rows as row_batch
from zipmoe.runtime.engine.loop import DecodeLoop, common_prefix
from zipmoe.runtime.engine.sampling import Sampler, generation_config, sampling_kwargs
from zipmoe.runtime.engine.step import attention_kernels, attention_of

__all__ = ["Batch", "LoopBatch", "SlotBatch", "TransformersStepper", "context_length"]


@dataclass
class Batch:
    """Decode state of the rows in flight: the KV cache, the 2-D attention mask (``[rows, length]``,
    0 where a row is left-padded) and each row's next position."""

    cache: object
    mask: torch.Tensor
    positions: torch.Tensor  # [rows] position id of each row's next token

    @property
    def rows(self) -> int:
        return int(self.mask.shape[0])

    @property
    def padded(self) -> bool:
        return bool((self.mask == 0).any())


def context_length(model, tokenizer=None) -> int:
    """The longest sequence (prompt + answer) the model takes: its config's limit (the one the
    decode loop clamps to), else the tokenizer's, else 2048."""
    v = max_context(model.config)
    if v:
        return v
    v = getattr(tokenizer, "model_max_length", None)
    if isinstance(v, int) and 0 < v < 10**7:
        return v
    return 2048


@dataclass
class LoopBatch:
    """A lone request decoding on the stepper's :class:`DecodeLoop`."""

    loop: object
    rows: int = 1
    padded: bool = False


@dataclass
class SlotBatch:
    """Rows decoding together on the stepper's :class:`~zipmoe.runtime.engine.rows.RowBatch`."""

    slots: object
    padded: bool = True

    @property
    def rows(self) -> int:
        return self.slots.rows


class TransformersStepper:
    """The stepper over a transformers causal LM (a model from :func:`zipmoe.runtime.engine.loader.load`).

    ``context``: the lone-request decode loop's KV cache in tokens (clamped to the model's
    limit; its bytes, ``loop.kv_bytes``, come on top of the budget); None: no loop, every request on
    transformers' forward with a ``DynamicCache``. ``max_batch``: the row batch's slots (its cache
    grows with the rows and their lengths, ``slots.kv_bytes``)."""

    def __init__(self, model, context: int | None = None, max_batch: int = 8) -> None:
        if getattr(model.config, "is_encoder_decoder", False):
            raise ValueError("encoder-decoder models are not served over HTTP (decoder-only models only)")
        self.model = model
        params = set(inspect.signature(model.forward).parameters)
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._keep = "logits_to_keep" in params
        self._positions = "position_ids" in params
        self.device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
        # the batched forward runs the attention kernels the decode loop runs (engine/step.py)
        self.attention = attention_of(model)
        self.can_join = True
        self.loop = None
        self.reused = 0  # prompt tokens the last prefill took from the loop's cache
        self.path = ""  # the last prefill's path: "loop" (the decode loop, as chat) or "batch" (transformers' forward)
        self._prompt_len = 0  # the prompt the loop's cache was last filled from
        self._samplers: dict = {}  # (temperature, top_p) -> a Sampler that reads no ids (stateless: shared)
        if context:
            self.loop = DecodeLoop(model, context=int(context), batch=1)
        # a lone row can join a batch when its static cache copies into a dynamic one
        self._loop_joins = self.loop is not None and all(type(layer).__name__ == "StaticLayer" for layer in self.loop.cache.layers)
        self.slots = None  # several requests: zipmoe's row batch, where the model's cache allows it
        if self.loop is not None and self._loop_joins and row_batch.supported(model):
            self.slots = row_batch.RowBatch(model, context=self.loop.context, max_rows=max(1, int(max_batch)),
                                            attention=self.attention)

    def fits_loop(self, tokens: int) -> bool:
        """Whether a lone request of ``tokens`` (prompt + the most it may generate) fits the loop's cache."""
        return self.loop is not None and tokens <= self.loop.context

    def sampler(self, prompt_len: int, *, temperature: float, top_p: float) -> Sampler:
        """How a request of ``prompt_len`` prompt tokens picks its tokens: greedy at temperature
        0, else sampling at this temperature and top-p, over the model's generation config, as
        the decode loop (chat) picks them."""
        key = (float(temperature), float(top_p))
        if key in self._samplers:
            return self._samplers[key]
        cfg = generation_config(self.model, **sampling_kwargs(temperature=temperature, top_p=top_p))
        s = Sampler(self.model, cfg, prompt_len=prompt_len, batch=1, device=self.device)
        if not s.needs_ids:  # its processors depend neither on the prompt nor on the tokens so far
            if len(self._samplers) >= 64:
                self._samplers.pop(next(iter(self._samplers)))
            self._samplers[key] = s
        return s

    # ------------------------------------------------------------------ the four calls
    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], alone: bool = False, running=None, on_first=None):
        """``running``: the batch decoding now, which these prompts will join (None: nothing).
        ``on_first(i, logits)``: called with prompt ``i``'s ``[1, vocab]`` logits as soon as they
        are known (on the row batch's path each prompt is prefilled alone, one after another: its
        first token need not wait for the prefills after it)."""
        self.reused = 0
        if alone and running is None and len(prompts) == 1 and self.fits_loop(len(prompts[0])):
            self.path = "loop"
            return self._prefill_loop(prompts[0])
        self.path = "batch"
        if self.slots is not None and (running is None or isinstance(running, (LoopBatch, SlotBatch))):
            return self._prefill_slots(prompts, running, on_first)
        from transformers import DynamicCache

        width = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        cache = DynamicCache(config=self.model.config)
        logits = self._forward(ids, mask, positions, cache)
        batch = Batch(cache, mask, positions[:, -1] + 1)
        self._check_cache(cache)
        return batch, logits

    @torch.inference_mode()
    def step(self, batch, tokens: list[int]) -> torch.Tensor:
        if isinstance(batch, LoopBatch):
            return batch.loop.step(tokens)
        if isinstance(batch, SlotBatch):
            return batch.slots.step(tokens)
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device).view(-1, 1)
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones((batch.rows, 1))], dim=-1)
        positions = batch.positions.view(-1, 1)
        logits = self._forward(ids, batch.mask, positions, batch.cache)
        batch.positions = batch.positions + 1
        return logits

    @torch.inference_mode()
    def select(self, batch, keep: list[int]):
        if len(keep) == batch.rows:
            return batch
        if isinstance(batch, LoopBatch):  # one row: it stays or the batch ends
            return batch if keep == [0] else None
        if isinstance(batch, SlotBatch):
            batch.slots.keep(keep)
            return batch if keep else None
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        mask = batch.mask.index_select(0, idx)
        # columns of padding that no remaining row needs: cut them from the mask and the cache
        cut = int((mask.cumsum(-1) == 0).sum(-1).min().item()) if (mask.numel() and self.can_join) else 0
        for layer in self._layers(batch.cache):
            if not self.can_join:  # a cache of another kind: its own row selection, no trimming
                layer.batch_select_indices(idx)
            elif getattr(layer, "is_initialized", False) and layer.keys.numel():
                layer.keys = layer.keys.index_select(0, idx)[..., cut:, :].contiguous()
                layer.values = layer.values.index_select(0, idx)[..., cut:, :].contiguous()
        return Batch(batch.cache, mask[:, cut:].contiguous(), batch.positions.index_select(0, idx))

    @torch.inference_mode()
    def join(self, running, new):
        if isinstance(new, SlotBatch):  # its prefill took the running rows into the row batch already
            return new
        running, new = self._dynamic(running), self._dynamic(new)
        la, lb = running.mask.shape[1], new.mask.shape[1]
        width = max(la, lb)
        for a, b in zip(self._layers(running.cache), self._layers(new.cache)):
            a.keys = torch.cat([_pad_left(a.keys, width, -2), _pad_left(b.keys, width, -2)], dim=0)
            a.values = torch.cat([_pad_left(a.values, width, -2), _pad_left(b.values, width, -2)], dim=0)
        mask = torch.cat([_pad_left(running.mask, width, -1), _pad_left(new.mask, width, -1)], dim=0)
        return Batch(running.cache, mask, torch.cat([running.positions, new.positions]))

    # ------------------------------------------------------------------ the lone row
    def _prefill_loop(self, ids: list[int]):
        loop = self.loop
        held = loop.tokens[0]
        # reuse the cache only for a prompt that extends the last one (a conversation's next
        # turn: the whole previous prompt, then more); anything else starts from an empty cache
        # and computes what a fresh `zipmoe chat` computes
        extends = bool(held) and len(ids) > self._prompt_len and common_prefix(held, ids) >= self._prompt_len
        logits = loop.prefill(torch.tensor([ids], dtype=torch.long), reuse=extends)
        self._prompt_len = len(ids)
        self.reused = loop.reused if extends else 0
        self.can_join = self._loop_joins
        return LoopBatch(loop), logits

    def _prefill_slots(self, prompts, running, on_first=None):
        """Each prompt prefilled alone on the decode loop (chat's prefill), then copied into the
        row batch after the rows running now (a lone row on the loop moves there first);
        ``on_first(i, logits)`` as each prompt's prefill ends."""
        slots, loop = self.slots, self.loop
        if running is None:
            slots.clear()
        elif isinstance(running, LoopBatch):
            slots.clear()
            slots.add(loop.cache, loop.length, int(loop.next_positions[0]))
        logits = []
        try:
            for i, p in enumerate(prompts):
                logits.append(loop.prefill(torch.tensor([p], dtype=torch.long)))
                slots.add(loop.cache, len(p), len(p))
                if on_first is not None:
                    on_first(i, logits[-1])
        finally:
            loop.reset()  # the loop's cache no longer holds a conversation to continue
            self._prompt_len = 0
        self.can_join = True
        return SlotBatch(slots), torch.cat(logits)

    def _dynamic(self, batch):
        """``batch`` as a :class:`Batch` over a ``DynamicCache`` (a lone row's static cache copied:
        the positions it holds)."""
        if not isinstance(batch, LoopBatch):
            return batch
        from transformers import DynamicCache

        loop, n = batch.loop, batch.loop.length
        cache = DynamicCache(config=self.model.config)
        for i, layer in enumerate(loop.cache.layers):
            cache.update(layer.keys[:, :, :n].clone(), layer.values[:, :, :n].clone(), i)
        mask = torch.ones((1, n), dtype=torch.long, device=self.device)
        return Batch(cache, mask, loop.next_positions)

    # ------------------------------------------------------------------ internals
    def _forward(self, ids, mask, positions, cache) -> torch.Tensor:
        kw = {self._cache_kw: cache, "use_cache": True}
        if self._keep:
            kw["logits_to_keep"] = 1
        if self._positions:
            kw["position_ids"] = positions
        # no padding: no mask, as generate() drops an all-ones mask (the same attention path)
        if bool((mask == 0).any()):
            kw["attention_mask"] = mask
        with attention_kernels(self.attention, self.device):
            out = self.model(input_ids=ids, **kw)
        return out.logits[:, -1, :].float()

    @staticmethod
    def _layers(cache) -> list:
        return list(getattr(cache, "layers", []) or [])

    def _check_cache(self, cache) -> None:
        from transformers.cache_utils import DynamicLayer

        layers = self._layers(cache)
        self.can_join = bool(layers) and all(
            type(layer) is DynamicLayer and getattr(layer, "is_initialized", False) and layer.keys.dim() == 4
            for layer in layers)


def _pad_left(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    n = t.shape[dim]
    if n == width:
        return t
    shape = list(t.shape)
    shape[dim] = width - n
    return torch.cat([t.new_zeros(shape), t], dim=dim)
