"""zipmoe's own decode loop: a static KV cache allocated once, one forward per step, no
``model.generate`` machinery between the steps.

:class:`DecodeLoop` holds a transformers ``StaticCache`` of ``[batch, columns]`` positions per
layer, reused by every turn and request. ``context`` is the most it may hold; ``columns`` is
what it holds room for now. The cache grows to the conversation (``kv="grow"``, the default):
it starts at :data:`~zipmoe.runtime.engine.kvsize.CHUNK` (256) positions, or the smallest
doubling of it that holds the prompt, and doubles when a step needs room, up to ``context``
(each growth copies the positions held into a new cache: ``torch.equal`` keys and values); a
fresh prefill (no ``reuse``) sizes it to its prompt again. So a short conversation's attention
runs over a few hundred positions, not over ``context`` (the demo on the CPU, every expert
resident: 100.7 ms per token against 122.6 ms over a fixed 4096, docs/benchmarks.md §28), and
its memory is what the conversation takes. ``kv="fixed"`` allocates the whole ``context`` once, as before;
the CUDA graphs (``graphs``) and models whose cache is not plain ``StaticLayer``s (sliding
windows) use it, since a graph replays over fixed addresses. A turn is :meth:`DecodeLoop.prefill` (the prompt, or only
the part of it that the cache does not hold yet) then :meth:`DecodeLoop.step` per new token;
:meth:`DecodeLoop.generate` runs both with sampling, stopping and streaming.

Bit identity. Logits are ``torch.equal`` to transformers computing the same checkpoint with the
same kernels and the same cache implementation: ``from_pretrained(..., experts_implementation=
"eager").generate(..., cache_implementation="static")`` (or a ``StaticCache`` passed to it). The
loop builds the model's inputs exactly as ``generate`` does for a static cache: position ids
from the attention mask's cumulative sum, the 2-D mask dropped when it holds no padding (at the
first prefill of the cache), ``logits_to_keep=1``, the last position's logits copied to float32,
the same logits processors and ``argmax`` or ``softmax`` + ``multinomial`` for the next token
(:class:`zipmoe.runtime.engine.sampling.Sampler`, which the server's rows use too), finished rows
padded with the pad token. A dynamic cache (what plain ``model.generate`` uses) gives different
bits in the attention over the cache, so the static cache is part of the reference, and so is
its length: the reference of a step is transformers over a ``StaticCache`` of the loop's
``columns`` at that step, holding the same keys and values (a cache that grew is, bit for bit,
the one transformers would have filled at the larger size: the same keys and values at the same
positions; ``tests/test_loop.py`` runs the same growth over transformers' own model). With
``kv="fixed"`` that is plain ``generate(cache_implementation="static")`` at ``context``.

Every entry point that computes (:meth:`DecodeLoop.prefill`, :meth:`~DecodeLoop.step`,
:meth:`~DecodeLoop.generate`, :meth:`~DecodeLoop.forward`, :meth:`~DecodeLoop.reset`,
:func:`generate_ids`) runs under ``torch.inference_mode()`` itself: no caller can leave autograd
on (which kept every step's graph, and the expert weights in it, alive), and the logits it
returns carry no graph. Its bits are ``generate``'s under ``torch.no_grad()``: grad mode is off
in both, so the expert hook hands the kernels weights that do not require grad in both.

Multi-turn: :meth:`DecodeLoop.prefill` with ``reuse=True`` (batch 1) keeps the longest common
prefix of the token ids the cache holds (``loop.tokens``) and the new prompt, crops the cache
to it (a static cache is cropped by moving its length back: the positions past it are
overwritten by the next update; the causal mask, built from the cache's length, never lets a
query see them) and prefills only the rest. At least one token is always fed, so a prompt that
the cache holds entirely recomputes its last token. A prompt plus answer that does not fit the
cache raises :class:`ContextFull` (a :class:`zipmoe.errors.UsageError`: one line for the user).

The CUDA graphs (``runtime/engine/graphs.py``): every step goes through
:func:`zipmoe.runtime.engine.step.forward` with the mask in its static ``[batch, context]`` form
(:func:`~zipmoe.runtime.engine.step.static_mask`), eager or graphed alike; on CUDA, where
``graphs.why_not(model, batch)`` finds nothing against it, a ``graphs.GraphedStep`` built once
per loop over this loop's cache replays that very call (``step(ids [batch, 1], position_ids
[batch, 1], mask) -> [batch, vocab]``, padded rows too). ``graphs``: ``"auto"`` (where
supported, else eager, silently), ``"on"`` (a UsageError where not supported), ``"off"``;
``True``/``False`` mean on/off; None (the default) takes the runtime's
``EngineSettings.graphs``. ``loop.graphed`` tells which one runs. The prefill stays eager.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from zipmoe.errors import UsageError
from zipmoe.runtime.engine.hf_compat import crop
from zipmoe.runtime.engine.kvsize import CHUNK, chunked, kv_shapes, max_context, plain_static, static_cache_bytes
from zipmoe.runtime.engine.sampling import ForcedTokens, Sampler, eos_ids, finish_reason, generation_config
from zipmoe.runtime.engine.settings import check_attention
from zipmoe.runtime.engine.step import attention_of, forward as step_forward, static_mask

__all__ = ["DEFAULT_CONTEXT", "ContextFull", "DecodeLoop", "GenerateResult", "common_prefix", "generate_ids"]

DEFAULT_CONTEXT = 4096


class ContextFull(UsageError):
    """The conversation does not fit the KV cache."""


@dataclass
class GenerateResult:
    """One call of :meth:`DecodeLoop.generate`: the new tokens of each row (up to and including
    an end-of-sequence token), their logits when asked for, and timing."""

    tokens: list  # list (rows) of lists of new token ids
    logits: list = field(default_factory=list)  # one [batch, vocab] float32 tensor per new token, when kept
    stats: dict = field(default_factory=dict)
    interrupted: bool = False
    stop: str = ""  # "eos", "max_new_tokens", "context" or "interrupted"
    times: list = field(default_factory=list)  # perf_counter() when each new token was known


class DecodeLoop:
    """A static KV cache and the decode loop over it, for one model.

    ``context``: positions the cache holds per row (clamped to the model's
    ``max_position_embeddings``; ``clamped`` says so). ``batch``: rows (fixed for the loop's
    life; a prompt of fewer rows is refused). ``graphs``: ``"auto"`` | ``"on"`` | ``"off"`` | None
    (the runtime's setting), see the module docstring. ``attention``: ``"reproducible"`` |
    ``"pytorch"`` | None (the runtime's ``EngineSettings.attention``; ``"reproducible"`` for a
    model that is not a zipmoe model): the attention kernels of every forward, engine/step.py.
    ``kv``: ``"grow"`` (room for the conversation, in doublings of ``chunk`` positions, up to
    ``context``) or ``"fixed"`` (the whole ``context`` at once); a graphed loop, and a model whose
    cache zipmoe cannot lay out, is fixed whatever is asked (``growing`` says which).
    """

    def __init__(self, model, *, context: int = DEFAULT_CONTEXT, batch: int = 1, graphs=None, attention=None,
                 kv: str = "grow", chunk: int = CHUNK) -> None:
        if kv not in ("grow", "fixed"):
            raise UsageError(f"kv must be 'grow' or 'fixed', not {kv!r}")
        if getattr(model.config, "is_encoder_decoder", False):
            raise UsageError(f"{model.config.model_type} is an encoder-decoder model: the decode loop serves "
                             "decoder-only models (use model.generate)")
        if int(context) < 2:
            raise UsageError("--context must be at least 2 tokens")
        if int(batch) < 1:
            raise UsageError("batch must be at least 1")
        self.model = model
        self.config = model.config
        limit = max_context(model.config)
        self.requested_context = int(context)
        self.context = min(int(context), limit) if limit else int(context)
        self.clamped = self.context < self.requested_context
        self.batch = int(batch)
        rt = getattr(model, "zipmoe", None)
        self.attention = check_attention(attention_of(model) if attention is None else attention)
        self.device = rt.device if rt is not None else next(p for p in model.parameters() if p.device.type != "meta").device
        self.dtype = model.dtype
        self.chunk = max(1, int(chunk))
        self.tokens: list[list[int]] = [[] for _ in range(self.batch)]  # ids whose K/V the cache holds
        self._mask: torch.Tensor | None = None  # 2-D mask of the cached positions, None = no padding
        self._pos: torch.Tensor | None = None  # [batch, 1] position id of the last cached token
        self._keep = "logits_to_keep" in _forward_params(model)
        self.graphed = None
        graphed = self._graphs_wanted(graphs)
        self.growing = kv == "grow" and not graphed and plain_static(model.config)
        self.cache = None
        self.growths = 0  # reallocations after the first (a growth, or a fresh prefill's resize)
        self._allocate(chunked(1, self.chunk, self.context) if self.growing else self.context)
        if graphed:
            from zipmoe.runtime.engine import graphs as mod  # CUDA graphs of the decode step

            self.graphed = mod.GraphedStep(self.model, self.cache, batch=self.batch, attention=self.attention)

    # ---------------------------------------------------------------- cache
    def _allocate(self, columns: int) -> None:
        """A cache of ``columns`` positions holding the positions the current one holds (copied:
        the same keys and values at the same columns)."""
        from transformers import StaticCache

        old, held = self.cache, self.length
        cache = StaticCache(config=self.config, max_cache_len=int(columns))
        shapes = kv_shapes(self.config)
        if shapes is not None and len(shapes) == len(cache.layers):
            for layer, (heads, kd, vd) in zip(cache.layers, shapes):
                k = torch.zeros((self.batch, heads, 0, kd), dtype=self.dtype, device=self.device)
                v = torch.zeros((self.batch, heads, 0, vd), dtype=self.dtype, device=self.device)
                layer.lazy_initialization(k, v)
        if old is not None and held:
            for new, was in zip(cache.layers, old.layers):
                new.keys[:, :, :held] = was.keys[:, :, :held]
                new.values[:, :, :held] = was.values[:, :, :held]
                new.cumulative_length.fill_(held)
        if old is not None:
            self.growths += 1
        self.cache = cache
        self.columns = int(columns)

    def _room(self, positions: int, fresh: bool = False) -> None:
        """Room for ``positions`` (at most ``context``): a growing cache doubles up to it, and a
        fresh one (nothing held) takes the smallest doubling of ``chunk`` that holds it."""
        if not self.growing:
            return
        want = chunked(positions, self.chunk, self.context)
        if want > self.columns or (fresh and want < self.columns):
            self._allocate(want)

    def _allocated_bytes(self) -> int:
        total = 0
        for layer in self.cache.layers:
            if getattr(layer, "is_initialized", False):
                total += layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
        return total

    @property
    def kv_bytes(self) -> int | None:
        """Bytes the KV cache holds now (None when the model's cache is allocated at its first
        forward, its shapes being unknown until then)."""
        total = self._allocated_bytes()
        return total if total or kv_shapes(self.config) is not None else None

    @property
    def kv_bytes_limit(self) -> int | None:
        """Bytes the KV cache takes at the whole ``context`` (what a growing cache may reach)."""
        if kv_shapes(self.config) is None:
            return None
        return static_cache_bytes(self.config, batch=self.batch, context=self.context, itemsize=self.dtype.itemsize)

    def describe_kv(self, asked: int | None = None) -> str:
        """One line for chat's and serve's start: what the KV cache holds, and may grow to."""
        from zipmoe.units import format_size

        note = f" (asked for {asked}; the model's limit is {self.context})" if self.clamped and asked else ""
        now, most = self.kv_bytes, self.kv_bytes_limit
        if self.growing:
            return (f"KV cache: grows with the conversation from {self.columns} to {self.context} tokens{note}, "
                    f"{format_size(now)} now, {format_size(most)} at most, on top of the budget")
        held = format_size(now) if now is not None else "allocated at the first forward"
        return f"KV cache: {self.context} tokens{note}, {held} on top of the budget"

    @property
    def length(self) -> int:
        """Positions the cache holds (the same for every row)."""
        return len(self.tokens[0])

    @property
    def next_positions(self) -> torch.Tensor:
        """``[batch]`` position id of each row's next token (after a prefill)."""
        return self._pos.reshape(-1) + 1

    @torch.inference_mode()
    def reset(self) -> None:
        """Forget the cached positions (the tensors stay allocated; the next prefill sizes a
        growing cache to its prompt)."""
        if self.length:
            crop(self.cache, self.length)
        self.tokens = [[] for _ in range(self.batch)]
        self._mask = None
        self._pos = None

    def _crop(self, keep: int) -> None:
        drop = self.length - keep
        if drop <= 0:
            return
        crop(self.cache, drop)
        self.tokens = [t[:keep] for t in self.tokens]
        if self._mask is not None:
            self._mask = self._mask[:, :keep]
        self._pos = None if keep == 0 else self._pos_after_crop(keep)

    def _pos_after_crop(self, keep: int) -> torch.Tensor:
        if self._mask is None:
            return torch.full((self.batch, 1), keep - 1, dtype=torch.long, device=self.device)
        return (self._mask.long().cumsum(-1) - 1).masked_fill(self._mask == 0, 0)[:, -1:]

    # ---------------------------------------------------------------- graphs
    def _graphs_wanted(self, graphs) -> bool:
        """Whether this loop's steps replay CUDA graphs. ``graphs``: ``"auto"`` | ``"on"`` |
        ``"off"`` (or True / False); None: the runtime's ``EngineSettings.graphs`` (``"auto"``
        for a model that is not a zipmoe model)."""
        if graphs is None:
            rt = getattr(self.model, "zipmoe", None)
            graphs = getattr(getattr(rt, "settings", None), "graphs", "auto")
        if graphs is True:
            graphs = "on"
        if graphs is False:
            graphs = "off"
        if graphs not in ("auto", "on", "off"):
            raise UsageError(f"graphs must be 'auto', 'on' or 'off', not {graphs!r}")
        if graphs == "off":
            return False
        ok = False
        if self.device.type == "cuda":
            from zipmoe.runtime.engine import graphs as mod  # CUDA graphs of the decode step

            ok = mod.why_not(self.model, self.batch) is None
        if not ok and graphs == "on":
            raise UsageError(f"CUDA graphs are not available for this model at batch {self.batch} on {self.device} "
                             "(use graphs='auto' to fall back to eager steps)")
        return ok

    # ---------------------------------------------------------------- forward
    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask=None) -> torch.Tensor:
        """One eager forward over the cache: ``[batch, n]`` new ids at ``position_ids`` ->
        ``[batch, vocab]`` logits of the last new position (model dtype): engine/step.py's
        ``forward``, the call the CUDA graphs capture."""
        return step_forward(self.model, self.cache, input_ids, position_ids, attention_mask, keep_last=self._keep,
                            attention=self.attention)

    def _run(self, ids: torch.Tensor, pos: torch.Tensor, mask, single: bool) -> torch.Tensor:
        try:
            if single:
                # a decode step: the mask in its static [batch, columns] form, eager or graphed
                # (the same call either way: engine/step.py)
                mask = static_mask(mask, pos, self.columns)
                logits = self.graphed(ids, pos, mask) if self.graphed is not None else self.forward(ids, pos, mask)
            else:
                logits = self.forward(ids, pos, mask)
        except BaseException:  # Ctrl-C or an error mid-forward: some layers were updated, others not
            self._resync()
            raise
        return logits.to(copy=True, dtype=torch.float32)

    def _resync(self) -> None:
        """Every layer's length back to the positions ``self.tokens`` says the cache holds."""
        for layer in self.cache.layers:
            if getattr(layer, "is_initialized", False):
                layer.cumulative_length.fill_(self.length)

    @torch.inference_mode()
    def prefill(self, input_ids, attention_mask=None, *, reuse: bool = False) -> torch.Tensor:
        """Feed a prompt; returns the float32 ``[batch, vocab]`` logits of its last position.

        Without ``reuse`` the cache is emptied first. With ``reuse`` (batch 1, no padding) the
        cache keeps the longest common prefix of what it holds and ``input_ids``, and only the
        rest is computed (``self.prefilled`` says how many tokens were)."""
        ids = torch.as_tensor(input_ids, dtype=torch.long)
        if ids.ndim == 1:
            ids = ids[None]
        if ids.shape[0] != self.batch:
            raise UsageError(f"this decode loop has {self.batch} rows; the prompt has {ids.shape[0]}")
        n = int(ids.shape[1])
        if n < 1:
            raise UsageError("the prompt is empty")
        if attention_mask is not None:
            attention_mask = torch.as_tensor(attention_mask).to(device=self.device, dtype=torch.long)
        padded = attention_mask is not None and not bool((attention_mask == 1).all())
        keep = 0
        if reuse:
            if padded or self.batch != 1:
                raise UsageError("reusing the cache needs one row without padding")
            # a cache filled from a padded prompt is not reused (its positions are not 0..n-1)
            keep = common_prefix(self.tokens[0], ids[0].tolist()) if self._mask is None else 0
            keep = min(keep, n - 1)  # always compute at least the last token: its logits start the answer
        if n > self.context:
            raise ContextFull(f"the conversation is {n} tokens; the KV cache holds {self.context} "
                              "(use /reset, or a larger --context)")
        self._crop(keep) if reuse else self.reset()
        self._room(n, fresh=keep == 0)
        ids = ids.to(self.device)
        new = ids[:, keep:]
        if keep == 0:
            # as generate: positions from the mask's cumulative sum; the mask dropped when it has no padding
            if padded:
                pos = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
                mask = attention_mask
            else:
                pos = torch.arange(n, dtype=torch.long, device=self.device)[None].expand(self.batch, n)
                mask = None
        else:
            pos = torch.arange(keep, n, dtype=torch.long, device=self.device)[None]
            mask = None
        logits = self._run(new.contiguous(), pos.contiguous(), mask, single=False)
        self.prefilled = n - keep
        self.reused = keep
        self._mask = mask
        self._pos = pos[:, -1:]
        host = ids.tolist()
        self.tokens = [row[:] for row in host]
        return logits

    @torch.inference_mode()
    def step(self, token_ids) -> torch.Tensor:
        """Feed one new token per row (``[batch]`` or ``[batch, 1]``); returns the float32
        ``[batch, vocab]`` logits of the next position."""
        if self.length >= self.context:
            raise ContextFull(f"the KV cache is full ({self.context} tokens; use /reset, or a larger --context)")
        if self._pos is None:
            raise UsageError("step() before prefill()")
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device).reshape(self.batch, 1)
        self._room(self.length + 1)
        pos = self._pos + 1
        mask = self._mask
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones((self.batch, 1))], dim=-1)
        logits = self._run(ids, pos, mask, single=True)
        self._pos = pos
        self._mask = mask
        host = ids.reshape(-1).tolist()
        for row, t in zip(self.tokens, host):
            row.append(t)
        return logits

    # ---------------------------------------------------------------- generate
    @torch.inference_mode()
    def generate(self, input_ids, attention_mask=None, *, max_new_tokens: int = 256, do_sample=None,
                 temperature=None, top_p=None, top_k=None, seed: int | None = None, reuse: bool = False,
                 on_token=None, keep_logits: bool = False, min_new_tokens: int = 0, generation_kwargs=None,
                 stop_when=None, forced=None) -> GenerateResult:
        """Prefill then decode up to ``max_new_tokens`` tokens per row, as ``model.generate`` would
        with a static cache and the same settings (greedy when the generation config says so).

        ``on_token(ids: list[int])`` is called with each step's new ids (one per row) as soon as
        they are known; raising KeyboardInterrupt from it (or Ctrl-C) stops the answer and keeps
        what came so far. Stops at end-of-sequence (every row), at ``max_new_tokens`` or when the
        cache is full (``stop`` = ``"context"``). The last token is not fed through the model (as
        in ``generate``): ``self.tokens`` then holds the prompt and every new token but the last.
        ``stop_when(n)``, called after the ``n``-th new token, ends the answer when it returns
        True (``stop`` = ``"stop_when"``; a time limit, say). ``generation_kwargs``: further
        ``GenerationConfig`` fields (``pad_token_id``, ``repetition_penalty``, ...). ``forced``:
        teacher forcing, ``[batch, n]`` token ids (a tensor, lists, or a ``ForcedTokens``, to
        read its ``argmax_tokens()`` afterwards): step ``i``'s token is
        ``forced[:, i]`` whatever the logits say (:class:`~zipmoe.runtime.engine.sampling.ForcedTokens`,
        after the generation config's processors, as ``model.generate(logits_processor=...)``
        runs it); the logits are the model's own.
        """
        if max_new_tokens < 1:
            raise UsageError("max_new_tokens must be at least 1")
        extra = dict(generation_kwargs or {})
        given = dict(do_sample=do_sample, temperature=temperature, top_p=top_p, top_k=top_k)
        given.update({k: extra.pop(k) for k in list(given) if k in extra and given[k] is None})
        cfg = generation_config(self.model, **given, max_new_tokens=int(max_new_tokens),
                                min_new_tokens=int(min_new_tokens), **extra)
        ids = torch.as_tensor(input_ids, dtype=torch.long)
        if ids.ndim == 1:
            ids = ids[None]
        procs = None
        if forced is not None:
            procs = [forced if isinstance(forced, ForcedTokens) else ForcedTokens(forced, prompt_len=int(ids.shape[1]))]
        sampler = Sampler(self.model, cfg, prompt_len=int(ids.shape[1]), batch=self.batch, device=self.device,
                          logits_processor=procs)
        if seed is not None:
            torch.manual_seed(seed)
        res = GenerateResult(tokens=[[] for _ in range(self.batch)])
        unfinished = torch.ones(self.batch, dtype=torch.long, device=self.device)
        eos_t = torch.tensor(sampler.eos, dtype=torch.long, device=self.device) if sampler.eos else None
        seq = None  # the whole sequence (prompt + new), only when a processor needs it
        t0 = time.perf_counter()
        t_first = None
        try:
            logits = self.prefill(ids, attention_mask, reuse=reuse)
            t_prefill = time.perf_counter()
            if sampler.needs_ids:
                seq = ids.to(self.device)
            n = 0
            while True:
                if keep_logits:
                    res.logits.append(logits)
                nxt = sampler(logits, seq)
                if eos_t is not None:
                    nxt = nxt * unfinished + sampler.pad * (1 - unfinished)
                host = nxt.tolist()
                now = time.perf_counter()
                if t_first is None:
                    t_first = now
                res.times.append(now)
                live = unfinished.tolist()
                for row, t, alive in zip(res.tokens, host, live):
                    if alive:
                        row.append(t)
                n += 1
                if seq is not None:
                    seq = torch.cat([seq, nxt[:, None]], dim=-1)
                if eos_t is not None:
                    unfinished = unfinished & ~torch.isin(nxt, eos_t)
                if on_token is not None:
                    on_token(host)
                reason = finish_reason(eos=eos_t is not None and not bool(unfinished.any()), new_tokens=n,
                                       max_new_tokens=max_new_tokens, room=self.context - self.length,
                                       stop_when=stop_when)
                if reason is not None:
                    res.stop = reason
                    break
                logits = self.step(nxt)
        except KeyboardInterrupt:
            res.interrupted = True
            res.stop = "interrupted"
            t_prefill = locals().get("t_prefill", time.perf_counter())
        t_end = time.perf_counter()
        count = len(res.times)
        res.stats = {
            "ttft_s": (t_first - t0) if t_first is not None else None,
            "tpot_s": ((res.times[-1] - res.times[0]) / (count - 1)) if count > 1 else None,
            "prefill_s": t_prefill - t0,
            "prefill_tokens": getattr(self, "prefilled", 0),
            "reused_tokens": getattr(self, "reused", 0),
            "steps": max(0, count - 1),
            "total_s": t_end - t0,
            "stop": res.stop,
            "graphed": self.graphed is not None,
            "kv_columns": self.columns,
        }
        return res


@torch.inference_mode()
def generate_ids(model, input_ids, attention_mask=None, *, max_new_tokens: int, min_new_tokens: int = 0,
                 do_sample: bool = False, streamer=None, pad_token_id=None, forced=None, **generation_kwargs) -> torch.Tensor:
    """``model.generate(...)``'s common keywords on the runtime's decode loop: the sequences
    ``[batch, prompt + new]`` (finished rows padded), the streamer fed as ``generate`` feeds it
    (the prompt, then each step's new ids, then ``end()``). The loop (and its cache) is kept in
    the runtime's ``loops`` (``model.zipmoe.loops``, per batch size) and reused while the
    context it needs fits (a model without a runtime gets a loop per call); for the planner's
    and tools' served passes, which then time what serving runs. Encoder-decoder models run
    ``model.generate`` itself. ``forced``: teacher forcing (``DecodeLoop.generate``'s)."""
    if getattr(model.config, "is_encoder_decoder", False):
        kw = dict(generation_kwargs)
        if pad_token_id is not None:
            kw["pad_token_id"] = pad_token_id
        if forced is not None:
            from transformers import LogitsProcessorList

            kw["logits_processor"] = LogitsProcessorList([forced if isinstance(forced, ForcedTokens) else ForcedTokens(forced)])
        return model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                              min_new_tokens=min_new_tokens, do_sample=do_sample, streamer=streamer, **kw)
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.ndim == 1:
        ids = ids[None]
    batch, need = int(ids.shape[0]), int(ids.shape[1]) + int(max_new_tokens)
    rt = getattr(model, "zipmoe", None)
    loops = rt.loops if rt is not None else {}
    loop = loops.get(batch)
    if loop is None or loop.context < need:
        loops.pop(batch, None)
        loop = DecodeLoop(model, context=max(256, -(-need // 256) * 256), batch=batch)
        loops[batch] = loop
    if streamer is not None:
        streamer.put(ids.cpu())
    kw = dict(generation_kwargs)
    if pad_token_id is not None:
        kw["pad_token_id"] = pad_token_id
    on_token = (lambda host: streamer.put(torch.tensor(host))) if streamer is not None else None
    res = loop.generate(ids, attention_mask, max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
                        do_sample=do_sample, on_token=on_token, generation_kwargs=kw, forced=forced)
    if streamer is not None:
        streamer.end()
    if res.interrupted:
        raise KeyboardInterrupt
    width = max(len(t) for t in res.tokens)
    pad = int(pad_token_id if pad_token_id is not None else (eos_ids(model.generation_config) or [0])[0])
    new = torch.tensor([t + [pad] * (width - len(t)) for t in res.tokens], dtype=torch.long)
    return torch.cat([ids.cpu(), new], dim=-1).to(ids.device)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _forward_params(model) -> set:
    import inspect

    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()
