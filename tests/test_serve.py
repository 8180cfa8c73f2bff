"""`zipmoe serve`: a real uvicorn server in a subprocess, on a free local port, over the tiny synth
Mixtral, driven by the official `openai` client and raw HTTP.

What is checked: models, chat and completions (plain and streamed: the streamed text is the plain
text), usage counts, a lone greedy answer equal to `zipmoe chat --greedy --json`'s token ids and
text, stop strings, malformed and hostile requests answered 4xx with an OpenAI-style error body
(and the server still healthy), a client leaving mid-stream cancels its generation and frees its
slot, 16 concurrent clients all answered (in batches), the API key on every route but /health,
SIGTERM with a request in flight (it finishes; exit 0, no traceback), and bad command lines as one
line with a non-zero exit.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("sse_starlette")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from zipmoe_cli.app import main  # noqa: E402

from test_runtime_fixtures import container  # noqa: E402

MODEL = "tiny"
KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    src, path = container(tmp_path_factory, "mixtral")
    if not (src / "tokenizer.json").exists() and not (src / "tokenizer_config.json").exists():
        pytest.skip("needs synth checkpoints with a tokenizer")
    return src, path


class Server:
    def __init__(self, path: Path, log: Path, *extra: str, env: dict | None = None) -> None:
        self.log = log
        cmd = [sys.executable, "-m", "zipmoe_cli", "serve", str(path), "--port", "0", "--budget", "64M",
               "--workers", "1", "--threads", "1", "--model-name", MODEL, *extra]
        e = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        e.pop("ZIPMOE_API_KEY", None)
        e.update(env or {})
        self.fh = open(log, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self.fh, stderr=subprocess.STDOUT, env=e)
        self.url = None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            m = re.search(r"listening on (http://[\d.]+:\d+)", log.read_text(errors="replace"))
            if m:
                self.url = m.group(1)
                break
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        assert self.url, f"server did not start: {log.read_text(errors='replace')}"
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, log.read_text(errors="replace")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"server never became healthy: {log.read_text(errors='replace')}")

    def client(self, key: str = KEY):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=60)

    def metrics(self) -> dict:
        text = httpx.get(self.url + "/metrics", headers=AUTH, timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        finally:
            self.fh.close()


@pytest.fixture(scope="module")
def server(mixtral, tmp_path_factory):
    # one server for the module (each start costs an import of torch and transformers); the API key
    # comes from the environment; the last test stops it with SIGTERM
    srv = Server(mixtral[1], tmp_path_factory.mktemp("serve") / "server.log", "--max-batch", "4",
                 env={"ZIPMOE_API_KEY": KEY})
    yield srv
    if srv.proc.poll() is None:
        srv.proc.kill()
    srv.fh.close()


def _chat(client, text: str, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], **kw)


def test_openai_client_models_chat_stream_completions_usage(server, mixtral):
    from transformers import AutoTokenizer

    client = server.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL

    plain = _chat(client, "Hello there", max_tokens=10, temperature=0, extra_body={"return_token_ids": True})
    choice = plain.choices[0]
    ids = choice.model_extra["token_ids"]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    tok = AutoTokenizer.from_pretrained(mixtral[0])
    assert choice.message.content == tok.decode(ids, skip_special_tokens=True)
    assert plain.usage.completion_tokens == len(ids) and 1 <= len(ids) <= 10
    prompt_ids = tok.apply_chat_template([{"role": "user", "content": "Hello there"}], add_generation_prompt=True,
                                         return_dict=True)["input_ids"]
    assert plain.usage.prompt_tokens == len(prompt_ids)
    assert plain.usage.total_tokens == plain.usage.prompt_tokens + plain.usage.completion_tokens

    chunks = list(_chat(client, "Hello there", max_tokens=10, temperature=0, stream=True,
                        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [choice.finish_reason]
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    # vLLM's continuous_usage_stats: one chunk per token, each with the usage so far (a token that
    # adds no text comes as an empty delta), so a client can time every token
    chunks = list(_chat(client, "Hello there", max_tokens=10, temperature=0, stream=True,
                        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices and c.choices[0].finish_reason is None]
    assert counts == list(range(len(counts))) and counts[-1] == plain.usage.completion_tokens  # role chunk: 0
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens

    comp = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=7, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert comp.usage.completion_tokens == 7 and comp.choices[0].finish_reason == "length"
    assert comp.usage.prompt_tokens == len(tok("Once upon a time")["input_ids"])
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=7, temperature=0, stream=True,
        extra_body={"ignore_eos": True}))
    assert streamed == comp.choices[0].text
    # seeded sampling is reproducible; token ids as a prompt work too
    a = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=6, temperature=1.0, top_p=0.9,
                                  seed=11, extra_body={"ignore_eos": True})
    b = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=6, temperature=1.0, top_p=0.9,
                                  seed=11, extra_body={"ignore_eos": True})
    assert a.choices[0].text == b.choices[0].text and a.usage.prompt_tokens == 4


def _chat_json(mixtral, capsys, tokens: int, *prompts: str) -> dict:
    """`zipmoe chat --greedy --json` with these prompts as the turns of one conversation."""
    args = ["chat", str(mixtral[1]), "--greedy", "--max-new-tokens", str(tokens), "--json", "--budget", "64M",
            "--workers", "1", "--threads", "1"]
    for p in prompts:
        args += ["--prompt", p]
    try:
        main(args)
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


def test_lone_greedy_answer_is_chat_json(server, mixtral, capsys):
    prompt = "What is the capital of France?"
    want = _chat_json(mixtral, capsys, 12, prompt)
    got = _chat(server.client(), prompt, max_tokens=12, temperature=0, extra_body={"return_token_ids": True})
    assert got.choices[0].model_extra["token_ids"] == want["token_ids"]
    assert got.choices[0].message.content == want["text"]
    # a stop string cuts the answer before it
    text = want["text"]
    if len(text.strip()) >= 3:
        stop = text.strip()[1:3]
        cut = _chat(server.client(), prompt, max_tokens=12, temperature=0, stop=[stop])
        assert cut.choices[0].finish_reason == "stop"
        assert cut.choices[0].message.content == text[: text.find(stop)]


def test_a_conversations_next_turn_reuses_the_kv_cache_as_chat_does(server, mixtral, capsys):
    """Turn 2 of a conversation (the whole turn 1 in its messages) reuses the lone-request loop's
    KV cache: usage says how many prompt tokens were cached, and the tokens of both turns equal
    `zipmoe chat --greedy --json --prompt A --prompt B`'s (chat keeps its cache the same way)."""
    a, b = "Name a colour.", "And another one?"
    want = _chat_json(mixtral, capsys, 8, a, b)["turns"]
    client = server.client()
    history = [{"role": "user", "content": a}]
    one = client.chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0,
                                         extra_body={"return_token_ids": True})
    assert one.choices[0].model_extra["token_ids"] == want[0]["token_ids"]
    assert one.usage.prompt_tokens_details.cached_tokens == 0
    history += [{"role": "assistant", "content": one.choices[0].message.content}, {"role": "user", "content": b}]
    two = client.chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0,
                                         extra_body={"return_token_ids": True})
    assert two.choices[0].model_extra["token_ids"] == want[1]["token_ids"]
    cached = two.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and two.usage.prompt_tokens - cached == want[1]["stats"]["prefill_tokens"]
    # a prompt that does not extend the conversation starts afresh (what a fresh chat computes)
    again = client.chat.completions.create(model=MODEL, messages=history[:1], max_tokens=8, temperature=0,
                                           extra_body={"return_token_ids": True})
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    assert again.choices[0].model_extra["token_ids"] == want[0]["token_ids"]


HOSTILE = [
    ("POST", "/v1/chat/completions", b"{not json", 400),
    ("POST", "/v1/chat/completions", b"", 400),
    ("POST", "/v1/chat/completions", b"[1, 2]", 400),
    ("POST", "/v1/chat/completions", b"\xff\xfe\x00garbage", 400),
    ("POST", "/v1/chat/completions", b"[" * 100000 + b"]" * 100000, 400),
    ("POST", "/v1/chat/completions", {"model": MODEL}, 400),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user"}], "max_tokens": "5"}, 400),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                      "max_tokens": -1}, 400),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                      "max_tokens": 10**12}, 400),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                      "max_tokens": True}, 400),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                      "temperature": 7}, 400),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                      "top_p": 0}, 400),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 2}, 400),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                      "stop": ["a", "b", "c", "d", "e"]}, 400),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                      "seed": -4}, 400),
    ("POST", "/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}, 404),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x " * 2000}]}, 400),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                      "max_tokens": 511}, 400),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "y" * (2 << 20)}]},
     413),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": ["one", "two"]}, 400),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": [1, 99999999]}, 400),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": ""}, 400),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "echo": True}, 400),
    ("GET", "/v1/chat/completions", None, 405),
    ("GET", "/v1/nothing/../../etc/passwd", None, 404),
    ("GET", "/v1/models/other", None, 404),
]


def test_malformed_and_hostile_requests_are_4xx_json(server):
    with httpx.Client(base_url=server.url, timeout=30, headers=AUTH) as http:
        for method, path, body, status in HOSTILE:
            if isinstance(body, dict):
                r = http.request(method, path, json=body)
            else:
                r = http.request(method, path, content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == status, (path, str(body)[:80], r.status_code, r.text[:300])
            err = r.json()["error"]
            assert err["message"] and err["type"], (path, r.text[:300])
        assert http.get("/health").status_code == 200
    ok = _chat(server.client(), "still there?", max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens >= 1
    assert server.metrics().get('zipmoe_requests_total{route="/v1/chat/completions",status="500"}', 0) == 0


def _body(**kw) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                       **kw}).encode()


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
BAD = [  # method, path, raw body, status, the error's whole message, the Allow header
    ("GET", "/v1/chat/completions", None, 405, "GET is not allowed on /v1/chat/completions", {"POST"}),
    ("DELETE", "/v1/completions", None, 405, "DELETE is not allowed on /v1/completions", {"POST"}),
    ("POST", "/v1/models", None, 405, "POST is not allowed on /v1/models", {"GET", "HEAD"}),
    ("POST", "/v1/chat/completions", _body(temperature="hot"), 400, "temperature: expected a number, got 'hot'", None),
    ("POST", "/v1/chat/completions", _body(top_p="high"), 400, "top_p: expected a number, got 'high'", None),
    ("POST", "/v1/chat/completions", _body(presence_penalty="0"), 400,
     "presence_penalty: expected a number, got '0'", None),
    ("POST", "/v1/chat/completions", _body(frequency_penalty=True), 400,
     "frequency_penalty: expected a number, got true", None),
    ("POST", "/v1/chat/completions", _body(max_tokens=2.5), 400, "max_tokens: expected an integer, got 2.5", None),
    ("POST", "/v1/chat/completions", _body(n="1"), 400, "n: expected an integer, got '1'", None),
    ("POST", "/v1/chat/completions", _body(seed="7"), 400, "seed: expected an integer, got '7'", None),
    ("POST", "/v1/chat/completions", _body(stream=True, stream_options={"include_usage": "yes"}), 400,
     "stream_options.include_usage must be a boolean", None),
    ("POST", "/v1/chat/completions", _body(messages=[{"role": "user", "content": [IMAGE]}]), 400,
     "messages[0].content[0]: images are not supported", None),
    ("POST", "/v1/chat/completions", _body(messages=[{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, IMAGE]}]), 400, "messages[0].content[1]: images are not supported",
     None),
    ("POST", "/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "a \\ud800"}]}', 400,
     "messages[0].content: not valid Unicode (an unpaired surrogate)", None),
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": "\\udfff", "max_tokens": 2}', 400,
     "prompt: not valid Unicode (an unpaired surrogate)", None),
]


def test_bad_requests_answer_one_clear_line_and_the_next_request_is_served(server):
    """A wrong method carries Allow; a wrong type names the type expected; an image part and an
    unpaired surrogate are refused by name; after each, a good request is answered."""
    with httpx.Client(base_url=server.url, timeout=60, headers=AUTH) as http:
        for method, path, body, status, message, allow in BAD:
            r = http.request(method, path, content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == status, (method, path, body, r.status_code, r.text[:300])
            err = r.json()["error"]
            assert err["message"] == message and err["type"] == "invalid_request_error", (body, r.text[:300])
            if allow is not None:
                assert {m.strip() for m in r.headers["allow"].split(",")} == allow
            ok = http.post("/v1/chat/completions", content=_body())
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1, ok.text[:300]
    # a list of text parts is the string they join (what OpenAI clients send)
    client = server.client()
    parts = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                           messages=[{"role": "user", "content": [{"type": "text", "text": "Hello "},
                                                                                  {"type": "text", "text": "there"}]}],
                                           extra_body={"return_token_ids": True})
    plain = _chat(client, "Hello there", max_tokens=4, temperature=0, extra_body={"return_token_ids": True})
    assert parts.usage.prompt_tokens == plain.usage.prompt_tokens
    assert parts.choices[0].model_extra["token_ids"] == plain.choices[0].model_extra["token_ids"]
    assert server.metrics().get('zipmoe_requests_total{route="/v1/chat/completions",status="500"}', 0) == 0


def test_disconnect_mid_stream_frees_the_slot(server):
    before = server.metrics()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go on"}], "max_tokens": 400, "stream": True,
            "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=30, headers=AUTH) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                if line.startswith("data:"):
                    seen += 1
                if seen >= 3:
                    break
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        m = server.metrics()
        if m.get('zipmoe_generations_total{reason="cancelled"}', 0) > before.get(
                'zipmoe_generations_total{reason="cancelled"}', 0) and m["zipmoe_requests_running"] == 0:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the generation was not cancelled after the client left")
    made = m["zipmoe_generated_tokens_total"] - before.get("zipmoe_generated_tokens_total", 0)
    assert made < 400
    ok = _chat(server.client(), "next", max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens >= 1


def test_sixteen_concurrent_clients_all_answered(server):
    client = server.client()
    before = server.metrics()

    def ask(i):
        r = _chat(client, f"question number {i}", max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
        return r.usage.completion_tokens, r.choices[0].finish_reason

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(ask, range(16)))
    assert results == [(8, "length")] * 16
    m = server.metrics()
    steps = m["zipmoe_step_batch_size_count"] - before.get("zipmoe_step_batch_size_count", 0)
    solo = m['zipmoe_step_batch_size_bucket{le="1.0"}'] - before.get('zipmoe_step_batch_size_bucket{le="1.0"}', 0)
    assert steps > solo, "no step ran more than one request at once"
    assert m['zipmoe_step_batch_size_bucket{le="4.0"}'] == m["zipmoe_step_batch_size_count"]  # --max-batch 4
    assert 'zipmoe_expert_cache_hits_total{pool="full"}' in m and m["zipmoe_bytes_read_total"] > 0
    assert m["zipmoe_budget_bytes"] == 64 << 20 and 0 < m["zipmoe_peak_held_bytes"] <= 64 << 20
    assert m["zipmoe_time_to_first_token_seconds_count"] > 0 and m["zipmoe_time_per_output_token_seconds_count"] > 0


def test_api_key_on_every_route_but_health(server):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        assert http.get("/health").status_code == 200
        for path in ("/v1/models", "/metrics", "/nope"):
            r = http.get(path)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert http.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert http.get(path, headers={"Authorization": KEY}).status_code == 401
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 401
        assert http.get("/metrics", headers=AUTH).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        server.client("wrong").models.list()


def test_sigterm_lets_the_request_in_flight_finish_and_exits_0(server):
    # the last test of the module's server: it stops it
    started, result = threading.Event(), {}

    def long_stream():
        chunks = server.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "long"}], max_tokens=150, temperature=0,
            stream=True, extra_body={"ignore_eos": True})
        reasons = []
        for c in chunks:
            started.set()
            if c.choices and c.choices[0].finish_reason:
                reasons.append(c.choices[0].finish_reason)
        result["reasons"] = reasons

    t = threading.Thread(target=long_stream)
    t.start()
    assert started.wait(30)
    server.proc.send_signal(signal.SIGTERM)
    t.join(60)
    code = server.stop()
    out = server.log.read_text(errors="replace")
    assert code == 0, out
    assert "Traceback" not in out and "Error" not in out, out
    assert out.rstrip().endswith("zipmoe serve: stopped"), out
    assert result.get("reasons") == ["length"], (result, out)  # the request in flight finished


def _run(argv, capsys):
    try:
        main(argv)
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


def test_bad_command_lines_are_one_line(mixtral, capsys, tmp_path):
    path = str(mixtral[1])
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    not_zmoe = tmp_path / "x.zmoe"
    not_zmoe.write_bytes(b"hello")
    try:
        cases = [
            (["serve", str(tmp_path / "missing.zmoe")], "no such file"),
            (["serve", path, "--budget", "12Q"], "size"),
            (["serve", path, "--max-batch", "0"], "--max-batch"),
            (["serve", path, "--port", "70000"], "--port"),
            (["serve", path, "--attention", "fast"], "attention must be one of reproducible, pytorch"),
            (["serve", path, "--port", str(port)], "in use"),
            (["serve", str(not_zmoe)], "x.zmoe"),
            (["serve", path, "--budget", "4K", "--port", "0", "--workers", "1", "--threads", "1"], "budget"),
        ]
        for argv, words in cases:
            code, out, err = _run(argv, capsys)
            lines = [line for line in err.splitlines() if line.startswith("zipmoe: error")]
            assert code != 0 and len(lines) == 1 and words in lines[0], (argv, code, err)
            assert "Traceback" not in err
    finally:
        busy.close()


def test_help_does_not_import_torch():
    code = ("import sys\nfrom zipmoe_cli.app import main\ntry:\n    main(['serve', '--help'])\n"
            "except SystemExit:\n    pass\nprint('torch' in sys.modules, 'starlette' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "--api-key" in out.stdout and "--max-batch" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "False False"
