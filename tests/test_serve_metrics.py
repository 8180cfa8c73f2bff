"""The server's /metrics text for the batch size of every decode step (``zipmoe_step_batch_size``,
a histogram over 1, 2, 4, 8, 16, 32, 64, +Inf) and the requests by path
(``zipmoe_requests_by_path_total{path}``): their exposition from :class:`Metrics` directly, and
the batch sizes the engine records as it steps (a lone request's steps count as batch 1), over a
fake stepper (no model: fast)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from zipmoe.runtime.server.batcher import Engine, Request, SamplingParams  # noqa: E402
from zipmoe.runtime.server.metrics import Metrics  # noqa: E402

VOCAB = 16
LE = ("1.0", "2.0", "4.0", "8.0", "16.0", "32.0", "64.0", "+Inf")


def _metrics(engine=None) -> Metrics:
    return Metrics(SimpleNamespace(engine=engine, ready=True, model=None))


def _samples(m: Metrics) -> dict:
    """{(sample name, frozenset of labels): value} of the rendered text, as a Prometheus scraper parses it."""
    out = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def _buckets(samples: dict) -> dict:
    return {dict(k)["le"]: v for (name, k), v in samples.items() if name == "zipmoe_step_batch_size_bucket"}


def test_batch_size_histogram_exposition():
    m = _metrics()
    s = _samples(m)
    assert _buckets(s) == {le: 0 for le in LE}  # shown before any step, all at 0
    assert s[("zipmoe_step_batch_size_count", frozenset())] == 0
    for rows in (1, 1, 3, 5, 16, 40):
        m.step(rows, 0.001)
    s = _samples(m)
    assert _buckets(s) == {"1.0": 2, "2.0": 2, "4.0": 3, "8.0": 4, "16.0": 5, "32.0": 5, "64.0": 6, "+Inf": 6}
    assert s[("zipmoe_step_batch_size_sum", frozenset())] == 1 + 1 + 3 + 5 + 16 + 40
    assert s[("zipmoe_step_batch_size_count", frozenset())] == 6
    text = m.render().decode()
    assert "# TYPE zipmoe_step_batch_size histogram" in text
    assert 'zipmoe_step_batch_size_bucket{le="+Inf"} 6.0' in text


def test_requests_by_path_exposition():
    m = _metrics()
    key = lambda p: ("zipmoe_requests_by_path_total", frozenset({("path", p)}))  # noqa: E731
    s = _samples(m)
    assert [s[key(p)] for p in ("loop", "batch", "moved")] == [0, 0, 0]  # every path shows from the start
    for p in ("loop", "loop", "batch", "moved", "loop"):
        m.path(p)
    s = _samples(m)
    assert [s[key(p)] for p in ("loop", "batch", "moved")] == [3, 1, 1]
    text = m.render().decode()
    assert "# TYPE zipmoe_requests_by_path_total counter" in text
    assert 'zipmoe_requests_by_path_total{path="loop"} 3.0' in text


class _Sampler:
    do_sample = False
    needs_ids = False

    def __call__(self, logits, seq, generator=None):
        return logits.argmax(-1)


class FakeStepper:
    """The stepper's calls, over no model: every row's logits put token 5 first."""

    can_join = True

    def __init__(self) -> None:
        self.reused = 0
        self.path = ""

    def fits_loop(self, tokens: int) -> bool:
        return True

    def sampler(self, prompt_len, *, temperature, top_p):
        return _Sampler()

    def _logits(self, rows: int) -> torch.Tensor:
        out = torch.zeros(rows, VOCAB)
        out[:, 5] = 1.0
        return out

    def prefill(self, prompts, alone=False, running=None, on_first=None):
        self.path = "loop" if alone and len(prompts) == 1 else "batch"
        return SimpleNamespace(rows=len(prompts)), self._logits(len(prompts))

    def step(self, batch, tokens):
        assert batch.rows == len(tokens)
        return self._logits(len(tokens))

    def select(self, batch, keep):
        return SimpleNamespace(rows=len(keep))

    def join(self, running, new):
        return SimpleNamespace(rows=running.rows + new.rows)


def _run(engine: Engine, reqs: list[Request], attach=None) -> None:
    """Submit ``reqs`` together, then (if given) attach the stepper, and wait until all have ended."""
    left = threading.Semaphore(0)
    for r in reqs:
        r.sink = lambda kind, payload: left.release() if kind != "delta" else None
        engine.submit(r)
    if attach is not None:
        engine.attach(attach, None, context=1024, eos_ids=[])
    for _ in reqs:
        assert left.acquire(timeout=30)


def test_the_engine_records_every_decode_steps_batch_size():
    engine = Engine(max_batch=4)
    m = _metrics(engine)
    engine.metrics = m
    thread = threading.Thread(target=engine.run, daemon=True)
    thread.start()
    try:
        # three requests waiting when the model arrives: one prefill of 3, then 2 steps of 3 rows
        # (each request's first token comes from the prefill, its 2 others from the steps)
        batch = [Request([1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0)) for _ in range(3)]
        _run(engine, batch, attach=FakeStepper())
        # then one alone: the loop path; 3 more tokens after the prefill's, each a step of 1 row
        lone = Request([1, 2], SamplingParams(max_tokens=4, temperature=0.0))
        _run(engine, [lone])
    finally:
        engine.stop()
        thread.join(30)
    assert [r.finish_reason for r in batch + [lone]] == ["length"] * 4
    assert all(len(r.token_ids) == r.params.max_tokens for r in batch + [lone])
    s = _samples(m)
    assert _buckets(s) == {"1.0": 3, "2.0": 3, "4.0": 5, "8.0": 5, "16.0": 5, "32.0": 5, "64.0": 5, "+Inf": 5}
    assert s[("zipmoe_step_batch_size_count", frozenset())] == 5 == engine.steps
    assert s[("zipmoe_step_batch_size_sum", frozenset())] == 2 * 3 + 3 * 1
