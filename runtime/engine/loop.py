"""zipmoe's own decode loop: a static KV cache allocated once, one forward per step, no
``model.generate`` machinery between the steps.

:class:`DecodeLoop` holds a transformers ``StaticCache`` of ``[batch, context]`` positions per
layer, allocated when the loop is made and reused by every turn and request (``reset()``
empties it without freeing anything). A turn is :meth:`DecodeLoop.prefill` (the prompt, or only
the part of it that the cache does not hold yet) then :meth:`DecodeLoop.step` per new token;
:meth:`DecodeLoop.generate` runs both with sampling, stopping and streaming.

Bit identity. Logits are ``torch.equal`` to transformers computing the same checkpoint with the
same kernels and the same cache implementation: ``from_pretrained(..., experts_implementation=
"eager").generate(..., cache_implementation="static")`` (or a ``StaticCache`` passed to it). The
loop builds the model's inputs exactly as ``generate`` does for a static cache: position ids
from the attention mask's cumulative sum, the 2-D mask dropped when it holds no padding (at the
first prefill of the cache), ``logits_to_keep=1``, the last position's logits copied to float32,
the same logits processors (``model._get_logits_processor`` for the same generation config),
``argmax`` or ``softmax`` + ``multinomial`` for the next token, finished rows padded with the
pad token. A dynamic cache (what plain ``model.generate`` uses) gives different bits in the
attention over the cache, so the static cache is part of the reference.

Multi-turn: :meth:`DecodeLoop.prefill` with ``reuse=True`` (batch 1) keeps the longest common
prefix of the token ids the cache holds (``loop.tokens``) and the new prompt, crops the cache
to it (a static cache is cropped by moving its length back: the positions past it are
overwritten by the next update; the causal mask, built from the cache's length, never lets a
query see them) and prefills only the rest. At least one token is always fed, so a prompt that
the cache holds entirely recomputes its last token. A prompt plus answer that does not fit the
cache raises :class:`ContextFull` (a :class:`zipmoe.errors.UsageError`: one line for the user).

The interface to the CUDA graphs (``runtime/engine/graphs.py``, by the CUDA side):

- ``graphs.supported(model, batch: int) -> bool``: whether a graphed step exists for this model
  on this device at this batch size. Never raises.
- ``graphs.GraphedStep(model, cache, batch=batch)``: built once per loop after the cache is
  allocated (``cache`` is this loop's ``StaticCache``, its tensors made once and never
  reallocated; crops and resets move its device-side ``cumulative_length`` in place).
  ``step(input_ids, cache_position, attention_mask=None) -> logits`` runs one new token per
  row: ``input_ids`` ``[batch, 1]`` int64 on the model's device, ``cache_position`` a 1-element
  int64 tensor, the position in the cache the new token goes to (``loop.length``), and
  ``attention_mask`` None (the loop passes graphs only steps without padding; a padded batch's
  steps run eagerly, since their position ids come from the mask as ``generate`` makes them).
  It returns the logits of the new position (``[batch, vocab]`` or ``[batch, 1, vocab]``),
  ``torch.equal`` to the eager :meth:`DecodeLoop.forward`, with the cache updated in place by
  one position, as the eager forward updates it.
- The loop uses it for :meth:`step` only (prefill stays eager), when ``graphs`` is ``True`` or
  ``"auto"``, the device is CUDA and ``supported`` says yes; ``graphs=True`` where it is not
  available raises a UsageError, ``"auto"`` falls back to the eager forward silently, and
  ``loop.graphed`` tells which one runs. Without ``graphs.py`` everything works eagerly.

(transformers 5 has no ``cache_position`` argument any more: the static cache keeps its own
length, so the eager :meth:`forward` takes position ids and the mask; ``cache_position`` is
only what the graphed step is told about where the token goes.)
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field

import torch

from zipmoe.errors import UsageError
from zipmoe.runtime.engine.hf_compat import cache_kw, crop

__all__ = ["DEFAULT_CONTEXT", "ContextFull", "DecodeLoop", "GenerateResult", "common_prefix", "kv_cache_bytes",
           "loop_generate", "model_max_context"]

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


def model_max_context(config) -> int | None:
    """The model's own limit on positions (``max_position_embeddings``), None when it has none."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        v = getattr(cfg, key, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def _kv_shapes(config) -> list[tuple[int, int, int]] | None:
    """(kv heads, key head dim, value head dim) per decoder layer, from the config; None when
    the config does not say (the cache then allocates itself at the first forward)."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layers = getattr(cfg, "num_hidden_layers", None)
    heads = getattr(cfg, "num_attention_heads", None)
    if not isinstance(layers, int) or not isinstance(heads, int):
        return None
    if getattr(cfg, "kv_lora_rank", None) and getattr(cfg, "qk_rope_head_dim", None):
        # DeepSeek's multi-head latent attention caches the compressed latent (one head of
        # kv_lora_rank) as keys and the rotary part (one head of qk_rope_head_dim) as values
        return [(1, int(cfg.kv_lora_rank), int(cfg.qk_rope_head_dim))] * layers
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    hd = getattr(cfg, "head_dim", None) or (cfg.hidden_size // heads)
    return [(int(kv), int(hd), int(hd))] * layers


def kv_cache_bytes(config, *, batch: int, context: int, dtype: torch.dtype) -> int | None:
    """Bytes of the static KV cache of ``batch`` rows of ``context`` positions (keys and values
    of every layer; a sliding-window layer holds its window only)."""
    from transformers import StaticCache

    shapes = _kv_shapes(config)
    if shapes is None:
        return None
    cache = StaticCache(config=config, max_cache_len=context)
    item = torch.empty((), dtype=dtype).element_size()
    total = 0
    for layer, (heads, kd, vd) in zip(cache.layers, shapes):
        total += batch * heads * int(layer.max_cache_len) * (kd + vd) * item
    return total


def _eos_ids(gen_config) -> list[int]:
    eos = getattr(gen_config, "eos_token_id", None)
    if eos is None:
        return []
    if isinstance(eos, torch.Tensor):
        return [int(x) for x in eos.reshape(-1).tolist()]
    return [int(eos)] if isinstance(eos, int) else [int(x) for x in eos]


class DecodeLoop:
    """A static KV cache and the decode loop over it, for one model.

    ``context``: positions the cache holds per row (clamped to the model's
    ``max_position_embeddings``; ``clamped`` says so). ``batch``: rows (fixed for the loop's
    life; a prompt of fewer rows is refused). ``graphs``: ``"auto"`` | ``True`` | ``False``,
    see the module docstring.
    """

    def __init__(self, model, *, context: int = DEFAULT_CONTEXT, batch: int = 1, graphs="auto") -> None:
        from transformers import StaticCache

        if getattr(model.config, "is_encoder_decoder", False):
            raise UsageError(f"{model.config.model_type} is an encoder-decoder model: the decode loop serves "
                             "decoder-only models (use model.generate)")
        if int(context) < 2:
            raise UsageError("--context must be at least 2 tokens")
        if int(batch) < 1:
            raise UsageError("batch must be at least 1")
        self.model = model
        self.config = model.config
        limit = model_max_context(model.config)
        self.requested_context = int(context)
        self.context = min(int(context), limit) if limit else int(context)
        self.clamped = self.context < self.requested_context
        self.batch = int(batch)
        rt = getattr(model, "zipmoe", None)
        self.device = rt.device if rt is not None else next(p for p in model.parameters() if p.device.type != "meta").device
        self.dtype = model.dtype
        self.cache = StaticCache(config=model.config, max_cache_len=self.context)
        self.kv_bytes = None
        shapes = _kv_shapes(model.config)
        if shapes is not None and len(shapes) == len(self.cache.layers):
            for layer, (heads, kd, vd) in zip(self.cache.layers, shapes):
                k = torch.zeros((self.batch, heads, 0, kd), dtype=self.dtype, device=self.device)
                v = torch.zeros((self.batch, heads, 0, vd), dtype=self.dtype, device=self.device)
                layer.lazy_initialization(k, v)
            self.kv_bytes = self._allocated_bytes()
        self.tokens: list[list[int]] = [[] for _ in range(self.batch)]  # ids whose K/V the cache holds
        self._mask: torch.Tensor | None = None  # 2-D mask of the cached positions, None = no padding
        self._pos: torch.Tensor | None = None  # [batch, 1] position id of the last cached token
        self._keep = "logits_to_keep" in _forward_params(model)
        self.graphed = None
        self._setup_graphs(graphs)

    # ---------------------------------------------------------------- cache
    def _allocated_bytes(self) -> int:
        total = 0
        for layer in self.cache.layers:
            if getattr(layer, "is_initialized", False):
                total += layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
        return total

    @property
    def length(self) -> int:
        """Positions the cache holds (the same for every row)."""
        return len(self.tokens[0])

    @property
    def next_positions(self) -> torch.Tensor:
        """``[batch]`` position id of each row's next token (after a prefill)."""
        return self._pos.reshape(-1) + 1

    def reset(self) -> None:
        """Forget the cached positions (the tensors stay allocated)."""
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
    def _setup_graphs(self, graphs) -> None:
        if graphs is False or graphs is None or graphs == "off":
            return
        if graphs not in (True, "auto", "on"):
            raise UsageError(f"graphs must be True, False or 'auto', not {graphs!r}")
        want = graphs in (True, "on")
        mod = None
        if self.device.type == "cuda":
            try:
                from zipmoe.runtime.engine import graphs as mod  # written beside this module (CUDA graphs)
            except ImportError:
                mod = None
        ok = False
        if mod is not None:
            try:
                ok = bool(mod.supported(self.model, self.batch))
            except Exception:
                ok = False
        if ok:
            self.graphed = mod.GraphedStep(self.model, self.cache, batch=self.batch)
        elif want:
            raise UsageError(f"CUDA graphs are not available for this model at batch {self.batch} on {self.device} "
                             "(use graphs='auto' to fall back to eager steps)")

    # ---------------------------------------------------------------- forward
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask=None) -> torch.Tensor:
        """One forward over the cache: ``[batch, n]`` new ids at ``position_ids`` -> ``[batch, vocab]``
        logits of the last new position (model dtype). The one place a step's compute runs;
        subclasses or the CUDA graphs replace it."""
        kw = {"logits_to_keep": 1} if self._keep else {}
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=True, **{cache_kw(self.model): self.cache}, **kw)
        return out.logits[:, -1]

    def _run(self, ids: torch.Tensor, pos: torch.Tensor, mask, single: bool) -> torch.Tensor:
        try:
            if single and self.graphed is not None and mask is None:
                where = torch.tensor([self.length], dtype=torch.long, device=self.device)
                logits = self.graphed(ids, where, None)
                if logits.ndim == 3:
                    logits = logits[:, -1]
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

    def step(self, token_ids) -> torch.Tensor:
        """Feed one new token per row (``[batch]`` or ``[batch, 1]``); returns the float32
        ``[batch, vocab]`` logits of the next position."""
        if self.length >= self.context:
            raise ContextFull(f"the KV cache is full ({self.context} tokens; use /reset, or a larger --context)")
        if self._pos is None:
            raise UsageError("step() before prefill()")
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device).reshape(self.batch, 1)
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

    # ---------------------------------------------------------------- sampling
    def generation_config(self, *, do_sample=None, temperature=None, top_p=None, top_k=None, **extra):
        """The generation config ``model.generate`` would use for the same arguments."""
        kw = dict(extra)
        if do_sample is not None:
            kw["do_sample"] = bool(do_sample)
        if temperature is not None:
            kw["temperature"] = temperature
        if top_p is not None:
            kw["top_p"] = top_p
        if top_k is not None:
            kw["top_k"] = top_k
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg, _ = self.model._prepare_generation_config(None, **kw)
        return cfg

    def _processors(self, cfg, prompt_len: int):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.model._prepare_special_tokens(cfg, True, device=self.device, batch_size=self.batch)
            return self.model._get_logits_processor(generation_config=cfg, input_ids_seq_length=prompt_len,
                                                    encoder_input_ids=None, prefix_allowed_tokens_fn=None,
                                                    logits_processor=None, device=self.device, model_kwargs={})

    def generate(self, input_ids, attention_mask=None, *, max_new_tokens: int = 256, do_sample=None,
                 temperature=None, top_p=None, top_k=None, seed: int | None = None, reuse: bool = False,
                 on_token=None, keep_logits: bool = False, min_new_tokens: int = 0, generation_kwargs=None,
                 stop_when=None) -> GenerateResult:
        """Prefill then decode up to ``max_new_tokens`` tokens per row, as ``model.generate`` would
        with a static cache and the same settings (greedy when the generation config says so).

        ``on_token(ids: list[int])`` is called with each step's new ids (one per row) as soon as
        they are known; raising KeyboardInterrupt from it (or Ctrl-C) stops the answer and keeps
        what came so far. Stops at end-of-sequence (every row), at ``max_new_tokens`` or when the
        cache is full (``stop`` = ``"context"``). The last token is not fed through the model (as
        in ``generate``): ``self.tokens`` then holds the prompt and every new token but the last.
        ``stop_when(n)``, called after the ``n``-th new token, ends the answer when it returns
        True (``stop`` = ``"stop_when"``; a time limit, say). ``generation_kwargs``: further
        ``GenerationConfig`` fields (``pad_token_id``, ``repetition_penalty``, ...).
        """
        if max_new_tokens < 1:
            raise UsageError("max_new_tokens must be at least 1")
        extra = dict(generation_kwargs or {})
        given = dict(do_sample=do_sample, temperature=temperature, top_p=top_p, top_k=top_k)
        given.update({k: extra.pop(k) for k in list(given) if k in extra and given[k] is None})
        cfg = self.generation_config(**given, max_new_tokens=int(max_new_tokens), min_new_tokens=int(min_new_tokens),
                                     **extra)
        ids = torch.as_tensor(input_ids, dtype=torch.long)
        if ids.ndim == 1:
            ids = ids[None]
        processors = self._processors(cfg, int(ids.shape[1]))
        eos = _eos_ids(cfg)
        pad = cfg._pad_token_tensor
        sample = bool(cfg.do_sample)
        if seed is not None:
            torch.manual_seed(seed)
        res = GenerateResult(tokens=[[] for _ in range(self.batch)])
        unfinished = torch.ones(self.batch, dtype=torch.long, device=self.device)
        eos_t = torch.tensor(eos, dtype=torch.long, device=self.device) if eos else None
        seq = None  # the whole sequence (prompt + new), only when a processor needs it
        t0 = time.perf_counter()
        t_first = None
        try:
            logits = self.prefill(ids, attention_mask, reuse=reuse)
            t_prefill = time.perf_counter()
            if processors:
                seq = ids.to(self.device)
            n = 0
            while True:
                scores = processors(seq, logits) if processors else logits
                if keep_logits:
                    res.logits.append(logits)
                if sample:
                    probs = torch.nn.functional.softmax(scores, dim=-1)
                    nxt = torch.multinomial(probs, num_samples=1).squeeze(1)
                else:
                    nxt = torch.argmax(scores, dim=-1)
                if eos_t is not None:
                    nxt = nxt * unfinished + pad * (1 - unfinished)
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
                if eos_t is not None and not bool(unfinished.any()):
                    res.stop = "eos"
                    break
                if n >= max_new_tokens:
                    res.stop = "max_new_tokens"
                    break
                if stop_when is not None and stop_when(n):
                    res.stop = "stop_when"
                    break
                if self.length >= self.context:
                    res.stop = "context"
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
        }
        return res


def loop_generate(model, input_ids, attention_mask=None, *, max_new_tokens: int, min_new_tokens: int = 0,
                  do_sample: bool = False, streamer=None, pad_token_id=None, **generation_kwargs) -> torch.Tensor:
    """``model.generate(...)``'s common keywords on the decode loop: the sequences ``[batch,
    prompt + new]`` (finished rows padded), the streamer fed as ``generate`` feeds it (the
    prompt, then each step's new ids, then ``end()``). The loop (and its cache) is kept on the
    model per batch size and reused while the context it needs fits; for the planner's and
    tools' served passes, which then time what serving runs. Encoder-decoder models run
    ``model.generate`` itself."""
    if getattr(model.config, "is_encoder_decoder", False):
        kw = dict(generation_kwargs)
        if pad_token_id is not None:
            kw["pad_token_id"] = pad_token_id
        return model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                              min_new_tokens=min_new_tokens, do_sample=do_sample, streamer=streamer, **kw)
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.ndim == 1:
        ids = ids[None]
    batch, need = int(ids.shape[0]), int(ids.shape[1]) + int(max_new_tokens)
    loops = model.__dict__.setdefault("_zipmoe_loops", {})
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
                        do_sample=do_sample, on_token=on_token, generation_kwargs=kw)
    if streamer is not None:
        streamer.end()
    if res.interrupted:
        raise KeyboardInterrupt
    width = max(len(t) for t in res.tokens)
    pad = int(pad_token_id if pad_token_id is not None else (_eos_ids(loop.generation_config()) or [0])[0])
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
