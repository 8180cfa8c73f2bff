"""Load test of `zipmoe serve` (or any OpenAI-style server): throughput, TTFT, TPOT, errors, peak RSS.

Starts ``zipmoe serve FILE --budget B --port 0 --max-batch M`` (or uses ``--url`` of a running
server), then for each concurrency level (default 1, 4 and 16 clients) sends
``max(--requests, clients)`` streamed chat requests of exactly ``--new-tokens`` new tokens
(``ignore_eos``, greedy), ``clients`` at a time, and prints per level:

* throughput: completion tokens of the level / its wall time (tokens/s);
* TTFT: request sent -> arrival of the first chunk that carries content (non-empty
  ``delta.content``; the opening role chunk does not count), p50 and p90 over the level's
  requests (client side: queueing and prefill included);
* TPOT: (arrival of the last content chunk - arrival of the first) / (completion tokens - 1),
  per request, p50 and p90 (the server streams one chunk per token; text it holds back, e.g.
  half a UTF-8 character, merges two tokens into one chunk, and the line says so);
* errors (exceptions, HTTP errors, error events, no ``[DONE]``, answers of another length): must be 0;
* the server's peak RSS (process and children, sampled every 50 ms) and its ``peak held``
  weight bytes (from /metrics) against the budget.

Chunk times are taken as each server-sent event arrives: the stream is read incrementally
(httpx streaming, event by event), not after the body is complete. A figure no request could
give (no content chunk, or only one) prints ``n/a``, not 0. :func:`measure` is the measuring
part, for any URL (tests/test_serve_load.py points it at a fake server with known delays).

    .venv/bin/python benchmarks/serve_load.py /tmp/h16/demo.zmoe --budget 800M --max-batch 16 \\
        --json out/serve_load.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

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


def stream_request(http, url: str, model: str, prompt: str, new_tokens: int, api_key: str | None = None) -> dict:
    """One streamed chat request of exactly ``new_tokens`` new tokens (``ignore_eos``, greedy),
    timed from the SSE stream as it arrives (read incrementally, event by event).

    TTFT: request sent -> the first chunk that carries content (non-empty ``delta.content``, or
    ``text`` for a completions stream; the chat stream's opening role chunk, empty, does not
    count). TPOT: (last content chunk - first content chunk) / (tokens - 1), None with fewer than
    2 content chunks: per token, as vLLM's benchmark counts it (a server may hold a token's text
    back, half a character, and send it with the next: chunks can be fewer than tokens). ``tokens``: the usage's ``completion_tokens`` (the content
    chunks when the server sends no usage). ``ok``: the stream ended with ``[DONE]``, no error
    event, and ``tokens == new_tokens``."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": new_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    times: list[float] = []  # arrival time of each content chunk
    usage = None
    done = False
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
            for choice in obj.get("choices") or []:
                text = (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
                if text:
                    times.append(now)
                    break
    end = time.perf_counter()
    if error is not None:
        raise RuntimeError(f"error event: {error}")
    chunks = len(times)
    tokens = int(usage["completion_tokens"]) if usage and "completion_tokens" in usage else chunks
    return {"ttft": (times[0] - t0) if times else None,
            "tpot": ((times[-1] - times[0]) / (max(tokens, chunks) - 1)) if chunks > 1 else None,
            "chunks": chunks, "tokens": tokens, "done": done,
            "ok": done and tokens == new_tokens, "seconds": end - t0}


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


def run_level(http, url: str, model: str, clients: int, requests: int, new_tokens: int,
              api_key: str | None = None) -> dict:
    """``requests`` streamed requests, ``clients`` at a time (each client thread sends its next
    request when its last has ended); the level's figures."""
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
                r = stream_request(http, url, model, PROMPTS[i % len(PROMPTS)], new_tokens, api_key)
            except Exception as exc:  # noqa: BLE001 - counted, shown
                r = {"error": f"{type(exc).__name__}: {exc}"}
            else:
                if not r["ok"]:
                    r["error"] = (f"{r['tokens']} tokens, not {new_tokens}" if r["done"]
                                  else "the stream ended without [DONE]")
            with lock:
                (errors if "error" in r else results).append(r)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    tpot = [r["tpot"] for r in results if r["tpot"] is not None]
    tokens = sum(r["tokens"] for r in results)
    return {"clients": clients, "requests": requests, "completed": len(results), "errors": len(errors),
            "error_samples": [e.get("error") for e in errors[:3]], "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall if wall else 0.0,
            # requests that streamed no content chunk (no TTFT) or fewer than 2 (no TPOT), and
            # content chunks against tokens (1.0: one chunk per token; less: text held back or merged)
            "no_ttft": len(results) - len(ttft), "no_tpot": len(results) - len(tpot),
            "chunks_per_token": (sum(r["chunks"] for r in results) / tokens) if tokens else None,
            "ttft_p50_s": pct(ttft, 0.5), "ttft_p90_s": pct(ttft, 0.9),
            "tpot_p50_s": pct(tpot, 0.5), "tpot_p90_s": pct(tpot, 0.9)}


def first_model(http, url: str, api_key: str | None = None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    resp = http.get(url.rstrip("/") + "/v1/models", headers=headers)
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


def measure(url: str, *, model: str | None = None, concurrency=(1, 4, 16), requests: int = 4,
            new_tokens: int = 64, api_key: str | None = None, warmup: bool = True, timeout: float = 3600.0,
            progress=None) -> list[dict]:
    """Load-test the OpenAI-style server at ``url`` (``http://host:port``, no ``/v1``): for each
    level of ``concurrency``, ``max(requests, clients)`` streamed chat requests of ``new_tokens``
    tokens, ``clients`` at a time; one dict per level (:func:`run_level`). ``model``: the
    server's first model when None. ``warmup``: one short request first, not counted (first-call
    costs: lazy imports, first reads). ``progress(level)`` is called after each level."""
    import httpx

    clients_max = max(concurrency, default=1)
    limits = httpx.Limits(max_connections=clients_max + 4, max_keepalive_connections=clients_max + 4)
    with httpx.Client(timeout=httpx.Timeout(timeout, connect=30.0), limits=limits) as http:
        model = model or first_model(http, url, api_key)
        if warmup:
            stream_request(http, url, model, "Hello!", 4, api_key)
        levels = []
        for c in concurrency:
            r = run_level(http, url, model, int(c), max(requests, int(c)), new_tokens, api_key)
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
    if r["no_ttft"] or r["no_tpot"]:
        line += f" ({r['no_ttft']} requests streamed no content, {r['no_tpot']} fewer than 2 content chunks)"
    if r["chunks_per_token"] is not None and abs(r["chunks_per_token"] - 1) > 1e-9:
        line += f" ({r['chunks_per_token']:.2f} content chunks per token)"
    if r["error_samples"]:
        line += f" errors: {r['error_samples']}"
    return line


def scrape(url: str, key: str | None) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    out = {}
    for line in httpx.get(url + "/metrics", headers=headers, timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
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
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--serve-args", default="", help="more options for zipmoe serve, e.g. '--device cuda --plan p.json'")
    ap.add_argument("--api-key", default=os.environ.get("ZIPMOE_API_KEY"))
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()
    if not args.url and not args.file:
        ap.error("give a .zmoe file or --url")
    import httpx

    proc = None
    sampler = None
    url = args.url
    if url is None:
        zipmoe = str(Path(sys.executable).with_name("zipmoe"))
        cmd = [zipmoe, "serve", args.file, "--budget", args.budget, "--port", "0", "--max-batch", str(args.max_batch),
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
    levels = []
    try:
        levels = measure(url, model=args.model, concurrency=[int(x) for x in args.concurrency.split(",")],
                         requests=args.requests, new_tokens=args.new_tokens, api_key=args.api_key,
                         progress=lambda r: print(describe(r), file=sys.stderr))
        m = scrape(url, args.api_key)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(120)
        if sampler is not None:
            sampler.running = False
    budget = m.get("zipmoe_budget_bytes", 0)
    out = {"levels": levels, "budget_bytes": budget, "peak_held_bytes": m.get("zipmoe_peak_held_bytes"),
           "peak_rss_bytes": sampler.peak if sampler else None, "max_batch": args.max_batch,
           "new_tokens": args.new_tokens, "exit_code": proc.returncode if proc else None}
    print()
    print("| clients | requests | errors | tokens/s | TTFT p50 / p90 (s) | TPOT p50 / p90 (ms) |")
    print("|---:|---:|---:|---:|---|---|")
    for r in levels:
        print(f"| {r['clients']} | {r['requests']} | {r['errors']} | {r['tokens_per_s']:.2f} | "
              f"{_s(r['ttft_p50_s'])} / {_s(r['ttft_p90_s'])} | "
              f"{_s(r['tpot_p50_s'], 1e3, '.1f')} / {_s(r['tpot_p90_s'], 1e3, '.1f')} |")
    mib = 1 << 20
    print(f"\nbudget {budget / mib:.0f} MiB; peak held (weights) {(out['peak_held_bytes'] or 0) / mib:.0f} MiB; "
          f"peak RSS of the server {(out['peak_rss_bytes'] or 0) / mib:.0f} MiB"
          + (f"; server exit code {out['exit_code']}" if proc else ""))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0 if all(r["errors"] == 0 for r in levels) else 1


if __name__ == "__main__":
    sys.exit(main())
