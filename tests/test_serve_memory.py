"""The server's memory stays flat across lone requests (issue 25).

Before the decode loop ran under inference mode, every lone request on `zipmoe serve` kept an
autograd graph through the static cache's in-place updates: the demo's RSS grew about 78 MB per
request. Here 50 lone requests run one after another through the server's engine and stepper
(the decode loop over chat's default 4096-position cache, clamped to this model's 512, as `zipmoe serve` runs them), and the process's
RSS after the last may exceed the RSS after the 10th by at most 24 MiB (on this box it grows
about 3 MiB). A control run re-creates the bug (the loop's calls without inference mode) and
checks that the same measurement then fails.

Each reading of RSS first hands glibc's free pages back to the system (``malloc_trim(0)``), so
that RSS counts the memory in use: without it, pages freed by earlier tests in the same process
absorb a leak and the control measured 0.0 MiB once on CI. The control also checks the cause
itself, which needs no measurement: the cache's keys carry an autograd graph after a request.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

import pytest
import torch

from test_runtime_fixtures import container

psutil = pytest.importorskip("psutil")

REQUESTS = 50
WARM = 10
SLACK = 24 << 20

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None)


def _rss() -> int:
    """The process's resident bytes, after returning malloc's free pages where glibc can."""
    trim = getattr(_libc, "malloc_trim", None)
    if trim is not None:
        trim(0)
    return psutil.Process().memory_info().rss


def _keeps_graph(stepper) -> bool:
    """Whether the decode loop's KV cache holds an autograd graph (the bug's cause)."""
    return any(t is not None and t.requires_grad
               for layer in stepper.loop.cache.layers for t in (layer.keys, layer.values))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from zipmoe.runtime.engine.loader import load
    from zipmoe.runtime.engine.sampling import eos_ids
    from zipmoe.runtime.server.batcher import Engine
    from zipmoe.runtime.server.stepper import TransformersStepper

    _, path = container(tmp_path_factory, "mixtral")
    model, tok = load(path, budget="64M", device="cpu", workers=1, threads=1)
    if tok is None:
        pytest.skip("needs synth checkpoints with a tokenizer")
    stepper = TransformersStepper(model, context=4096)
    engine = Engine(max_batch=4)
    engine.attach(stepper, tok, context=stepper.loop.context, eos_ids=eos_ids(model.generation_config, model.config, tok))
    thread = threading.Thread(target=engine.run, daemon=True)
    thread.start()
    yield model, engine, stepper
    engine.stop()
    thread.join(30)
    model.zipmoe.close()


def _one(engine, ids) -> None:
    from zipmoe.runtime.server.batcher import Request, SamplingParams

    done = threading.Event()
    req = Request(ids, SamplingParams(max_tokens=8, temperature=0.0, top_p=1.0, ignore_eos=True),
                  lambda kind, payload: done.set() if kind != "delta" else None)
    engine.submit(req)
    assert done.wait(60) and req.error is None and req.path == "loop" and len(req.token_ids) == 8


def _rss_growth(engine, leak=None) -> int:
    g = torch.Generator().manual_seed(5)
    rss = []
    for i in range(REQUESTS):
        _one(engine, torch.randint(3, 200, (12 + i % 5,), generator=g).tolist())
        if leak is not None:
            leak()
        if i + 1 in (WARM, REQUESTS):
            rss.append(_rss())
    return rss[1] - rss[0]


def test_rss_is_flat_across_lone_requests(served):
    _, engine, stepper = served
    growth = _rss_growth(engine)
    assert not _keeps_graph(stepper)
    assert growth <= SLACK, f"RSS grew {growth / 2**20:.1f} MiB from request {WARM} to {REQUESTS}"


def test_the_check_fails_when_the_loop_keeps_autograd_graphs(served, monkeypatch):
    """The control: the decode loop's and the stepper's calls without their inference_mode (the
    bug as it was) make the same 40 requests grow RSS past the slack (on this box: about 50 MiB,
    against 3 MiB with it)."""
    from zipmoe.runtime.engine.loop import DecodeLoop
    from zipmoe.runtime.server.stepper import TransformersStepper

    for cls, names in ((DecodeLoop, ("prefill", "step", "forward", "generate")),
                       (TransformersStepper, ("prefill", "step", "select", "join"))):
        for name in names:
            monkeypatch.setattr(cls, name, getattr(cls, name).__wrapped__)
    _, engine, stepper = served
    growth = _rss_growth(engine)
    assert _keeps_graph(stepper), "without inference mode the cache should hold an autograd graph"
    assert growth > SLACK, f"without inference mode RSS grew only {growth / 2**20:.1f} MiB"
