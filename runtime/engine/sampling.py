"""Choosing the next token and deciding when an answer ends: one module for chat, the decode
loop (:meth:`zipmoe.runtime.engine.loop.DecodeLoop.generate`) and the HTTP server's rows.

The reference is transformers' ``generate``: :func:`generation_config` is the generation config
``model.generate`` would use for the same arguments (the model's ``generation_config`` under
them, transformers' defaults under that: ``top_k=50`` when sampling), and a :class:`Sampler`
picks tokens as ``generate`` does for it: the logits processors ``generate`` builds
(``model._get_logits_processor``: repetition penalty, ``min_new_tokens``' end-of-sequence mask,
temperature, top-k, top-p, ...), then ``argmax`` (greedy) or ``softmax`` + ``multinomial``.
With the same seed (``torch.manual_seed``, or a generator seeded alike) the tokens are
``generate``'s. :func:`sampling_kwargs` turns a command line's or a request's greedy /
temperature / top-p into the generation config's fields, the same way for chat and the server.

:func:`eos_ids` reads the end-of-sequence ids wherever they are given (a generation config, a
model config, a tokenizer, a config.json dict); :func:`finish_reason` says why an answer ends
after a token (end of sequence, the token limit, a caller's test, no room left in the context).

:class:`ForcedTokens` is teacher forcing as a logits processor: step ``i``'s token is
``forced[:, i]`` whatever the logits say (the benchmark's and the calibration's ``corpus``
workload, runtime/plan/workload.py). It goes into ``model.generate(logits_processor=
LogitsProcessorList([ForcedTokens(f)]))`` and into the decode loop (``DecodeLoop.generate(...,
forced=f)``, which passes it to :class:`Sampler`), so every engine decodes the same stream; it
changes the chosen token only, never the logits.
"""

from __future__ import annotations

import warnings

import torch

__all__ = ["ForcedTokens", "Sampler", "eos_ids", "finish_reason", "generation_config", "sampling_kwargs"]


def _scores_only() -> tuple:
    """The processors that never read the sequence so far, only the scores (the warpers)."""
    from transformers.generation import logits_process as lp

    return (lp.TemperatureLogitsWarper, lp.TopKLogitsWarper, lp.TopPLogitsWarper, lp.MinPLogitsWarper,
            lp.TypicalLogitsWarper)


def _as_ids(v) -> list[int]:
    if v is None:
        return []
    if hasattr(v, "tolist"):  # a tensor
        v = v.tolist()
    if isinstance(v, int) and not isinstance(v, bool):
        return [v]
    if isinstance(v, (list, tuple)):
        return [int(x) for x in v if isinstance(x, int) and not isinstance(x, bool)]
    return []


def eos_ids(*sources) -> list[int]:
    """The end-of-sequence ids (``eos_token_id``: an int, a list or a tensor) of the first of
    ``sources`` that names any: generation configs, model configs, tokenizers, config.json or
    generation_config.json dicts; None entries are skipped. ``[]`` when none does."""
    for src in sources:
        if src is None:
            continue
        v = src.get("eos_token_id") if isinstance(src, dict) else getattr(src, "eos_token_id", None)
        ids = _as_ids(v)
        if ids:
            return ids
    return []


def sampling_kwargs(*, greedy: bool = False, temperature: float | None = None, top_p: float | None = None) -> dict:
    """The generation config's sampling fields for greedy / temperature / top-p as chat's
    command line and the server's requests give them: greedy (``do_sample=False``) when asked,
    or at temperature 0; otherwise sampling, with the temperature and top-p given (the model's
    own where None; greedy names the sampling fields None, which ``model.generate`` then does not
    warn about and :func:`generation_config` leaves as they are)."""
    if greedy or (temperature is not None and temperature <= 0):
        return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    kw: dict = {"do_sample": True}
    if temperature is not None:
        kw["temperature"] = float(temperature)
    if top_p is not None:
        kw["top_p"] = float(top_p)
    return kw


def generation_config(model, *, do_sample=None, temperature=None, top_p=None, top_k=None, **extra):
    """The generation config ``model.generate`` would use for the same arguments (None: not given)."""
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
        cfg, _ = model._prepare_generation_config(None, **kw)
    return cfg


class ForcedTokens:
    """A logits processor that makes step ``i``'s token ``forced[:, i]`` (``forced``: ``[batch, n]``
    ids): every score is ``-inf`` but that id's, which is 0 (so argmax and sampling both pick it,
    and a processor before it that masked the id, ``min_new_tokens``' end-of-sequence mask say,
    cannot change that). Steps past ``n`` are left alone.

    The step is counted from the sequences it is given: the first call's length is the prompt's
    (``generate`` and the decode loop both pass the prompt plus the new tokens so far); called
    without sequences it counts its calls. One instance per generation. ``keep_argmax``: keep
    each forced step's argmax of the scores it was given (what greedy decoding would have chosen
    there, ``argmax_tokens()``): engines fed the same stream are compared on these."""

    def __init__(self, forced, prompt_len: int | None = None, keep_argmax: bool = False) -> None:
        f = torch.as_tensor(forced, dtype=torch.long)
        if f.ndim == 1:
            f = f[None]
        if f.ndim != 2 or f.shape[1] < 1:
            raise ValueError("forced must be [batch, steps] token ids")
        self.forced = f
        self.start = prompt_len
        self.calls = 0
        self.keep_argmax = bool(keep_argmax)
        self._argmax: list = []

    @property
    def steps(self) -> int:
        return int(self.forced.shape[1])

    def __call__(self, input_ids, scores: torch.Tensor) -> torch.Tensor:
        if input_ids is not None:
            if self.start is None:
                self.start = int(input_ids.shape[-1])
            step = int(input_ids.shape[-1]) - self.start
        else:
            step = self.calls
        self.calls += 1
        if step < 0 or step >= self.steps:
            return scores
        if self.forced.device != scores.device:
            self.forced = self.forced.to(scores.device)
        col = self.forced[:, step]
        if col.shape[0] != scores.shape[0]:
            raise ValueError(f"forced tokens have {col.shape[0]} rows; the batch has {scores.shape[0]}")
        if self.keep_argmax:
            self._argmax.append(torch.argmax(scores, dim=-1))
        out = torch.full_like(scores, float("-inf"))
        out.scatter_(1, col[:, None], 0.0)
        return out

    def argmax_tokens(self) -> list:
        """Per row, the argmax of the scores at each forced step so far (with ``keep_argmax``)."""
        if not self._argmax:
            return [[] for _ in range(self.forced.shape[0])]
        return torch.stack(self._argmax, dim=1).tolist()


class Sampler:
    """How one generation picks its next tokens (``batch`` rows, a prompt of ``prompt_len``
    positions), as ``model.generate`` picks them for the generation config ``cfg``.

    ``eos`` (the config's end-of-sequence ids) and ``pad`` (the token finished rows get, a
    tensor or None) are ``generate``'s; ``needs_ids``: whether the processors read the sequence
    so far (pass it to :meth:`__call__` then). ``logits_processor``: more processors (a
    :class:`ForcedTokens`, say), run after generate's own, as ``generate(logits_processor=...)``
    runs them."""

    def __init__(self, model, cfg, *, prompt_len: int, batch: int = 1, device=None, logits_processor=None) -> None:
        self.config = cfg
        custom = None
        if logits_processor:  # after generate's own, as generate(logits_processor=...) puts them
            from transformers.generation.logits_process import LogitsProcessorList

            custom = LogitsProcessorList(list(logits_processor))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model._prepare_special_tokens(cfg, True, device=device, batch_size=batch)
            self.processors = model._get_logits_processor(
                generation_config=cfg, input_ids_seq_length=int(prompt_len), encoder_input_ids=None,
                prefix_allowed_tokens_fn=None, logits_processor=custom, device=device, model_kwargs={})
        self.do_sample = bool(cfg.do_sample)
        self.eos = eos_ids(cfg)
        self.pad = cfg._pad_token_tensor
        scores_only = _scores_only()
        self.needs_ids = any(type(p) not in scores_only for p in self.processors)

    def __call__(self, logits: torch.Tensor, ids: torch.Tensor | None = None, generator=None) -> torch.Tensor:
        """The next token of each row (``[rows]`` int64) from the float32 ``[rows, vocab]``
        logits; ``ids``: the ``[rows, length]`` sequences so far (prompt and new tokens), when
        :attr:`needs_ids`; ``generator``: the random generator (None: torch's global one, as
        ``generate`` uses)."""
        scores = self.processors(ids, logits) if self.processors else logits
        if self.do_sample:
            probs = torch.nn.functional.softmax(scores, dim=-1)
            return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)
        return torch.argmax(scores, dim=-1)


def finish_reason(*, eos: bool, new_tokens: int, max_new_tokens: int, room: int, stop_when=None) -> str | None:
    """Why an answer ends once its ``new_tokens``-th token is known, or None when it goes on:
    ``"eos"`` (it ended with an end-of-sequence token), ``"max_new_tokens"``, ``"stop_when"``
    (``stop_when(new_tokens)`` returned True: a time limit, say) or ``"context"`` (``room``, the
    positions the context has left for the next step in the caller's accounting, is 0)."""
    if eos:
        return "eos"
    if new_tokens >= max_new_tokens:
        return "max_new_tokens"
    if stop_when is not None and stop_when(new_tokens):
        return "stop_when"
    if room <= 0:
        return "context"
    return None
