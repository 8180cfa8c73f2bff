"""Load test of `zipmoe serve` with the official openai client: throughput, TTFT, TPOT, errors, peak RSS.

Starts ``zipmoe serve FILE --budget B --port 0 --max-batch M`` (or uses ``--url`` of a running
server), then for each concurrency level (default 1, 4 and 16 clients) sends
``max(--requests, clients)`` streamed chat requests of exactly ``--new-tokens`` new tokens
(``ignore_eos``, greedy), ``clients`` at a time, and prints per level:

* throughput: completion tokens of the level / its wall time (tokens/s);
* TTFT: request sent -> first text chunk, p50 and p90 (client side, queueing included);
* TPOT: (last chunk - first text chunk) / (tokens - 1), per request, p50 and p90;
* errors (exceptions, or answers of another length): must be 0;
* the server's peak RSS (process and children, sampled every 50 ms) and its ``peak held``
  weight bytes (from /metrics) against the budget.

    .venv/bin/python benchmarks/serve_load.py /tmp/h16/demo.zmoe --budget 800M --max-batch 16 \\
        --json out/serve_load.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
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


def one_request(client, model: str, prompt: str, new_tokens: int) -> dict:
    t0 = time.perf_counter()
    first = last = None
    text = []
    usage = None
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=new_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            now = time.perf_counter()
            first = first or now
            last = now
            text.append(chunk.choices[0].delta.content)
    n = usage.completion_tokens if usage else 0
    return {"ttft": (first - t0) if first else None,
            "tpot": ((last - first) / (n - 1)) if first and n > 1 else None,
            "tokens": n, "ok": n == new_tokens, "seconds": time.perf_counter() - t0}


def run_level(client, model: str, clients: int, requests: int, new_tokens: int) -> dict:
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
                r = one_request(client, model, PROMPTS[i % len(PROMPTS)], new_tokens)
                (results if r["ok"] else errors).append(r)
            except Exception as exc:  # noqa: BLE001 - counted, shown
                errors.append({"error": f"{type(exc).__name__}: {exc}"})

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
            "ttft_p50_s": pct(ttft, 0.5), "ttft_p90_s": pct(ttft, 0.9),
            "tpot_p50_s": pct(tpot, 0.5), "tpot_p90_s": pct(tpot, 0.9)}


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
    ap.add_argument("--model", help="model id (default: the file's stem, or the server's first model)")
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
    import openai

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
    client = openai.OpenAI(base_url=url + "/v1", api_key=args.api_key or "none", max_retries=0, timeout=3600)
    model = args.model or (Path(args.file).stem if args.file else client.models.list().data[0].id)
    # warm-up: one short request (first-call costs: lazy imports, first reads)
    one_request(client, model, "Hello!", 4)
    levels = []
    try:
        for c in [int(x) for x in args.concurrency.split(",")]:
            r = run_level(client, model, c, max(args.requests, c), args.new_tokens)
            levels.append(r)
            print(f"{c:>3} clients: {r['completed']}/{r['requests']} ok, {r['errors']} errors, "
                  f"{r['tokens_per_s']:.2f} tok/s, TTFT p50 {r['ttft_p50_s'] or 0:.2f} s p90 {r['ttft_p90_s'] or 0:.2f} s, "
                  f"TPOT p50 {(r['tpot_p50_s'] or 0) * 1e3:.0f} ms p90 {(r['tpot_p90_s'] or 0) * 1e3:.0f} ms",
                  file=sys.stderr)
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
    print(f"| clients | requests | errors | tokens/s | TTFT p50 / p90 (s) | TPOT p50 / p90 (ms) |")
    print("|---:|---:|---:|---:|---|---|")
    for r in levels:
        print(f"| {r['clients']} | {r['requests']} | {r['errors']} | {r['tokens_per_s']:.2f} | "
              f"{r['ttft_p50_s'] or 0:.2f} / {r['ttft_p90_s'] or 0:.2f} | "
              f"{(r['tpot_p50_s'] or 0) * 1e3:.0f} / {(r['tpot_p90_s'] or 0) * 1e3:.0f} |")
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
