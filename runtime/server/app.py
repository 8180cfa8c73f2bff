"""The OpenAI-compatible HTTP application (Starlette), over one model served from its container.

Routes: ``GET /health`` (200 once the model is loaded, 503 before), ``GET /v1/models`` (and
``/v1/models/{id}``), ``POST /v1/chat/completions``, ``POST /v1/completions`` (both with
``stream: true`` as server-sent events ending in ``data: [DONE]``) and ``GET /metrics``
(Prometheus text). Every error is OpenAI-shaped JSON ``{"error": {"message", "type", "param",
"code"}}``: 400 for a malformed or unsupported request, 401 without the API key, 404 for an
unknown route or model, 405 for a wrong method, 413 for a body over the limit, 429 when the
queue is full, 503 while loading or shutting down, 500 only when the model itself fails.

:class:`ServerState` loads the model on the engine's thread (:mod:`.batcher`), which then
serves; the asyncio side validates, tokenizes, queues and streams. See docs/serve.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .batcher import Engine, QueueFull, Request as Generation, SamplingParams
from .metrics import CONTENT_TYPE, Metrics
from .schemas import ApiError, ChatRequest, CompletionRequest, error_body, parse

__all__ = ["ServeConfig", "ServerState", "build_app"]

log = logging.getLogger("zipmoe.serve")

ROUTES = ("/health", "/v1/models", "/v1/chat/completions", "/v1/completions", "/metrics")


@dataclass
class ServeConfig:
    file: Path
    load_args: dict  # zipmoe.load keywords (budget, device, plan, workers, ...): zipmoe_cli/serving.py, as chat
    model_name: str = "model"
    api_key: str | None = None
    max_batch: int = 8
    max_waiting: int = 256
    max_tokens: int = 4096  # the largest max_tokens a request may ask for
    default_max_tokens: int = 1024  # when a request does not say
    max_body: int = 1 << 20
    shutdown_timeout: float = 10.0
    context: int = 4096  # the lone-request decode loop's KV cache and every request's limit (clamped to the model's)


class ServerState:
    """The model, its tokenizer and the engine; loaded on the model thread by :meth:`start`."""

    def __init__(self, cfg: ServeConfig, on_fatal=None, on_ready=None) -> None:
        self.cfg = cfg
        self.model = None
        self.stepper = None
        self.tokenizer = None
        self.context = 0
        self.vocab = 0
        self.ready = False
        self.stopping = False
        self.load_error: BaseException | None = None
        self.created = int(time.time())
        self.on_fatal = on_fatal
        self.on_ready = on_ready
        self.tok_lock = threading.Lock()
        self.metrics = Metrics(self)
        self.engine = Engine(max_batch=cfg.max_batch, max_waiting=cfg.max_waiting, metrics=self.metrics,
                             lock=self.tok_lock)
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the model thread
    def start(self) -> None:
        self._thread = threading.Thread(target=self._load_and_serve, name="zipmoe-model", daemon=True)
        self._thread.start()

    def _load_and_serve(self) -> None:
        try:
            self._load()
        except BaseException as exc:  # noqa: BLE001 - reported by the CLI as one line
            self.load_error = exc
            if self.on_fatal is not None:
                self.on_fatal(exc)
            return
        if self.stopping:
            return
        self.ready = True
        if self.on_ready is not None:
            self.on_ready(self)
        self.engine.run()

    def _load(self) -> None:
        from zipmoe.errors import UsageError
        from zipmoe.runtime.engine.loader import load
        from zipmoe.runtime.engine.sampling import eos_ids

        from .stepper import TransformersStepper, context_length

        c = self.cfg
        model, tokenizer = load(c.file, **c.load_args)
        self.model = model
        if tokenizer is None:
            raise UsageError(f"{c.file} has no tokenizer files: serve needs one")
        try:
            stepper = TransformersStepper(model, context=c.context, max_batch=c.max_batch)
        except ValueError as exc:
            raise UsageError(f"{c.file}: {exc}") from None
        self.stepper = stepper
        self.tokenizer = tokenizer
        # one context figure: the lone request's decode loop (chat's), which every request then fits
        self.context = stepper.loop.context if stepper.loop is not None else context_length(model, tokenizer)
        self.vocab = int(model.get_output_embeddings().weight.shape[0]) if model.get_output_embeddings() is not None \
            else int(model.config.vocab_size)
        self.engine.attach(stepper, tokenizer, context=self.context,
                           eos_ids=eos_ids(getattr(model, "generation_config", None), model.config, tokenizer))

    def begin_shutdown(self) -> None:
        """SIGTERM/Ctrl-C: refuse new requests (503); cancel those still running after the timeout."""
        if self.stopping:
            return
        self.stopping = True
        timer = threading.Timer(self.cfg.shutdown_timeout, self.engine.cancel_all)
        timer.daemon = True
        timer.start()

    def stop(self) -> None:
        """Cancel what is left, end the model thread, close the runtime (lifespan shutdown)."""
        self.stopping = True
        self.engine.stop()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self.cfg.shutdown_timeout + 30)
        rt = getattr(self.model, "zipmoe", None) if self.model is not None else None
        if rt is not None and (self._thread is None or not self._thread.is_alive()):
            rt.close()  # idempotent

    # ------------------------------------------------------------------ requests
    def sampling(self, body, prompt_len: int) -> SamplingParams:
        c = self.cfg
        room = self.context - prompt_len
        if room < 1:
            raise ApiError(400, f"this model's maximum context length is {self.context} tokens; the prompt has "
                           f"{prompt_len}", param="messages" if isinstance(body, ChatRequest) else "prompt",
                           code="context_length_exceeded")
        if body.max_tokens is None:
            max_tokens = min(c.default_max_tokens, room)
        else:
            if body.max_tokens > c.max_tokens:
                raise ApiError(400, f"max_tokens is {body.max_tokens}; this server allows at most {c.max_tokens} "
                               "(--max-tokens)", param="max_tokens")
            if body.max_tokens > room:
                raise ApiError(400, f"this model's maximum context length is {self.context} tokens; the prompt has "
                               f"{prompt_len} and max_tokens asks for {body.max_tokens} more",
                               param="max_tokens", code="context_length_exceeded")
            max_tokens = body.max_tokens
        gen = getattr(self.model, "generation_config", None)
        temperature = body.temperature
        if temperature is None:
            temperature = getattr(gen, "temperature", None)
            temperature = 1.0 if temperature is None else float(temperature)
        top_p = body.top_p
        if top_p is None:
            top_p = getattr(gen, "top_p", None)
            top_p = 1.0 if top_p is None else float(top_p)
        return SamplingParams(max_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p),
                              stop=body.stops(), seed=body.seed, ignore_eos=bool(body.ignore_eos),
                              every_token=bool(body.stream) and body.continuous_usage)

    def chat_ids(self, conversation: list[dict]) -> list[int]:
        from zipmoe.runtime.engine.turn import chat_inputs

        with self.tok_lock:
            try:
                enc = chat_inputs(self.tokenizer, conversation, "cpu")
            except Exception as exc:  # the template refused the conversation (e.g. roles out of order)
                raise ApiError(400, f"the model's chat template refused these messages: {exc}",
                               param="messages") from None
        return enc["input_ids"][0].tolist()

    def prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, list):
            bad = [t for t in prompt if not 0 <= t < self.vocab]
            if bad:
                raise ApiError(400, f"token id {bad[0]} is outside the vocabulary (0..{self.vocab - 1})",
                               param="prompt")
            return list(prompt)
        with self.tok_lock:
            return list(self.tokenizer(prompt)["input_ids"])


# ---------------------------------------------------------------------------- helpers
def _error(status: int, message: str, type: str = "invalid_request_error", param=None, code=None,
           headers=None) -> JSONResponse:
    return JSONResponse(error_body(message, type, param, code), status_code=status, headers=headers)


def _api_error(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


async def _read_json(request: Request, limit: int):
    length = request.headers.get("content-length")
    if length is not None:
        try:
            if int(length) > limit:
                raise ApiError(413, f"the request body is larger than {limit} bytes (--max-body)", code="too_large")
        except ValueError:
            raise ApiError(400, "bad Content-Length header") from None
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"the request body is larger than {limit} bytes (--max-body)", code="too_large")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ApiError(400, "the client went away while sending the body") from None
    raw = b"".join(chunks)
    if not raw.strip():
        raise ApiError(400, "the request body is empty: send a JSON object")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {str(exc).splitlines()[0][:200]}") from None


async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg.get("type") == "http.disconnect":
            return


class _Events:
    """Events from the model thread, delivered into this request's asyncio queue."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

    def sink(self, kind: str, payload) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, payload))
        except RuntimeError:  # the loop has closed: nobody is listening any more
            pass


def _usage(g: Generation) -> dict:
    p, c = len(g.prompt_ids), len(g.token_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": g.cached_tokens}}


def _finish_reason(g: Generation) -> str:
    return g.finish_reason if g.finish_reason in ("stop", "length") else "stop"


# ---------------------------------------------------------------------------- the app
def build_app(state: ServerState) -> Starlette:
    cfg = state.cfg

    async def health(request: Request) -> Response:
        if state.ready and not state.stopping:
            return JSONResponse({"status": "ok", "model": cfg.model_name})
        status = "stopping" if state.stopping else ("failed" if state.load_error else "loading")
        return JSONResponse({"status": status}, status_code=503)

    def model_card() -> dict:
        card = {"id": cfg.model_name, "object": "model", "created": state.created, "owned_by": "zipmoe"}
        if state.context:
            card["max_model_len"] = state.context
        return card

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def model_info(request: Request) -> Response:
        name = request.path_params["name"]
        if name != cfg.model_name:
            return _error(404, f"the model {name!r} does not exist (this server serves {cfg.model_name!r})",
                          param="model", code="model_not_found")
        return JSONResponse(model_card())

    async def metrics(request: Request) -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    async def prepare(request: Request, cls):
        body = parse(cls, await _read_json(request, cfg.max_body))
        if body.model != cfg.model_name:
            raise ApiError(404, f"the model {body.model!r} does not exist (this server serves {cfg.model_name!r})",
                           param="model", code="model_not_found")
        if not state.ready or state.stopping:
            raise ApiError(503, "the model is still loading" if not state.stopping else "the server is shutting down",
                           type="server_error", code="unavailable")
        if cls is ChatRequest:
            ids = await run_in_threadpool(state.chat_ids, body.conversation())
        else:
            ids = await run_in_threadpool(state.prompt_ids, body.single_prompt())
        if not ids:
            raise ApiError(400, "the prompt is empty", param="prompt")
        params = state.sampling(body, len(ids))
        return body, ids, params

    async def completions(request: Request, chat: bool) -> Response:
        try:
            body, ids, params = await prepare(request, ChatRequest if chat else CompletionRequest)
        except ApiError as exc:
            return _api_error(exc)
        events = _Events()
        gen = Generation(ids, params, events.sink)
        try:
            state.engine.submit(gen)
        except QueueFull as exc:
            return _error(429 if not state.stopping else 503, str(exc), type="server_error", code="busy")
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        if body.stream:
            return _stream(state, body, gen, events, rid, created, chat)
        # not streamed: wait for the end, or for the client to go away (then cancel)
        waiter = asyncio.ensure_future(_collect(events))
        gone = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({waiter, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not waiter.done():
                waiter.cancel()
                gen.cancel()
        if not waiter.done() or waiter.cancelled():
            return Response(status_code=499)
        error = waiter.result()
        if error is not None:
            return _error(500, f"generation failed: {error}", type="server_error")
        if gen.finish_reason == "cancelled":
            return _error(503, "the server is shutting down: the request was cancelled", type="server_error",
                          code="cancelled")
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": gen.text}, "logprobs": None,
                      "finish_reason": _finish_reason(gen)}
        else:
            choice = {"index": 0, "text": gen.text, "logprobs": None, "finish_reason": _finish_reason(gen)}
        if body.return_token_ids:
            choice["token_ids"] = list(gen.token_ids)
        out = {"id": rid, "object": obj, "created": created, "model": cfg.model_name, "choices": [choice],
               "usage": _usage(gen)}
        if body.return_token_ids:
            out["prompt_token_ids"] = list(gen.prompt_ids)
        return JSONResponse(out)

    async def chat_route(request: Request) -> Response:
        return await completions(request, chat=True)

    async def completions_route(request: Request) -> Response:
        return await completions(request, chat=False)

    async def not_found(request: Request, exc: HTTPException) -> Response:
        if exc.status_code == 404:
            return _error(404, f"no route {request.url.path}", code="not_found")
        if exc.status_code == 405:
            return _error(405, f"{request.method} is not allowed on {request.url.path}", code="method_not_allowed",
                          headers=exc.headers)  # Starlette's Allow: the route's methods
        return _error(exc.status_code, str(exc.detail))

    async def crashed(request: Request, exc: Exception) -> Response:
        log.error("internal error on %s: %s: %s", request.url.path, type(exc).__name__, exc,
                  exc_info=log.isEnabledFor(logging.DEBUG))
        return _error(500, f"internal error: {type(exc).__name__}", type="server_error")

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.start()
        try:
            yield
        finally:
            await run_in_threadpool(state.stop)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{name:path}", model_info, methods=["GET"]),
        Route("/v1/chat/completions", chat_route, methods=["POST"]),
        Route("/v1/completions", completions_route, methods=["POST"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: not_found, Exception: crashed})
    return _Guard(app, state)


async def _collect(events: _Events):
    """Wait for the end of a generation; the error message, or None."""
    while True:
        kind, payload = await events.queue.get()
        if kind == "error":
            return payload
        if kind == "done":
            return None


def _stream(state: ServerState, body, gen: Generation, events: _Events, rid: str, created: int, chat: bool):
    from sse_starlette.sse import EventSourceResponse

    cfg = state.cfg
    obj = "chat.completion.chunk" if chat else "text_completion"

    counted = [0]  # tokens streamed so far (continuous usage: one delta per token)

    def chunk(delta_text: str | None, finish: str | None, first: bool = False) -> str:
        if chat:
            delta = {}
            if first:
                delta["role"] = "assistant"
            if delta_text is not None:
                delta["content"] = delta_text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta_text or "", "logprobs": None, "finish_reason": finish}
        if finish is not None and body.return_token_ids:
            choice["token_ids"] = list(gen.token_ids)
        out = {"id": rid, "object": obj, "created": created, "model": cfg.model_name, "choices": [choice]}
        if body.continuous_usage:
            p = len(gen.prompt_ids)
            out["usage"] = {"prompt_tokens": p, "completion_tokens": counted[0], "total_tokens": p + counted[0]}
        return json.dumps(out)

    async def events_out():
        try:
            if chat:
                yield {"data": chunk("", None, first=True)}
            while True:
                kind, payload = await events.queue.get()
                if kind == "delta":
                    if body.continuous_usage:
                        counted[0] += 1
                    yield {"data": chunk(payload, None)}
                elif kind == "error":
                    yield {"data": json.dumps(error_body(f"generation failed: {payload}", "server_error"))}
                    return
                else:
                    if gen.finish_reason == "cancelled":  # shutting down: no [DONE], the answer is cut
                        yield {"data": json.dumps(error_body("the server is shutting down: the request was "
                                                             "cancelled", "server_error", code="cancelled"))}
                        return
                    yield {"data": chunk(None, _finish_reason(gen))}
                    if body.include_usage:
                        yield {"data": json.dumps({"id": rid, "object": obj, "created": created,
                                                   "model": cfg.model_name, "choices": [], "usage": _usage(gen)})}
                    yield {"data": "[DONE]"}
                    return
        finally:
            if not gen.done:
                gen.cancel()  # the client went away (or the server stops): free the slot at the next step

    # on shutdown the engine cancels what runs after --shutdown-timeout; sse-starlette's own cut
    # comes a little later, as a backstop
    return EventSourceResponse(events_out(), ping=15, sep="\n", shutdown_grace_period=cfg.shutdown_timeout + 2,
                               shutdown_event=_anyio_event())


def _anyio_event():
    import anyio

    return anyio.Event()


class _Guard:
    """Outermost ASGI layer: the API key, the body-size bound from Content-Length, request counts."""

    def __init__(self, app, state: ServerState) -> None:
        self.app = app
        self.state = state
        key = state.cfg.api_key
        self.key = key.encode() if key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        route = path if path in ROUTES else ("/v1/models" if path.startswith("/v1/models/") else "other")
        status_seen = {}

        async def send_counted(message) -> None:
            if message["type"] == "http.response.start":
                status_seen["status"] = message["status"]
            await send(message)

        try:
            if self.key is not None and path != "/health" and not self._authorized(scope):
                await _send_json(send_counted, 401, error_body(
                    "invalid or missing API key: send the header 'Authorization: Bearer KEY'",
                    "invalid_request_error", None, "invalid_api_key"), {"www-authenticate": "Bearer"})
                return
            await self.app(scope, receive, send_counted)
        finally:
            self.state.metrics.request(route, status_seen.get("status", 499))

    def _authorized(self, scope) -> bool:
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)
        return False


async def _send_json(send, status: int, body: dict, headers: dict | None = None) -> None:
    raw = json.dumps(body).encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    for k, v in (headers or {}).items():
        hdrs.append((k.encode(), v.encode()))
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": raw})
