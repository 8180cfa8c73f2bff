"""The batching engine: one model thread serves every request, in batches of up to ``max_batch``.

The HTTP side (asyncio) only *submits* :class:`Request` objects and reads the events they
emit; all model work happens on the engine's own thread, through a stepper
(:mod:`.stepper`). One turn of the engine's loop:

1. **admit**: a request that comes alone (nothing running, it fits the stepper's decode loop)
   is prefilled on the stepper's own decode loop, as `zipmoe chat` computes a turn (its KV cache
   kept for a conversation's next request); otherwise
   the requests waiting in the queue, up to the free slots, join the running rows: the
   stepper prefills each and gives it a slot of its row batch (engine/rows.py; the rows
   running are not re-padded), and each gets its first token. A request that
   arrives while a batch decodes therefore waits at most one decode step to join it; when
   every slot is taken it waits in the queue (first come, first served) until a row finishes.
   (With a cache the stepper cannot re-pad, ``can_join`` is False and newcomers wait until
   the running batch has finished.)
2. **drop**: rows that finished (end of sequence, a stop string, ``max_tokens``, the context
   limit) or were cancelled (their client went away) leave the batch, freeing their slots.
3. **step**: one decode step for every row left; each row samples its next token.

Sampling is per row, chat's (the decode loop's): each request gets the stepper's
:class:`~zipmoe.runtime.engine.sampling.Sampler` for its temperature and top-p over the model's
generation config, so the logits go through the processors ``model.generate`` applies
(temperature, the generation config's top-k (transformers' 50 when it names none), top-p,
repetition penalty, ...), then greedy (temperature 0) is ``argmax``, otherwise ``softmax`` and
``multinomial`` with the request's own generator (seeded by ``seed`` when given, so a seeded
request is reproducible when it runs alone). A lone request therefore answers what ``zipmoe
chat`` answers with the same settings: greedy, and sampled with the same seed.

Text: each token's text comes from decoding only the few tokens around it (incremental
detokenization, as vLLM does: a decode per token costs the same at the 10th token and the
2,000th, under the lock the HTTP side tokenizes with); the whole answer is decoded once, at
its end, and that is the response's text. Events go to ``Request.sink(kind, payload)``,
called on the model thread: ``("delta", text)`` for new text (held back while it may still
turn into a stop string or ends in half a character; with ``SamplingParams.every_token``
exactly one per token, ``""`` for a token that adds none, so that a stream can say how many
tokens came with each chunk), then exactly one of ``("done", None)`` (``finish_reason`` and counts on the
request) or ``("error", message)``.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from zipmoe.runtime.engine.sampling import finish_reason

__all__ = ["Engine", "Request", "SamplingParams", "QueueFull"]

log = logging.getLogger("zipmoe.serve")


class QueueFull(Exception):
    """More requests are waiting than the engine accepts."""


@dataclass
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    stop: list = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False
    every_token: bool = False  # one "delta" event per token, "" when it adds no text (usage per chunk)


_ids = itertools.count(1)


class Request:
    """One generation: the prompt's token ids, how to sample, and what came out."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, sink=None) -> None:
        self.id = next(_ids)
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.sink = sink or (lambda kind, payload: None)
        self.cancelled = False
        self.token_ids: list[int] = []
        self.cached_tokens = 0  # prompt tokens whose KV came from the cache (not computed)
        self.path = ""  # how it was prefilled: "loop" (alone, on the decode loop, as chat) or "batch"
        self.text = ""
        self.sent = ""  # text already handed out as deltas
        self.prefix_at = 0  # incremental detokenization: the context tokens start here,
        self.read_at = 0  # and the tokens whose text is not out yet start here
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.t_submit = time.perf_counter()
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.generator: torch.Generator | None = None
        self.sampler = None  # the stepper's Sampler, from admission on
        self.seq: torch.Tensor | None = None  # [1, prompt + answer] ids, when the sampler reads them

    def cancel(self) -> None:
        """Ask the engine to drop this request at its next step (thread-safe: a flag)."""
        self.cancelled = True

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    @property
    def ttft_s(self) -> float | None:
        return None if self.t_first is None else self.t_first - self.t_submit

    @property
    def tpot_s(self) -> float | None:
        n = len(self.token_ids)
        if n < 2 or self.t_first is None or self.t_last is None:
            return None
        return (self.t_last - self.t_first) / (n - 1)


class Engine:
    """Runs requests on one thread. ``stepper`` and ``tokenizer`` may be given later (:meth:`attach`),
    once the model has loaded; requests submitted before wait."""

    def __init__(self, *, max_batch: int = 8, max_waiting: int = 256, context: int = 2048,
                 eos_ids=(), metrics=None, lock=None) -> None:
        self.max_batch = max(1, int(max_batch))
        self.max_waiting = int(max_waiting)
        self.context = int(context)
        self.eos_ids = set(eos_ids)
        self.metrics = metrics
        self.lock = lock or threading.Lock()  # held while the tokenizer decodes (shared with the HTTP side)
        self.stepper = None
        self.tokenizer = None
        self._waiting: deque[Request] = deque()
        self._rows: list[Request] = []
        self._cond = threading.Condition()
        self._stopping = False
        self.steps = 0

    # ------------------------------------------------------------------ the HTTP side
    def attach(self, stepper, tokenizer, *, context: int | None = None, eos_ids=None) -> None:
        with self._cond:
            self.stepper, self.tokenizer = stepper, tokenizer
            if context is not None:
                self.context = int(context)
            if eos_ids is not None:
                self.eos_ids = set(eos_ids)
            self._cond.notify_all()

    def submit(self, req: Request) -> None:
        with self._cond:
            if self._stopping:
                raise QueueFull("the server is shutting down")
            if len(self._waiting) >= self.max_waiting:
                raise QueueFull(f"{len(self._waiting)} requests are already waiting (--max-waiting)")
            self._waiting.append(req)
            self._cond.notify_all()

    @property
    def running(self) -> int:
        return len(self._rows)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def run(self) -> None:
        """The engine's loop, on the calling thread (the server's model thread), until :meth:`stop`."""
        self._loop()

    def cancel_all(self) -> None:
        """Cancel every request queued or running (they end at the next step as ``cancelled``)."""
        with self._cond:
            for r in list(self._waiting) + list(self._rows):
                r.cancel()
            self._cond.notify_all()

    def stop(self) -> None:
        """Cancel whatever is still queued or running, and end :meth:`run` (the caller joins its thread)."""
        with self._cond:
            self._stopping = True
            for r in list(self._waiting) + list(self._rows):
                r.cancel()
            self._cond.notify_all()

    # ------------------------------------------------------------------ the model thread
    def _loop(self) -> None:
        batch = None
        while True:
            with self._cond:
                while not self._stopping and (self.stepper is None or (not self._rows and not self._waiting)):
                    self._cond.wait()
                if self._stopping:
                    for r in list(self._waiting) + self._rows:
                        self._finish(r, "cancelled")
                    self._waiting.clear()
                    self._rows = []
                    return
                gone = [r for r in self._waiting if r.cancelled]
                if gone:
                    self._waiting = deque(r for r in self._waiting if not r.cancelled)
                take: list[Request] = []
                if batch is None or self.stepper.can_join:
                    while self._waiting and len(self._rows) + len(take) < self.max_batch:
                        take.append(self._waiting.popleft())
            try:
                for r in gone + [r for r in take if r.cancelled]:
                    self._finish(r, "cancelled")
                take = [r for r in take if not r.cancelled]
                if take:
                    batch = self._admit(batch, take)
                batch = self._drop(batch)
                if self._rows:
                    self._step(batch)
                    batch = self._drop(batch)
            except Exception as exc:  # the model failed (e.g. a corrupted chunk): fail these rows, go on
                log.error("generation failed: %s", exc, exc_info=log.isEnabledFor(logging.DEBUG))
                message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                for r in self._rows + take:
                    if not r.done:
                        r.error = message
                        self._emit_end(r, "error", message)
                with self._cond:
                    self._rows = []
                batch = None

    def _admit(self, batch, take: list[Request]):
        t0 = time.perf_counter()
        # a request alone decodes on the runtime's own loop (the stepper's), as `zipmoe chat` does
        alone = batch is None and len(take) == 1 and self.stepper.fits_loop(len(take[0].prompt_ids) + take[0].params.max_tokens)

        def on_first(i: int, row_logits) -> None:
            # a prompt's first token as soon as its own prefill ends (several prompts joining are
            # prefilled one after another: the first need not wait for the last)
            self._first_token(take[i], row_logits)

        new, logits = self.stepper.prefill([r.prompt_ids for r in take], alone=alone, running=batch, on_first=on_first)
        if alone:
            take[0].cached_tokens = int(self.stepper.reused)
        path = getattr(self.stepper, "path", "batch")
        for r in take:
            r.path = path
            if self.metrics is not None:
                self.metrics.path(path)
        log.info("prefill: %d request(s), %d prompt tokens, on the %s path%s", len(take),
                 sum(len(r.prompt_ids) for r in take), path,
                 f" ({take[0].cached_tokens} from the cache)" if alone and take[0].cached_tokens else "")
        if self.metrics is not None:
            self.metrics.prefill(len(take), sum(len(r.prompt_ids) for r in take), time.perf_counter() - t0)
        for i, r in enumerate(take):
            if r.sampler is None:  # a path that gives every prompt's logits at its end
                self._first_token(r, logits[i:i + 1])
        with self._cond:
            if batch is None:
                self._rows = list(take)
                return new
            moved = [r for r in self._rows if r.path == "loop"] if len(self._rows) == 1 else []
            self._rows = self._rows + list(take)
        if moved and self.metrics is not None:  # the lone row leaves the decode loop for the batch
            self.metrics.path("moved")
        return self.stepper.join(batch, new)

    def _first_token(self, r: Request, logits: torch.Tensor) -> None:
        """Set up ``r``'s sampling and take its first token from its prompt's ``[1, vocab]`` logits."""
        r.sampler = self.stepper.sampler(len(r.prompt_ids), temperature=r.params.temperature, top_p=r.params.top_p)
        if r.sampler.do_sample:
            r.generator = torch.Generator(device=logits.device)
            if r.params.seed is not None:
                r.generator.manual_seed(int(r.params.seed))
            else:
                r.generator.seed()
        if r.sampler.needs_ids:
            r.seq = torch.tensor([r.prompt_ids], dtype=torch.long, device=logits.device)
        self._accept(r, self._sample(r, logits), len(r.prompt_ids) + 1)

    def _drop(self, batch):
        keep = [i for i, r in enumerate(self._rows) if not r.done and not r.cancelled]
        if len(keep) == len(self._rows):
            return batch
        for r in self._rows:
            if r.cancelled and not r.done:
                self._finish(r, "cancelled")
        with self._cond:
            rows = [self._rows[i] for i in keep]
            self._rows = rows
        if not keep:
            return None
        return self.stepper.select(batch, keep)

    def _step(self, batch) -> None:
        rows = list(self._rows)
        t0 = time.perf_counter()
        logits = self.stepper.step(batch, [r.token_ids[-1] for r in rows])
        self.steps += 1
        if self.metrics is not None:
            self.metrics.step(len(rows), time.perf_counter() - t0)
        for i, r in enumerate(rows):
            self._accept(r, self._sample(r, logits[i:i + 1]), len(r.prompt_ids) + len(r.token_ids) + 1)

    # ------------------------------------------------------------------ one row
    @staticmethod
    def _sample(r: Request, logits: torch.Tensor) -> int:
        """The next token of ``r`` from its ``[1, vocab]`` logits."""
        nxt = r.sampler(logits.float(), r.seq, generator=r.generator)
        if r.seq is not None:
            r.seq = torch.cat([r.seq, nxt[:, None]], dim=-1)
        return int(nxt.item())

    def _accept(self, r: Request, token: int, length: int) -> None:
        """Record a new token of ``r`` (``length``: prompt + answer tokens so far), emit its text
        and decide whether the row is finished."""
        now = time.perf_counter()
        if r.t_first is None:
            r.t_first = now
        r.t_last = now
        r.token_ids.append(token)
        end = finish_reason(eos=token in self.eos_ids and not r.params.ignore_eos, new_tokens=len(r.token_ids),
                            max_new_tokens=r.params.max_tokens, room=self.context - length)
        reason = {None: None, "eos": "stop"}.get(end, "length")
        stops = r.params.stop
        if reason is None:
            piece = self._detokenize(r)
            if not piece:
                if r.params.every_token:
                    r.sink("delta", "")
                return  # nothing new to show (half a character) and not finished
            seen, text = len(r.text), r.text + piece
        else:
            seen, text = 0, self._decode(r.token_ids)  # the answer decoded in one go, once, at its end
        for s in stops:  # a stop string ends in the new text: it starts at most len(s) - 1 before it
            at = text.find(s, max(0, seen - len(s) + 1))
            if at >= 0:
                text, reason = text[:at], "stop"
        r.text = text
        if reason is None:
            hold = max((len(s) for s in stops), default=1) - 1
            safe = text[: len(text) - hold] if hold else text
        else:
            safe = text
        if len(safe) > len(r.sent) and safe.startswith(r.sent):
            delta, r.sent = safe[len(r.sent):], safe
            r.sink("delta", delta)
        elif r.params.every_token:
            r.sink("delta", "")
        if reason is not None:
            self._finish(r, reason)

    def _detokenize(self, r: Request) -> str:
        """The text ``r``'s newest token adds, decoding only a few tokens (incremental
        detokenization, as vLLM's and text-generation-inference's): the tokens since the last
        text that came out, with the ones before it as context (a word's leading space, a
        character split across tokens), against the same without the newest; "" while the
        newest ends in half a character. The whole answer is decoded once, at its end."""
        ids = r.token_ids
        if self.tokenizer is None:
            return (" " if len(ids) > 1 else "") + str(ids[-1])
        with self.lock:
            before = self.tokenizer.decode(ids[r.prefix_at:r.read_at], skip_special_tokens=True)
            after = self.tokenizer.decode(ids[r.prefix_at:], skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            r.prefix_at, r.read_at = r.read_at, len(ids)
            return after[len(before):]
        return ""

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return " ".join(map(str, ids))
        with self.lock:
            return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _finish(self, r: Request, reason: str) -> None:
        if r.done:
            return
        r.finish_reason = reason
        self._emit_end(r, "done", None)

    def _emit_end(self, r: Request, kind: str, payload) -> None:
        if self.metrics is not None:
            self.metrics.finished(r)
        r.sink(kind, payload)
