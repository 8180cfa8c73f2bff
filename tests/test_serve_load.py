"""benchmarks/serve_load.py measures what it says: pointed at a fake OpenAI-style streaming server
(Starlette + uvicorn in a thread, on a free local port) that sends the opening role chunk at
once, the first content chunk after D1 and each next one after D2, its TTFT is D1 and its TPOT
D2 (within a tolerance for a loaded 2-core machine), at 1 and at 2 concurrent clients; a server
that sends the whole answer at once gives TPOT about 0 (the stream is timed as it arrives, not
after the body); errors (a short answer, an error event) are counted, not timed."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import socket
import threading
import time
from pathlib import Path

import pytest

uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("httpx")
pytest.importorskip("starlette")

from starlette.applications import Starlette  # noqa: E402
from starlette.responses import JSONResponse, StreamingResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "serve_load.py"
D1, D2 = 0.3, 0.1
TOKENS = 5


def _load():
    spec = importlib.util.spec_from_file_location("serve_load", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


serve_load = _load()


def _chunk(delta: dict, finish=None) -> str:
    return "data: " + json.dumps({"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "fake",
                                  "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}) + "\n\n"


def _app(mode: str) -> Starlette:
    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def chat(request):
        body = await request.json()
        n = int(body["max_tokens"])
        if mode == "short":
            n -= 1

        async def events():
            yield _chunk({"role": "assistant", "content": ""})  # at once: carries no content
            yield ": ping\n\n"  # an SSE comment, as sse-starlette's keep-alive
            if mode == "error":
                await asyncio.sleep(D2)
                yield "data: " + json.dumps({"error": {"message": "boom", "type": "server_error"}}) + "\n\n"
                return
            continuous = (body.get("stream_options") or {}).get("continuous_usage_stats")
            if mode == "silent" and continuous:  # tokens of no text, each in a chunk with the usage so far
                for i in range(n):
                    await asyncio.sleep(D1 if i == 0 else D2)
                    yield "data: " + json.dumps({"id": "x", "object": "chat.completion.chunk", "choices": [
                        {"index": 0, "delta": {"content": ""}, "finish_reason": None}],
                        "usage": {"prompt_tokens": 3, "completion_tokens": i + 1, "total_tokens": 4 + i}}) + "\n\n"
            elif mode == "burst":  # the whole answer at once, after D1
                await asyncio.sleep(D1)
                yield "".join(_chunk({"content": f"t{i} "}) for i in range(n))
            elif mode != "silent":
                for i in range(n):
                    await asyncio.sleep(D1 if i == 0 else D2)
                    yield _chunk({"content": f"t{i} "})
            yield _chunk({}, "length")
            if (body.get("stream_options") or {}).get("include_usage"):
                yield "data: " + json.dumps({"id": "x", "object": "chat.completion.chunk", "choices": [],
                                             "usage": {"prompt_tokens": 3, "completion_tokens": n,
                                                       "total_tokens": 3 + n}}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/models", models), Route("/v1/chat/completions", chat, methods=["POST"])])


class FakeServer:
    def __init__(self, mode: str) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = "http://127.0.0.1:%d" % self.sock.getsockname()[1]
        config = uvicorn.Config(_app(mode), log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the fake server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


@pytest.fixture(scope="module")
def steady():
    with FakeServer("steady") as srv:
        yield srv


def test_sse_events_parses_incrementally():
    lines = iter(["data: {\"a\": 1}", "", ": ping", "", "event: x", "data: 1", "data:2", "", "data: [DONE]", ""])
    assert list(serve_load.sse_events(lines)) == ['{"a": 1}', "1\n2", "[DONE]"]


def test_ttft_and_tpot_match_the_known_delays(steady):
    levels = serve_load.measure(steady.url, concurrency=(1, 2), requests=2, new_tokens=TOKENS, warmup=True,
                                timeout=30)
    assert [lv["clients"] for lv in levels] == [1, 2]
    for lv in levels:
        assert lv["errors"] == 0 and lv["completed"] == lv["requests"] == 2, lv
        assert lv["tokens"] == 2 * TOKENS and lv["chunks_per_token"] == 1.0, lv
        assert lv["no_ttft"] == lv["no_tpot"] == 0, lv
        # the first chunk, not the last: a request's whole stream takes D1 + (TOKENS - 1) * D2 = 0.7 s,
        # so 2 * D1 (0.6 s) still tells them apart, with room for a loaded 2-core machine (a clean-clone
        # CI run measured 0.54 s beside other work on 7 Dec)
        for key in ("ttft_p50_s", "ttft_p90_s"):
            assert 0.5 * D1 <= lv[key] <= 2.0 * D1 < D1 + (TOKENS - 1) * D2, (key, lv)
        for key in ("tpot_p50_s", "tpot_p90_s"):
            assert 0.5 * D2 <= lv[key] <= 1.5 * D2, (key, lv)
        # one request: D1 + (TOKENS - 1) * D2 = 0.7 s; two clients run the two requests side by side
        expected_wall = (2 if lv["clients"] == 1 else 1) * (D1 + (TOKENS - 1) * D2)
        assert 0.8 * expected_wall <= lv["wall_s"] <= 2.0 * expected_wall, lv
        assert lv["tokens_per_s"] == pytest.approx(lv["tokens"] / lv["wall_s"])
    assert "TTFT p50 0." in serve_load.describe(levels[0])
    assert levels[0]["timed_by"] == ["content"]  # this server sends no usage per chunk


def test_tokens_of_no_text_are_timed_by_the_usage_per_chunk():
    """A server that streams a chunk per token with the usage so far (vLLM's
    continuous_usage_stats, which zipmoe serve speaks) is timed by those chunks, although no
    token carries text (a synth model's byte-level tokenizer: timed by content, no figure)."""
    with FakeServer("silent") as srv:
        (lv,) = serve_load.measure(srv.url, concurrency=(1,), requests=2, new_tokens=TOKENS, warmup=False,
                                   timeout=30)
    assert lv["errors"] == 0 and lv["no_ttft"] == lv["no_tpot"] == 0 and lv["timed_by"] == ["tokens"], lv
    assert 0.5 * D1 <= lv["ttft_p50_s"] <= 1.5 * D1 and 0.5 * D2 <= lv["tpot_p50_s"] <= 1.5 * D2, lv
    assert lv["chunks_per_token"] == 0 and "timed by tokens" in serve_load.describe(lv)


def test_a_burst_has_no_time_per_token_and_errors_are_counted():
    with FakeServer("burst") as srv:
        (lv,) = serve_load.measure(srv.url, concurrency=(1,), requests=1, new_tokens=TOKENS, warmup=False,
                                   timeout=30)
    assert lv["errors"] == 0 and 0.5 * D1 <= lv["ttft_p50_s"] <= 1.5 * D1, lv
    assert lv["tpot_p50_s"] < 0.02, lv  # every chunk arrived together: timed on arrival, not spread out
    with FakeServer("short") as srv:
        (lv,) = serve_load.measure(srv.url, concurrency=(1,), requests=1, new_tokens=TOKENS, warmup=False,
                                   timeout=30)
    assert lv["errors"] == 1 and lv["completed"] == 0 and lv["ttft_p50_s"] is None, lv
    assert "4 tokens, not 5" in lv["error_samples"][0]
    assert "n/a" in serve_load.describe(lv)
    with FakeServer("error") as srv:
        (lv,) = serve_load.measure(srv.url, concurrency=(1,), requests=1, new_tokens=TOKENS, warmup=False,
                                   timeout=30)
    assert lv["errors"] == 1 and "boom" in lv["error_samples"][0], lv
