"""One chat turn, text in and text out: prompt from the chat template, tokens streamed as they
come, timing and counters.

:func:`chat_inputs` builds the model inputs of a conversation (``[{"role", "content"}, ...]``)
with the tokenizer's chat template (a plain ``role: text`` transcript when the tokenizer has
none). :func:`chat_turn` runs the turn on zipmoe's decode loop
(:class:`zipmoe.runtime.engine.loop.DecodeLoop`, a static KV cache): pass ``loop=`` to keep the
conversation's cache across turns (``reuse=True`` prefills only what the cache does not hold
yet); without one, a loop sized for this turn is made. Encoder-decoder models, which have no
decode loop, run ``model.generate``. Sampling is :mod:`zipmoe.runtime.engine.sampling`'s (as
the server's). The text of the new tokens is handed to a callback as it grows; Ctrl-C
(KeyboardInterrupt) stops the answer and the tokens so far are returned (``interrupted=True``).

Stats of a turn (``TurnResult.stats``, also what ``chat --json`` prints):
``ttft_s`` (start to first new token, the prefill), ``tpot_s`` (mean time per output token
after the first), ``tokens_per_s`` (new tokens / total time), ``new_tokens``, ``prompt_tokens``
(the whole rendered prompt), ``prefill_tokens`` (tokens computed by this turn's prefill: the
prompt less what the KV cache already held), ``stop`` (``eos``, ``max_new_tokens``,
``context``: the KV cache is full, or ``interrupted``), ``bytes_read``, ``bytes_read_disk``,
``hits`` (per pool and ``none``), ``hit_rate`` (share of expert-tensor accesses served from the
full pool), ``time_s`` per stage and ``peak_held_bytes``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from zipmoe.runtime.engine.counters import delta
from zipmoe.runtime.engine.sampling import sampling_kwargs

__all__ = ["TurnResult", "chat_inputs", "chat_turn", "turn_on_generate"]


@dataclass
class TurnResult:
    token_ids: list
    text: str
    stats: dict
    interrupted: bool = False
    times: list = field(default_factory=list)


class _Streamer:
    """transformers' streamer protocol (put/end); the first put is the prompt."""

    def __init__(self, tokenizer, on_text) -> None:
        self.tokenizer = tokenizer
        self.on_text = on_text
        self.ids: list[int] = []
        self.times: list[float] = []
        self._prompt_seen = False
        self._printed = ""

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        now = time.perf_counter()
        toks = value.reshape(-1).tolist()
        self.ids.extend(toks)
        self.times.extend([now] * len(toks))
        self._emit(final=False)

    def end(self) -> None:
        self._emit(final=True)

    def text(self) -> str:
        if self.tokenizer is None:
            return " ".join(map(str, self.ids))
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def _emit(self, final: bool) -> None:
        if self.on_text is None:
            return
        text = self.text()
        if not final and text.endswith("\ufffd"):  # an incomplete multi-byte character
            return
        if text.startswith(self._printed):
            new = text[len(self._printed):]
        else:  # the decoder rewrote earlier text (rare): print what changed from here
            new = text[len(self._printed):] if len(text) > len(self._printed) else ""
        if new:
            self.on_text(new)
        self._printed = text


def chat_inputs(tokenizer, messages: list[dict], device) -> dict:
    """Token ids and attention mask of a conversation, ending with the assistant's turn to speak."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer: pass token ids")
    if getattr(tokenizer, "chat_template", None):
        enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)
        ids, mask = enc["input_ids"], enc.get("attention_mask")
    else:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        enc = tokenizer(text, return_tensors="pt")
        ids, mask = enc["input_ids"], enc.get("attention_mask")
    if mask is None:
        mask = torch.ones_like(ids)
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def _pad_kwargs(model, tokenizer) -> dict:
    """``pad_token_id`` from the tokenizer when the model's generation config has none."""
    if tokenizer is not None and getattr(model.generation_config, "pad_token_id", None) is None:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad is not None:
            return {"pad_token_id": pad}
    return {}


def chat_turn(model, tokenizer, inputs: dict, *, max_new_tokens: int = 256, greedy: bool = False,
              temperature: float | None = None, top_p: float | None = None, seed: int | None = None,
              on_text=None, loop=None, reuse: bool = False) -> TurnResult:
    """One turn of ``inputs`` (:func:`chat_inputs`); ``on_text(delta)`` gets the answer's text as
    it grows. ``loop``: a :class:`DecodeLoop` to run on (its cache is kept; ``reuse`` keeps the
    prefix it shares with this prompt)."""
    if getattr(model.config, "is_encoder_decoder", False):
        return turn_on_generate(model, tokenizer, inputs, max_new_tokens=max_new_tokens, greedy=greedy,
                                temperature=temperature, top_p=top_p, seed=seed, on_text=on_text)
    from zipmoe.runtime.engine.loop import DecodeLoop

    rt = getattr(model, "zipmoe", None)
    ids = inputs["input_ids"]
    mask = inputs.get("attention_mask")
    if loop is None:
        loop = DecodeLoop(model, context=int(ids.shape[-1]) + int(max_new_tokens), batch=int(ids.shape[0]))
    streamer = _Streamer(tokenizer, on_text)
    streamer._prompt_seen = True

    def on_token(host):
        streamer.put(torch.tensor(host[:1]))

    before = rt.counters.snapshot() if rt is not None else None
    t0 = time.perf_counter()
    res = loop.generate(ids, mask, max_new_tokens=int(max_new_tokens), seed=seed, reuse=reuse, on_token=on_token,
                        generation_kwargs=_pad_kwargs(model, tokenizer),
                        **sampling_kwargs(greedy=greedy, temperature=temperature, top_p=top_p))
    streamer.end()
    t_end = time.perf_counter()
    if rt is not None:
        rt.end_step()
    ids_out = res.tokens[0]
    n = len(ids_out)
    stats = {
        "ttft_s": res.stats["ttft_s"],
        "tpot_s": res.stats["tpot_s"],
        "tokens_per_s": (n / (t_end - t0)) if n and t_end > t0 else 0.0,
        "new_tokens": n,
        "prompt_tokens": int(ids.shape[-1]),
        "prefill_tokens": res.stats["prefill_tokens"],
        "total_s": t_end - t0,
        "stop": res.stop,
        "context": loop.context,
    }
    _add_counters(stats, rt, before)
    text = tokenizer.decode(ids_out, skip_special_tokens=True) if tokenizer is not None else " ".join(map(str, ids_out))
    return TurnResult(ids_out, text, stats, res.interrupted, res.times)


def _add_counters(stats: dict, rt, before) -> None:
    if rt is None:
        return
    d = delta(rt.counters.snapshot(), before)
    total = sum(d["hits"].values())
    stats.update({
        "bytes_read": d["bytes_read"],
        "bytes_read_disk": d["bytes_read_disk"],
        "hits": d["hits"],
        "hit_rate": (d["hits"]["full"] / total) if total else None,
        "time_s": d["time_s"],
        "peak_held_bytes": rt.counters.peak_held_bytes,
        "budget": rt.budget,
    })


def turn_on_generate(model, tokenizer, inputs: dict, *, max_new_tokens: int = 256, greedy: bool = False,
                     temperature: float | None = None, top_p: float | None = None, seed: int | None = None,
                     on_text=None) -> TurnResult:
    """The turn on ``model.generate`` (transformers' loop and dynamic cache): what encoder-decoder
    models, which have no decode loop, run (and benchmarks/decode_cpu.py's "before" engine)."""
    rt = getattr(model, "zipmoe", None)
    if seed is not None:
        torch.manual_seed(seed)
    gen_kw = {"max_new_tokens": int(max_new_tokens), **sampling_kwargs(greedy=greedy, temperature=temperature,
                                                                        top_p=top_p), **_pad_kwargs(model, tokenizer)}
    streamer = _Streamer(tokenizer, on_text)
    before = rt.counters.snapshot() if rt is not None else None
    t0 = time.perf_counter()
    interrupted = False
    try:
        with torch.inference_mode():
            model.generate(**inputs, streamer=streamer, **gen_kw)
    except KeyboardInterrupt:
        interrupted = True
        streamer.end()
    t_end = time.perf_counter()
    if rt is not None:
        rt.end_step()
    n = len(streamer.ids)
    ttft = (streamer.times[0] - t0) if n else None
    tpot = ((streamer.times[-1] - streamer.times[0]) / (n - 1)) if n > 1 else None
    stats = {
        "ttft_s": ttft,
        "tpot_s": tpot,
        "tokens_per_s": (n / (t_end - t0)) if n and t_end > t0 else 0.0,
        "new_tokens": n,
        "prompt_tokens": int(inputs["input_ids"].shape[-1]),
        "total_s": t_end - t0,
        "prefill_tokens": int(inputs["input_ids"].shape[-1]),
        "stop": "interrupted" if interrupted else ("max_new_tokens" if n >= int(max_new_tokens) else "eos"),
    }
    _add_counters(stats, rt, before)
    return TurnResult(streamer.ids, streamer.text(), stats, interrupted, streamer.times)
