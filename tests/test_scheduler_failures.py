"""A reader or decode job that fails reaches the layer's caller as one line, at once, never a hang.

Before, ``PriorityWorkers._loop`` and ``_fan_out`` had no exception handling: a job that raised
outside its own try (or a thread that died) left the layer waiting on its queue forever. Each
case runs the layer in a thread and asserts it returned within 10 s (it hung before).
"""

from __future__ import annotations

import json
import threading

import pytest
import torch

import zipmoe
from zipmoe.errors import ServingError

from test_runtime_fixtures import container, inputs, reference
from test_scheduler import _FakeRuntime, _fetcher, _place, _tensor

LIMIT_S = 10.0


def _run_in_thread(fn):
    out = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001
            out["exc"] = exc

    th = threading.Thread(target=target, daemon=True)
    th.start()
    th.join(LIMIT_S)
    assert not th.is_alive(), f"the layer still waits after {LIMIT_S} s"
    return out


def _layer(states_of):
    tensors, states = {}, {}
    uid = 0
    for e, st in enumerate(states_of):
        ts = []
        for name in ("gate_up", "down"):
            ts.append(_tensor(uid, 0, e, name, 800 * 8, 1600))
            uid += 1
        tensors[(0, e)] = ts
        states[e] = [st, st]
    rt = _FakeRuntime(tensors, 2)
    _place(rt, tensors, states)
    return rt, sorted(states)


def _ok_read(f, need_e, need_sm):
    f.e_parts = f.e_parts or [None]
    f.sm_parts = f.sm_parts or [None]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("where", ["decode job", "read job", "fan-out", "dead thread"])
def test_a_failing_job_reaches_the_caller_as_one_line(where):
    rt, experts = _layer(["compressed", "none", "compressed", "none"])
    sched = _fetcher(rt, 2)
    sched.reader._read = _ok_read
    sched.decoder._decode = lambda f, ve, vsm: None
    sched._admit = lambda fl: None
    if where == "decode job":
        def whole(f, *a):
            raise RuntimeError("boom in a decode worker\nsecond line")
        sched.decoder._whole = whole
    elif where == "read job":
        def rtd(f, then, rank):
            raise OSError(5, "Input/output error")
        sched.reader._read_then_decode = rtd
    elif where == "fan-out":
        sched.decoder.split = lambda f: True  # every tensor as chunk jobs (the fake tensors have none: jobs=[] ...)

        def fan_out(f, jobs, rank, ve, vsm):
            raise MemoryError("cannot queue the chunk jobs")
        sched.decoder._fan_out = fan_out
    else:  # the error handler itself fails: the thread stops; the layer must notice
        def whole(f, *a):
            raise RuntimeError("boom")
        sched.decoder._whole = whole

        def bad_handler(fn, args, exc):
            raise SystemExit("handler failed")
        sched.decoder.pool.on_error = bad_handler
    try:
        out = _run_in_thread(lambda: sched.run(0, experts, lambda e, w: None))
    finally:
        sched.reader.io._stopping = sched.decoder.pool._stopping = True
        if where != "dead thread":
            sched.close()
    exc = out.get("exc")
    assert isinstance(exc, ServingError), out
    msg = str(exc)
    assert "\n" not in msg
    if where == "decode job":
        assert "layer 0" in msg and "RuntimeError: boom in a decode worker second line" in msg
    elif where == "read job":
        assert "OSError" in msg and "Input/output error" in msg
    elif where == "fan-out":
        assert "MemoryError" in msg
    else:
        assert "zipmoe-decode" in msg
    assert rt._held == 0  # every expert's bytes given back


def test_a_chunk_job_that_cannot_be_queued_fails_its_tensor_once(monkeypatch):
    """_fan_out queues the chunk jobs: one that cannot be queued counts as failed, and the
    tensor is reported once, after the jobs that were queued have run."""
    rt, experts = _layer(["compressed"])
    sched = _fetcher(rt, 2)
    ran = []

    def piece(f, i, k, latch, ve, vsm):
        ran.append(k)
        last, first = latch.count_down(None)
        if last:
            f.report(first)

    sched.decoder._piece = piece
    sched.decoder.split = lambda f: True
    submit = sched.decoder.pool.submit
    calls = {"n": 0}

    def flaky_submit(rank, fn, *args):
        if fn == sched.decoder._piece:
            calls["n"] += 1
            if calls["n"] == 2:
                raise MemoryError("queue full")
        return submit(rank, fn, *args)

    sched.decoder.pool.submit = flaky_submit
    reports = []

    class F:
        tensor = rt.expert_tensors[(0, 0)][0]

        def report(self, exc):
            reports.append(exc)

    f = F()
    try:
        sched.decoder._fan_out(f, [(0, k) for k in range(4)], 0, False, False)
        out = _run_in_thread(lambda: __import__("time").sleep(0.3))
        assert "exc" not in out
    finally:
        sched.close()
    assert sorted(ran) == [0, 1]  # the first job and the one queued before the failure
    assert len(reports) == 1 and isinstance(reports[0], MemoryError)


def test_a_read_error_while_serving_is_one_line_and_the_model_serves_on(tmp_path_factory):
    src, path = container(tmp_path_factory, "qwen3_moe")
    model, _ = zipmoe.load(path, budget="64M", workers=2)
    rt = model.zipmoe
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    batch = inputs(vocab, False, batch=2)
    read, read_piece = rt.store.read, rt.store.read_piece
    rt.store.piece = 4096  # several pieces per range: the readers share them

    def failing_read(*a, **kw):
        raise OSError(5, "Input/output error")

    rt.store.read = rt.store.read_piece = failing_read
    try:
        with torch.no_grad():
            out = _run_in_thread(lambda: model(**batch))
        exc = out.get("exc")
        assert isinstance(exc, ServingError) and "\n" not in str(exc) and "Input/output error" in str(exc)
        assert rt._inflight == 0 and not rt.cache.pinned and rt.cache.used_bytes() == 0
        rt.store.read, rt.store.read_piece = read, read_piece
        with torch.no_grad():
            assert torch.equal(model(**batch).logits, reference(src)(**batch).logits)
    finally:
        rt.close()
