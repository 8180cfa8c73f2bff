"""Load test of `zipmoe serve` (or any OpenAI-style server): throughput, TTFT, TPOT, errors, peak RSS.

Starts ``zipmoe serve FILE --budget B --port 0 --max-batch M`` (or uses ``--url`` of a running
server), then for each concurrency level (default 1, 4 and 16 clients) sends
``max(--requests, clients)`` streamed chat requests of exactly ``--new-tokens`` new tokens
(``ignore_eos``; greedy, or with ``--temperature T`` sampled, request i seeded with i), ``clients``
at a time, and prints per level:

* throughput: completion tokens of the level / its wall time (tokens/s);
* TTFT: request sent -> arrival of the first token, p50 and p90 over the level's requests
  (client side: queueing and prefill included);
* TPOT: (arrival of the last token - arrival of the first) / (completion tokens - 1), per
  request, p50 and p90.

  Token arrivals: the requests ask for ``stream_options.continuous_usage_stats`` (vLLM's
  extension, which `zipmoe serve` speaks: one chunk per token, each with the usage so far), and
  a token arrives with the chunk whose ``usage.completion_tokens`` first counts it, whether it
  carries text or not (a synth model's byte-level tokenizer decodes most of its ids to nothing:
  timed by content it gave no figure at all). A server that sends no usage per chunk is timed by
  its content chunks (non-empty ``delta.content``; the opening role chunk does not count; text
  held back, e.g. half a UTF-8 character, merges two tokens into one chunk, and the line says
  so); each level says which (``timed_by``);
* distinct chunks: the median share of a request's content chunks that differ (greedy decoding of
  a random-weight model falls into a loop of two or three tokens, near 0%: its cache hits every
  time, so such a level measures a loop; sample to measure a conversation);
* errors (exceptions, HTTP errors, error events, no ``[DONE]``, answers of another length): must be 0;
* the server's peak RSS (process and children, sampled every 50 ms) and its ``peak held``
  weight bytes (from /metrics) against the budget.

Chunk times are taken as each server-sent event arrives: the stream is read incrementally
(httpx streaming, event by event), not after the body is complete. A figure no request could
give (no content chunk, or only one) prints ``n/a``, not 0. :func:`measure` is the measuring
part, for any URL (tests/test_serve_load.py points it at a fake server with known delays).

    .venv/bin/python benchmarks/serve_load.py /tmp/h16/demo.zmoe --budget 800M --max-batch 16 \\
        --json out/serve_load.json

Soak mode (``--soak N``, :func:`soak`): does the server's memory stay flat under load? 20 short
warm-up requests (not counted: 4 one at a time, 16 together), then N streamed requests one after
another and N more from ``2 x --max-batch`` client threads, of ``--new-tokens`` tokens (8 by
default in this mode); about ``--cancel`` (20%) of them, drawn by a ``random.Random(--seed)``
(repeatable), are cut by the client after a random number of content chunks (the stream closed
unread). The server's RSS (process and children) is read after the warm-up, after every 100
requests, after each part and after a 5 s idle pause: the table of samples, the largest
deviation from the post-warm-up RSS, and "flat" when every sample is within +-5% of it. Requests
not cut must all be answered in full (errors: must be 0) and /health must answer 200 at the end;
the exit code is non-zero otherwise. With ``--url``, RSS is read only given ``--pid``.

    .venv/bin/python benchmarks/serve_load.py /tmp/h16/demo.zmoe --budget 800M --max-batch 16 \\
        --soak 1000 --json out/serve_soak.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

# the zipmoe of this interpreter and its PYTHONPATH (a console script may be missing, e.g. with pip --target)
ZIPMOE = [sys.executable, "-m", "zipmoe_cli"]

PROMPTS = [
    "Tell me about the sea.", "What is the capital of France?", "Write a short poem about autumn.",
    "Explain how a bicycle works.", "Give me three tips for learning a language.", "What do bees do?",
    "Describe a busy market.", "Why is the sky blue?",
]


def pct(values, q):
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


class RssSampler(threading.Thread):
    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        import psutil

        self.proc = psutil.Process(pid)
        self.peak = 0
        self.running = True

    def run(self) -> None:
        import psutil

        while self.running:
            try:
                rss = self.proc.memory_info().rss + sum(c.memory_info().rss for c in self.proc.children(True))
                self.peak = max(self.peak, rss)
            except psutil.Error:
                return
            time.sleep(0.05)

    def read(self) -> int:
        """The RSS of the process and its children now, in bytes (the peak kept up to date); a
        child that ends meanwhile counts 0; :class:`psutil.Error` if the process itself is gone."""
        import psutil

        rss = self.proc.memory_info().rss
        for child in self.proc.children(True):
            try:
                rss += child.memory_info().rss
            except psutil.Error:
                pass
        self.peak = max(self.peak, rss)
        return rss


def stream_request(http, url: str, model: str, prompt: str, new_tokens: int, api_key: str | None = None,
                   cancel_after: int | None = None, temperature: float = 0.0, seed: int | None = None) -> dict:
    """One streamed chat request of exactly ``new_tokens`` new tokens (``ignore_eos``; greedy, or
    sampled at ``temperature`` with ``seed``), timed from the SSE stream as it arrives (read
    incrementally, event by event).

    Token times: a chunk whose ``usage.completion_tokens`` (continuous usage, asked for) is
    higher than the last one's brings that many tokens; without usage per chunk, each chunk that
    carries content (non-empty ``delta.content``, or ``text`` for a completions stream; the chat
    stream's opening role chunk, empty, does not count) brings one (``timed_by``: ``"tokens"``
    or ``"content"``). TTFT: request sent -> the first token. TPOT: (last token - first token) /
    (tokens - 1), None with fewer than 2 token arrivals: per token, as vLLM's benchmark counts it
    (a server may hold a token's text back, half a character, and send it with the next: content
    chunks can be fewer than tokens). ``tokens``: the usage's ``completion_tokens`` (the content
    chunks when the server sends no usage). ``ok``: the stream ended with ``[DONE]``, no error
    event, and ``tokens == new_tokens``.

    ``cancel_after``: the client leaves once that many content chunks have come (0: after the
    first event, the role chunk): the stream is closed unread, ``cancelled`` is True (and ``ok``
    False); a stream that ends first is judged as any other. ``distinct``: how many different
    content chunks came (a greedy random-weight model falls into a loop of two or three tokens:
    a level whose answers are loops measures a cache that hits every time)."""
    headers = _auth(api_key)
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": new_tokens,
            "temperature": temperature, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if seed is not None:
        body["seed"] = int(seed)
    times: list[float] = []  # arrival time of each content chunk
    token_times: list[float] = []  # arrival time of each chunk that brought tokens (usage per chunk)
    counted = 0
    texts: set[str] = set()
    usage = None
    done = False
    cancelled = False
    error = None
    t0 = time.perf_counter()
    with http.stream("POST", url.rstrip("/") + "/v1/chat/completions", json=body, headers=headers) as resp:
        if resp.status_code != 200:
            resp.read()
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:200]}")
        for data in sse_events(resp.iter_lines()):
            now = time.perf_counter()
            if data == "[DONE]":
                done = True
                break
            obj = json.loads(data)
            if "error" in obj:
                error = (obj["error"] or {}).get("message", "error event")
                break
            if obj.get("usage"):
                usage = obj["usage"]
                n = int(usage.get("completion_tokens") or 0)
                if obj.get("choices") and n > counted:  # a chunk with the usage so far (not the closing one)
                    token_times.append(now)
                    counted = n
            for choice in obj.get("choices") or []:
                text = (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
                if text:
                    times.append(now)
                    texts.add(text)
                    break
            if cancel_after is not None and len(times) >= cancel_after:
                cancelled = True  # the client goes away: leaving the block closes the stream
                break
    end = time.perf_counter()
    if error is not None:
        raise RuntimeError(f"error event: {error}")
    chunks = len(times)
    tokens = int(usage["completion_tokens"]) if usage and "completion_tokens" in usage else chunks
    timed_by = "tokens" if token_times else "content"
    arrivals = token_times or times
    return {"ttft": (arrivals[0] - t0) if arrivals else None,
            "tpot": ((arrivals[-1] - arrivals[0]) / (max(tokens, chunks) - 1)) if len(arrivals) > 1 else None,
            "chunks": chunks, "distinct": len(texts), "tokens": tokens, "done": done, "timed_by": timed_by,
            "ok": done and tokens == new_tokens, "seconds": end - t0, "cancelled": cancelled}


def sse_events(lines):
    """The ``data`` of each server-sent event of ``lines`` (an iterator of decoded lines, without
    their ends), yielded as soon as the blank line that ends the event arrives; comments (``:
    ping``) and other fields are skipped, several ``data:`` lines of one event are joined by
    newlines."""
    data: list[str] = []
    for line in lines:
        if line == "":
            if data:
                yield "\n".join(data)
                data = []
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        if field == "data":
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield "\n".join(data)


def in_threads(n: int, fn) -> None:
    """``fn`` on ``n`` threads at once; returns when every one has ended."""
    threads = [threading.Thread(target=fn) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def run_level(http, url: str, model: str, clients: int, requests: int, new_tokens: int,
              api_key: str | None = None, temperature: float = 0.0) -> dict:
    """``requests`` streamed requests, ``clients`` at a time (each client thread sends its next
    request when its last has ended); the level's figures. Sampled (``temperature`` > 0), request
    ``i`` carries ``seed`` ``i``, so every level sends the same requests."""
    lock = threading.Lock()
    todo = list(range(requests))
    results, errors = [], []

    def worker():
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop(0)
            try:
                r = stream_request(http, url, model, PROMPTS[i % len(PROMPTS)], new_tokens, api_key,
                                   temperature=temperature, seed=i if temperature > 0 else None)
            except Exception as exc:  # noqa: BLE001 - counted, shown
                r = {"error": f"{type(exc).__name__}: {exc}"}
            else:
                if not r["ok"]:
                    r["error"] = (f"{r['tokens']} tokens, not {new_tokens}" if r["done"]
                                  else "the stream ended without [DONE]")
            with lock:
                (errors if "error" in r else results).append(r)

    t0 = time.perf_counter()
    in_threads(clients, worker)
    wall = time.perf_counter() - t0
    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    tpot = [r["tpot"] for r in results if r["tpot"] is not None]
    tokens = sum(r["tokens"] for r in results)
    return {"clients": clients, "requests": requests, "completed": len(results), "errors": len(errors),
            "error_samples": [e.get("error") for e in errors[:3]], "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall if wall else 0.0,
            # requests with no token arrival (no TTFT) or fewer than 2 (no TPOT); how the tokens
            # were timed (by the usage per chunk, or by content chunks); content chunks against
            # tokens (1.0: one chunk per token; less: text held back or merged, or tokens of no text)
            "no_ttft": len(results) - len(ttft), "no_tpot": len(results) - len(tpot),
            "timed_by": sorted({r["timed_by"] for r in results}),
            "chunks_per_token": (sum(r["chunks"] for r in results) / tokens) if tokens else None,
            # different content chunks per content chunk, the median over requests (a loop: near 0)
            "distinct_p50": pct([r["distinct"] / r["chunks"] for r in results if r["chunks"]], 0.5),
            "ttft_p50_s": pct(ttft, 0.5), "ttft_p90_s": pct(ttft, 0.9),
            "tpot_p50_s": pct(tpot, 0.5), "tpot_p90_s": pct(tpot, 0.9)}


def first_model(http, url: str, api_key: str | None = None) -> str:
    headers = _auth(api_key)
    resp = http.get(url.rstrip("/") + "/v1/models", headers=headers)
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


def measure(url: str, *, model: str | None = None, concurrency=(1, 4, 16), requests: int = 4,
            new_tokens: int = 64, api_key: str | None = None, warmup: bool = True, timeout: float = 3600.0,
            progress=None, temperature: float = 0.0) -> list[dict]:
    """Load-test the OpenAI-style server at ``url`` (``http://host:port``, no ``/v1``): for each
    level of ``concurrency``, ``max(requests, clients)`` streamed chat requests of ``new_tokens``
    tokens, ``clients`` at a time; one dict per level (:func:`run_level`). ``model``: the
    server's first model when None. ``warmup``: one short request first, not counted (first-call
    costs: lazy imports, first reads). ``progress(level)`` is called after each level.
    ``temperature``: 0 greedy, else sampled with seeds (:func:`run_level`)."""
    import httpx

    clients_max = max(concurrency, default=1)
    limits = httpx.Limits(max_connections=clients_max + 4, max_keepalive_connections=clients_max + 4)
    with httpx.Client(timeout=httpx.Timeout(timeout, connect=30.0), limits=limits) as http:
        model = model or first_model(http, url, api_key)
        if warmup:
            stream_request(http, url, model, "Hello!", 4, api_key)
        levels = []
        for c in concurrency:
            r = run_level(http, url, model, int(c), max(requests, int(c)), new_tokens, api_key, temperature)
            levels.append(r)
            if progress is not None:
                progress(r)
        return levels


def _s(v, scale: float = 1.0, fmt: str = ".2f") -> str:
    return "n/a" if v is None else format(v * scale, fmt)


def describe(r: dict) -> str:
    """One level as a line."""
    line = (f"{r['clients']:>3} clients: {r['completed']}/{r['requests']} ok, {r['errors']} errors, "
            f"{r['tokens_per_s']:.2f} tok/s, TTFT p50 {_s(r['ttft_p50_s'])} s p90 {_s(r['ttft_p90_s'])} s, "
            f"TPOT p50 {_s(r['tpot_p50_s'], 1e3, '.1f')} ms p90 {_s(r['tpot_p90_s'], 1e3, '.1f')} ms")
    if r.get("timed_by"):
        line += f" (timed by {' and '.join(r['timed_by'])})"
    if r["no_ttft"] or r["no_tpot"]:
        line += f" ({r['no_ttft']} requests streamed no token, {r['no_tpot']} fewer than 2 token arrivals)"
    if r["chunks_per_token"] is not None and abs(r["chunks_per_token"] - 1) > 1e-9:
        line += f" ({r['chunks_per_token']:.2f} content chunks per token)"
    if r.get("distinct_p50") is not None:
        line += f", distinct chunks {r['distinct_p50']:.0%} (median)"
    if r["error_samples"]:
        line += f" errors: {r['error_samples']}"
    return line


def _auth(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def parse_metrics(text: str) -> dict:
    """Prometheus text as {sample with its labels: value}."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def scrape(url: str, key: str | None) -> dict:
    import httpx

    return parse_metrics(httpx.get(url + "/metrics", headers=_auth(key), timeout=30).text)


SOAK_TOLERANCE = 0.05  # every RSS sample after the warm-up within +-5% of the post-warm-up RSS: flat


def _metrics_or_none(http, url: str, api_key: str | None) -> dict | None:
    """/metrics as {name: value}, or None where the server has none (not zipmoe, an error)."""
    headers = _auth(api_key)
    try:
        resp = http.get(url.rstrip("/") + "/metrics", headers=headers, timeout=30)
        return parse_metrics(resp.text) if resp.status_code == 200 else None
    except Exception:  # noqa: BLE001 - optional figures
        return None


def _health(http, url: str) -> int | None:
    """The status code of GET /health, None when the server does not answer."""
    try:
        return http.get(url.rstrip("/") + "/health", timeout=30).status_code
    except Exception:  # noqa: BLE001 - reported
        return None


def soak(url: str, n: int, *, model: str | None = None, new_tokens: int = 8, max_batch: int = 16,
         api_key: str | None = None, rss=None, cancel: float = 0.2, seed: int = 0, warmup: int = 20,
         every: int = 100, idle_s: float = 5.0, tolerance: float = SOAK_TOLERANCE, timeout: float = 600.0,
         progress=None) -> dict:
    """Soak the OpenAI-style server at ``url``: does its memory stay flat, does it keep serving?

    ``warmup`` short requests first, not counted (a fifth one at a time, the rest together, so
    that the lone-request path and the batched one have both run); then ``n`` streamed requests
    of ``new_tokens`` tokens one after another, then ``n`` more from ``2 * max_batch`` client
    threads. Each request is cut by the client with probability ``cancel``, after a number of
    content chunks drawn from 0 .. ``new_tokens`` - 1 (:func:`stream_request`'s
    ``cancel_after``); the prompts and the cuts come from ``random.Random(seed)``, drawn before
    each part starts, so a run is repeatable. A request not cut must be answered in full (``ok``
    as :func:`stream_request` says); anything else (an exception, an HTTP error, an error event,
    also before a cut) is an error.

    ``rss``: a callable giving the server's RSS now, in bytes (:meth:`RssSampler.read`), or None
    (then no RSS figures, errors only). It is read after the warm-up (the baseline), after every
    ``every`` requests, after each part and after ``idle_s`` seconds of idle; ``flat``: every
    sample after the warm-up within ``tolerance`` (a fraction) of the baseline. At the end
    ``/health`` must answer 200. ``passed``: no errors, /health 200 and (with ``rss``) flat.
    ``progress(sample)`` is called after each RSS sample."""
    import httpx

    rng = random.Random(seed)
    clients = max(1, 2 * int(max_batch))

    def plan(count: int) -> list[tuple[str, int | None]]:
        out = []
        for _ in range(count):
            prompt = rng.choice(PROMPTS)
            cut = rng.randrange(new_tokens) if rng.random() < cancel else None
            out.append((prompt, cut))
        return out

    samples: list[dict] = []
    lock = threading.Lock()
    t_start = time.perf_counter()

    def sample(label: str, requests: int) -> None:
        if rss is None:
            return
        row = {"at": label, "requests": requests, "t_s": round(time.perf_counter() - t_start, 3)}
        try:
            row["rss_bytes"] = int(rss())
        except Exception as exc:  # noqa: BLE001 - the server gone: no figure, not flat
            row["rss_bytes"] = None
            row["error"] = f"{type(exc).__name__}: {exc}"
        samples.append(row)
        if progress is not None:
            progress(row)

    def one(http, prompt: str, cut: int | None) -> dict:
        try:
            r = stream_request(http, url, model, prompt, new_tokens, api_key, cancel_after=cut)
        except Exception as exc:  # noqa: BLE001 - counted, shown
            return {"error": f"{type(exc).__name__}: {exc}", "planned_cut": cut}
        r["planned_cut"] = cut
        if not r["cancelled"] and not r["ok"]:
            r["error"] = (f"{r['tokens']} tokens, not {new_tokens}" if r["done"]
                          else "the stream ended without [DONE]")
        return r

    def tally(results: list[dict], part_clients: int, wall: float) -> dict:
        errors = [r for r in results if "error" in r]
        cut = [r for r in results if "error" not in r and r["cancelled"]]
        return {"clients": part_clients, "requests": len(results), "completed": len(results) - len(errors) - len(cut),
                "cancelled": len(cut), "errors": len(errors),
                # cuts drawn but not made: the stream ended before that many content chunks came
                "cut_not_reached": sum(1 for r in results if "error" not in r and not r["cancelled"]
                                       and r["planned_cut"] is not None),
                "error_samples": [e["error"] for e in errors[:3]], "wall_s": wall}

    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    with httpx.Client(timeout=httpx.Timeout(timeout, connect=30.0), limits=limits) as http:
        model = model or first_model(http, url, api_key)
        # warm-up, not counted: the lone-request path, then the batched one
        lone = max(1, warmup // 5) if warmup else 0
        for i in range(lone):
            one(http, PROMPTS[i % len(PROMPTS)], None)
        rest = list(range(warmup - lone))
        warm_errors = []

        def warm_worker():
            while True:
                with lock:
                    if not rest:
                        return
                    i = rest.pop()
                r = one(http, PROMPTS[i % len(PROMPTS)], None)
                if "error" in r:
                    with lock:
                        warm_errors.append(r["error"])

        threads = [threading.Thread(target=warm_worker) for _ in range(min(len(rest), clients))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        before = _metrics_or_none(http, url, api_key)
        sample("after warm-up", 0)

        total = 2 * n
        count = 0

        def counted() -> None:  # under ``lock`` where threads run
            nonlocal count
            count += 1
            if every and count % every == 0 and count not in (n, total):
                sample(f"after {count} requests", count)

        seq_plan = plan(n)
        seq: list[dict] = []
        t0 = time.perf_counter()
        for prompt, cut in seq_plan:
            seq.append(one(http, prompt, cut))
            counted()
        seq_part = tally(seq, 1, time.perf_counter() - t0)
        sample("after sequential", count)

        todo = list(reversed(plan(n)))
        conc: list[dict] = []

        def worker():
            while True:
                with lock:
                    if not todo:
                        return
                    prompt, cut = todo.pop()
                r = one(http, prompt, cut)
                with lock:
                    conc.append(r)
                    counted()

        t0 = time.perf_counter()
        in_threads(clients, worker)
        conc_part = tally(conc, clients, time.perf_counter() - t0)
        sample("after concurrent", count)
        time.sleep(idle_s)
        sample(f"after {idle_s:g} s idle", count)
        health = _health(http, url)
        after = _metrics_or_none(http, url, api_key)

    key = 'zipmoe_generations_total{reason="cancelled"}'
    server_cancelled = (after.get(key, 0) - (before or {}).get(key, 0)) if after and before is not None else None
    errors = seq_part["errors"] + conc_part["errors"]
    base = samples[0]["rss_bytes"] if samples else None
    deviation = None
    flat = None
    if rss is not None:
        for row in samples[1:]:
            row["deviation_pct"] = (100.0 * (row["rss_bytes"] - base) / base
                                    if base and row["rss_bytes"] is not None else None)
        devs = [row["deviation_pct"] for row in samples[1:]]
        flat = bool(devs) and all(d is not None and abs(d) <= 100.0 * tolerance for d in devs)
        known = [d for d in devs if d is not None]
        deviation = max(known, key=abs) if known else None
    return {"n": n, "new_tokens": new_tokens, "max_batch": max_batch, "clients": clients, "seed": seed,
            "cancel_fraction": cancel, "warmup": warmup, "warmup_errors": len(warm_errors),
            "sequential": seq_part, "concurrent": conc_part,
            "requests": seq_part["requests"] + conc_part["requests"],
            "completed": seq_part["completed"] + conc_part["completed"],
            "cancelled": seq_part["cancelled"] + conc_part["cancelled"], "errors": errors,
            "error_samples": (seq_part["error_samples"] + conc_part["error_samples"])[:3],
            "server_cancelled": server_cancelled,
            "requests_running_after": after.get("zipmoe_requests_running") if after else None,
            "rss_samples": samples if rss is not None else None, "rss_baseline_bytes": base,
            "rss_max_deviation_pct": deviation, "tolerance_pct": 100.0 * tolerance, "flat": flat,
            "health_status": health, "idle_s": idle_s, "wall_s": time.perf_counter() - t_start,
            "passed": errors == 0 and health == 200 and flat is not False}


def describe_soak(res: dict) -> str:
    """The soak's report: the parts, the RSS table, the verdict."""
    mib = 1 << 20
    lines = []
    for name in ("sequential", "concurrent"):
        p = res[name]
        line = (f"{name} ({p['clients']} client{'s' if p['clients'] != 1 else ''}): {p['requests']} requests, "
                f"{p['completed']} answered in full, {p['cancelled']} cut by the client, {p['errors']} errors, "
                f"{p['wall_s']:.1f} s")
        if p["cut_not_reached"]:
            line += f" ({p['cut_not_reached']} cuts drawn came after the answer's end)"
        if p["error_samples"]:
            line += f" errors: {p['error_samples']}"
        lines.append(line)
    if res["warmup_errors"]:
        lines.append(f"warm-up: {res['warmup_errors']} of {res['warmup']} requests failed (not counted)")
    if res["server_cancelled"] is not None:
        running = res["requests_running_after"]
        lines.append(f"server: {res['server_cancelled']:.0f} generations cancelled (zipmoe_generations_total), "
                     f"{'n/a' if running is None else format(running, '.0f')} requests running after the idle pause")
    if res["rss_samples"] is None:
        lines.append("RSS: not read (--url without --pid): errors only")
    else:
        lines += ["", "| sample | requests | RSS (MiB) | vs after warm-up |", "|---|---:|---:|---:|"]
        for row in res["rss_samples"]:
            v = row["rss_bytes"]
            d = row.get("deviation_pct")
            lines.append(f"| {row['at']} | {row['requests']} | {'n/a' if v is None else format(v / mib, '.1f')} | "
                         f"{'-' if 'deviation_pct' not in row else ('n/a' if d is None else format(d, '+.2f') + '%')} |")
        dev = res["rss_max_deviation_pct"]
        lines += ["", f"RSS: largest deviation from the post-warm-up RSS {'n/a' if dev is None else format(dev, '+.2f') + '%'} "
                      f"(flat: every sample within +-{res['tolerance_pct']:g}%): {'flat' if res['flat'] else 'NOT flat'}"]
    lines.append(f"/health after: {res['health_status'] if res['health_status'] is not None else 'no answer'}; "
                 f"errors: {res['errors']}; soak {'passed' if res['passed'] else 'FAILED'}")
    return "\n".join(lines)


def chat_runs(args) -> list[dict]:
    """``zipmoe chat FILE --budget B --prompt P --max-new-tokens N --greedy --json``, one cold process per
    prompt of the first level (the prompts the 1-client level sends, in its order): TTFT, TPOT, tokens."""
    extra = (args.chat_args if args.chat_args is not None else args.serve_args).split()
    out = []
    for i, prompt in enumerate(PROMPTS[: max(1, min(args.requests, len(PROMPTS)))]):
        how = ["--temperature", str(args.temperature), "--seed", str(i)] if args.temperature > 0 else ["--greedy"]
        cmd = [*ZIPMOE, "chat", args.file, "--budget", args.budget, "--prompt", prompt, "--max-new-tokens",
               str(args.new_tokens), *how, "--json", *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
        try:
            doc = json.loads(proc.stdout)
            st = doc["stats"]
            row = {"prompt": prompt, "tokens": len(doc["token_ids"]), "tpot_s": st.get("tpot_s"), "ttft_s": st.get("ttft_s")}
        except (ValueError, KeyError):
            row = {"prompt": prompt, "error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]}
        print("chat:", json.dumps(row), file=sys.stderr)
        out.append(row)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file", nargs="?", help="the .zmoe to serve (or give --url)")
    ap.add_argument("--url", help="a running server instead (e.g. http://127.0.0.1:8000)")
    ap.add_argument("--model", help="model id (default: the server's first model, from /v1/models)")
    ap.add_argument("--budget", default="800M")
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--requests", type=int, default=4, help="requests per level: max(this, clients)")
    ap.add_argument("--new-tokens", type=int, default=None, help="new tokens per request (default 64; 8 with --soak)")
    ap.add_argument("--serve-args", default="", help="more options for zipmoe serve, e.g. '--device cuda --plan p.json'")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy (default); above: sampled, request i with seed i (chat runs too), a workload "
                         "that does not fall into the loop greedy decoding of a random-weight model does")
    ap.add_argument("--api-key", default=os.environ.get("ZIPMOE_API_KEY"))
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--chat", action="store_true",
                    help="first: `zipmoe chat FILE --greedy --json` on each of the first level's prompts, one cold "
                         "process each, for the lone request's TPOT beside chat's")
    ap.add_argument("--chat-args", default=None, help="options for those chat runs (default: --serve-args)")
    ap.add_argument("--soak", type=int, metavar="N", default=None,
                    help="soak mode instead of the levels: N sequential then N concurrent requests (2 x --max-batch "
                         "clients), some cut by the client; the server's RSS must stay within +-5%% of its RSS after "
                         "the warm-up, no errors, /health 200 at the end")
    ap.add_argument("--cancel", type=float, default=0.2, help="--soak: fraction of requests the client cuts")
    ap.add_argument("--seed", type=int, default=0, help="--soak: seed of the prompts and cuts")
    ap.add_argument("--idle", type=float, default=5.0, help="--soak: idle seconds before the last RSS sample")
    ap.add_argument("--pid", type=int, help="--soak with --url: the server's process id, to read its RSS")
    args = ap.parse_args()
    if not args.url and not args.file:
        ap.error("give a .zmoe file or --url")
    if args.soak is not None and args.soak < 1:
        ap.error("--soak N needs N >= 1")
    if args.new_tokens is None:
        args.new_tokens = 8 if args.soak else 64
    import httpx

    chat = chat_runs(args) if args.chat and args.file and not args.soak else None
    proc = None
    sampler = None
    url = args.url
    if url is None:
        cmd = [*ZIPMOE, "serve", args.file, "--budget", args.budget, "--port", "0", "--max-batch", str(args.max_batch),
               *args.serve_args.split()]
        log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"serve_load.{os.getpid()}.log", "w+")
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        if args.api_key:
            env["ZIPMOE_API_KEY"] = args.api_key
        print("starting:", " ".join(cmd), file=sys.stderr)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        sampler = RssSampler(proc.pid)
        sampler.start()
        t0 = time.time()
        while url is None:
            log.seek(0)
            m = re.search(r"listening on (http://\S+)", log.read())
            if m:
                url = m.group(1)
            elif proc.poll() is not None:
                log.seek(0)
                print(log.read(), file=sys.stderr)
                return 1
            time.sleep(0.2)
        while True:
            try:
                if httpx.get(url + "/health", timeout=10).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None:
                log.seek(0)
                print(log.read(), file=sys.stderr)
                return 1
            time.sleep(0.5)
        print(f"loaded in {time.time() - t0:.1f} s", file=sys.stderr)
    if args.soak:
        return soak_main(args, url, proc, sampler)
    levels = []
    try:
        levels = measure(url, model=args.model, concurrency=[int(x) for x in args.concurrency.split(",")],
                         requests=args.requests, new_tokens=args.new_tokens, api_key=args.api_key,
                         progress=lambda r: print(describe(r), file=sys.stderr), temperature=args.temperature)
        m = scrape(url, args.api_key)
    finally:
        stop_server(proc, sampler)
    budget = m.get("zipmoe_budget_bytes", 0)
    out = {"levels": levels, "budget_bytes": budget, "peak_held_bytes": m.get("zipmoe_peak_held_bytes"),
           "peak_rss_bytes": sampler.peak if sampler else None, "max_batch": args.max_batch,
           "new_tokens": args.new_tokens, "temperature": args.temperature,
           "exit_code": proc.returncode if proc else None, "chat": chat}
    print()
    print("| clients | requests | errors | tokens/s | TTFT p50 / p90 (s) | TPOT p50 / p90 (ms) | distinct chunks |")
    print("|---:|---:|---:|---:|---|---|---:|")
    for r in levels:
        print(f"| {r['clients']} | {r['requests']} | {r['errors']} | {r['tokens_per_s']:.2f} | "
              f"{_s(r['ttft_p50_s'])} / {_s(r['ttft_p90_s'])} | "
              f"{_s(r['tpot_p50_s'], 1e3, '.1f')} / {_s(r['tpot_p90_s'], 1e3, '.1f')} | "
              f"{_s(r.get('distinct_p50'), 100, '.0f')}% |")
    if chat:
        tp = sorted(c["tpot_s"] for c in chat if c.get("tpot_s"))
        one = next((r for r in levels if r["clients"] == 1), None)
        if tp and one and one["tpot_p50_s"]:
            med = tp[len(tp) // 2]
            print(f"\nzipmoe chat (cold, one process per prompt): TPOT median {med * 1e3:.1f} ms over {len(tp)} prompts "
                  f"({', '.join(str(c.get('tokens')) for c in chat)} tokens); serve, 1 client: p50 "
                  f"{one['tpot_p50_s'] * 1e3:.1f} ms = {one['tpot_p50_s'] / med:.2f}x chat's")
    mib = 1 << 20
    print(f"\nbudget {budget / mib:.0f} MiB; peak held (weights) {(out['peak_held_bytes'] or 0) / mib:.0f} MiB; "
          f"peak RSS of the server {(out['peak_rss_bytes'] or 0) / mib:.0f} MiB"
          + (f"; server exit code {out['exit_code']}" if proc else ""))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0 if all(r["errors"] == 0 for r in levels) else 1


def stop_server(proc, sampler) -> None:
    """End the server this script started (if it did) and its RSS sampling."""
    if proc is not None:
        proc.terminate()
        proc.wait(120)
    if sampler is not None:
        sampler.running = False


def soak_main(args, url: str, proc, sampler) -> int:
    """``--soak N``: :func:`soak` on ``url`` (the server ``proc`` started, or ``--url``), its
    report, ``--json``; 0 when it passed."""
    mib = 1 << 20
    rss = sampler.read if sampler is not None else None
    if rss is None and args.pid:
        rss = RssSampler(args.pid).read
    if rss is None:
        print("RSS cannot be read: --url without --pid (the server's process id); reporting errors only",
              file=sys.stderr)

    def show(row):
        v = row["rss_bytes"]
        print(f"RSS {row['at']}: {'n/a' if v is None else format(v / mib, '.1f')} MiB", file=sys.stderr)

    try:
        res = soak(url, args.soak, model=args.model, new_tokens=args.new_tokens, max_batch=args.max_batch,
                   api_key=args.api_key, rss=rss, cancel=args.cancel, seed=args.seed, idle_s=args.idle,
                   progress=show)
    finally:
        stop_server(proc, sampler)
    res["peak_rss_bytes"] = sampler.peak if sampler else None  # every 50 ms, from the start of the server
    res["exit_code"] = proc.returncode if proc else None
    print()
    print(describe_soak(res))
    if sampler is not None:
        print(f"peak RSS of the server (sampled every 50 ms since its start) {sampler.peak / mib:.1f} MiB; "
              f"server exit code {res['exit_code']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"soak": res}, indent=2) + "\n")
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
