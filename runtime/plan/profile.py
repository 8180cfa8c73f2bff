"""The hardware profile the planner uses: measured on this machine, with this container.

What is measured (each exactly what runtime.schedule_model.Costs counts):

* **disk**: cold reads of the container's expert extents, one request at a time, with
  ``O_DIRECT`` into page-aligned buffers so that the page cache does not answer. Where the file
  system refuses ``O_DIRECT`` (tmpfs, some overlay file systems) the reads fall back to
  ``pread`` after ``posix_fadvise(POSIX_FADV_DONTNEED)`` on the range, and ``disk.method``
  says which was used (``"O_DIRECT"`` or ``"pread+fadvise(DONTNEED)"``; on tmpfs the latter
  measures memory, which is then what the disk is). Small (4 KiB) and expert-sized reads at
  random aligned offsets are fitted by least squares to ``t = latency + bytes / bw``.
* **decompression**: one thread (= one decode worker) decodes the E chunks of real expert
  tensors with the container's codec into a preallocated buffer, checking the chunks'
  checksums as the runtime does (runtime.store): ``decomp_bw_per_worker`` counts **bf16 bytes**
  (2 x numel) per second.
* **merge**: ``zipmoe.kernels.merge`` (numba on the CPU, Triton on CUDA) of E and SM bytes into
  bf16 on the device, bf16 bytes per second.
* **compute**: one expert's forward for one token on the device (bf16 ``F.linear`` of each of
  its compute tensors, plus the activation), with the torch threads the serving process will use
  (``runtime.loader.default_threads(workers)``).
* **runtime** (not with ``quick``): a few greedy tokens served through ``zipmoe.load`` give the
  expert compute as the runtime's hook does it (which replaces the micro-benchmark's
  ``compute_s_per_expert``: on small experts the Python around the matmuls dominates) and
  ``dense_s_per_token``, the time per token outside the sparse layers, and (when every expert
  fits in the budget used) ``layer_overhead_s``, a sparse layer's time beyond its experts'
  computes (the runtime's bookkeeping around them). Two timed passes of 16 decode steps; the
  one with the shorter median step is kept (the dense time is mostly the host launching
  kernels, which any other load on the machine slows). Where the runtime cannot
  load the model, ``runtime.error`` says why and the planner estimates the dense time from the
  GEMV throughput.
* ``runtime.serving`` (6 decode steps with every expert fetched; the faster of two passes) also gives
  ``costs.dense_s_per_token_fetching``, the time outside the sparse layers while experts are
  being fetched: on few cores the decode workers share them with the dense part. The planner
  takes the dense time of a plan between the two, by the share of chosen experts it fetches.
* ``runtime.serving_compressed`` (6 more decode steps, every chosen expert a compressed hit:
  decoded and merged, nothing read) and the all-miss pass above split what serving adds
  (``serving_overheads``): the compressed pass fits ``merge_overhead_s``, the runtime's own
  work per fetched tensor; the all-miss pass then fits ``disk_bw`` down to the rate reads
  reach while serving (the I/O thread shares the host with the decode workers and the serving
  thread). Without the compressed pass (older profiles), the all-miss pass alone sets both.
* Before measuring, ``os.sync()``: pending writes (a ``zipmoe pack`` just before leaves
  gigabytes of dirty pages) would share the disk and the cores with the measurement. On the
  H200 box a profile taken seconds after packing qwen1.5-moe-a2.7b measured 140 ms of dense time
  per token where serving then took about 80 ms (docs/benchmarks.md §7).
* ``costs.merge_on_workers``: true where the runtime merges on its decode workers (CPU device,
  or CUDA without Triton), false where the device merges.

Storage: JSON, ``{"format": "zipmoe-profile/1", "machine": {...}, "container": {...},
"costs": {Costs fields}, "disk": {...}, "decomp": {...}, "merge": {...}, "compute": {...}}``.
By default in ``$ZIPMOE_CACHE_DIR`` or ``$XDG_CACHE_HOME/zipmoe`` or ``~/.cache/zipmoe``, under
``profiles/<machine key>-<container id>.json``, where the machine key hashes the hostname, the
CPU model, the core count and the device. It is reused until the machine or the file changes
(container id, size or mtime): a cached profile that no longer matches is measured again; a
profile file given explicitly (``--profile FILE``) that does not match raises
:class:`~zipmoe.errors.UsageError` (stale profile) naming what changed.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import platform
import random
import socket
import time
from pathlib import Path

import numpy as np

from zipmoe.errors import UsageError

from zipmoe.runtime.plan.simulate import Costs

__all__ = ["PROFILE_FORMAT", "machine_info", "machine_key", "default_profile_path", "measure",
           "load_profile", "save_profile", "check_profile", "costs_of", "get_profile"]

PROFILE_FORMAT = "zipmoe-profile/1"
ALIGN = 4096


# ---------------------------------------------------------------------------------- identity
def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def machine_info(device: str = "cpu") -> dict:
    """What identifies this machine for a profile: host, CPU, cores, device."""
    info = {"hostname": socket.gethostname(), "cpu_model": _cpu_model(), "cores": _cores(), "device": device}
    if device.startswith("cuda"):
        import torch

        info["device_name"] = torch.cuda.get_device_name(torch.device(device))
    return info


def machine_key(info: dict) -> str:
    blob = json.dumps({k: info.get(k) for k in ("hostname", "cpu_model", "cores", "device", "device_name")}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def container_info(path, container_id: str) -> dict:
    st = os.stat(path)
    return {"container_id": container_id, "path": str(Path(path).resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def cache_dir() -> Path:
    if os.environ.get("ZIPMOE_CACHE_DIR"):
        return Path(os.environ["ZIPMOE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "zipmoe"


def default_profile_path(container_id: str, device: str = "cpu", dtype: str = "bfloat16") -> Path:
    suffix = "" if dtype in ("bfloat16", "bf16") else f"-{dtype}"
    return cache_dir() / "profiles" / f"{machine_key(machine_info(device))}-{container_id}{suffix}.json"


# ---------------------------------------------------------------------------------- disk
def _open_direct(path) -> tuple[int, str]:
    flag = getattr(os, "O_DIRECT", 0)
    if flag:
        try:
            fd = os.open(path, os.O_RDONLY | flag)
        except OSError:
            pass
        else:
            buf = mmap.mmap(-1, ALIGN)
            try:
                os.preadv(fd, [buf], 0)
                return fd, "O_DIRECT"
            except OSError:
                os.close(fd)
            finally:
                buf.close()
    return os.open(path, os.O_RDONLY), "pread+fadvise(DONTNEED)"


def _timed_read(fd: int, method: str, buf: mmap.mmap, offset: int, length: int) -> float:
    view = memoryview(buf)[:length]
    if method != "O_DIRECT" and hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    t0 = time.perf_counter()
    done = 0
    while done < length:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            break
        done += got
    dt = time.perf_counter() - t0
    view.release()
    return dt


def measure_disk(path, ranges: list[tuple[int, int]], seconds: float = 1.0, seed: int = 0) -> dict:
    """Cold read latency and bandwidth from reads of ``ranges`` (expert extents) and 4 KiB reads."""
    size = os.stat(path).st_size
    rng = random.Random(seed)
    aligned = []
    for off, ln in ranges:
        a = off // ALIGN * ALIGN
        b = min(size // ALIGN * ALIGN if size % ALIGN == 0 else (size + ALIGN - 1) // ALIGN * ALIGN, -(-(off + ln) // ALIGN) * ALIGN)
        if b > a:
            aligned.append((a, b - a))
    if not aligned:
        aligned = [(0, min(size, 1 << 20) // ALIGN * ALIGN or ALIGN)]
    biggest = max(ln for _, ln in aligned)
    fd, method = _open_direct(path)
    buf = mmap.mmap(-1, biggest + ALIGN)
    samples: list[tuple[int, float]] = []
    try:
        t_end = time.perf_counter() + seconds
        small_max = max(0, size // ALIGN - 1)
        n = 0
        while (time.perf_counter() < t_end or n < 16) and n < 100000:
            if n % 2 == 0:  # 4 KiB read at a random aligned offset
                off = rng.randint(0, small_max) * ALIGN
                samples.append((ALIGN, _timed_read(fd, method, buf, off, min(ALIGN, size - off) if method != "O_DIRECT" else ALIGN)))
            else:
                off, ln = aligned[rng.randrange(len(aligned))]
                if method == "O_DIRECT" and off + ln > size:
                    ln = max(ALIGN, (size - off) // ALIGN * ALIGN)
                samples.append((ln, _timed_read(fd, method, buf, off, ln)))
            n += 1
    finally:
        buf.close()
        os.close(fd)
    x = np.array([s[0] for s in samples], dtype=np.float64)
    t = np.array([s[1] for s in samples], dtype=np.float64)
    # robust fit: medians per size class, then a line through the small and the large class
    small = np.median(t[x == ALIGN])
    big_mask = x > ALIGN
    if big_mask.any():
        xb, tb = x[big_mask], t[big_mask]
        # least squares of t = lat + x / bw on all samples, latency clamped to >= 0
        A = np.stack([np.ones_like(x), x], axis=1)
        (lat, inv_bw), *_ = np.linalg.lstsq(A, t, rcond=None)
        if lat < 0 or inv_bw <= 0:
            lat = max(0.0, float(small) - ALIGN * float(np.sum(tb) / np.sum(xb)))
            inv_bw = max(1e-15, float((np.sum(tb) - lat * len(tb)) / np.sum(xb)))
    else:
        lat, inv_bw = float(small) / 2, float(small) / 2 / ALIGN
    return {"method": method, "latency_s": float(lat), "bw": float(1.0 / inv_bw), "samples": len(samples),
            "bytes": int(x.sum()), "median_4k_s": float(small), "read_sizes": sorted({int(v) for v in x})[:8]}


# ---------------------------------------------------------------------------------- decode
def measure_decomp(reader, entries, seconds: float = 0.5) -> dict:
    """One worker decoding real E chunks into a preallocated buffer: bf16 bytes per second."""
    from zipmoe.codecs.exponent import DecodeContext
    from zipmoe.codecs.reader import decode_exp_into

    work = []
    for e in entries:
        exp = e.chunks_of("exp")
        if not exp:
            continue
        a = exp[0].offset
        b = exp[-1].offset + exp[-1].length
        work.append((e, reader.read_range(a, b - a), np.empty(e.numel, np.uint8)))
    if not work:
        raise UsageError(f"{reader.path} has no compressed expert data to measure decompression with")
    ctx = DecodeContext()
    for e, stored, out in work[:2]:  # warm up (library load, first-touch of the buffers)
        decode_exp_into(e, stored, out, ctx)
    done = 0
    t0 = time.perf_counter()
    elapsed = 0.0
    jobs = 0
    while elapsed < seconds or jobs < len(work):
        e, stored, out = work[jobs % len(work)]
        decode_exp_into(e, stored, out, ctx)
        done += 2 * e.numel
        jobs += 1
        elapsed = time.perf_counter() - t0
    codecs = sorted({c.codec for e, _, _ in work for c in e.chunks_of("exp")})
    return {"bw_per_worker": done / elapsed, "codec": ",".join(codecs), "jobs": jobs, "seconds": elapsed,
            "per_job_s": elapsed / jobs}


def measure_merge(numel: int, device: str = "cpu", seconds: float = 0.3) -> dict:
    """``zipmoe.kernels.merge`` of ``numel`` values on ``device``: bf16 bytes per second."""
    from zipmoe.kernels import merge

    rng = np.random.default_rng(0)
    exp = rng.integers(100, 140, numel, dtype=np.uint8)
    sm = rng.integers(0, 256, numel, dtype=np.uint8)
    sync = lambda: None  # noqa: E731
    if device.startswith("cuda"):
        import torch

        exp_t, sm_t = torch.from_numpy(exp).to(device), torch.from_numpy(sm).to(device)
        out_t = torch.empty(numel, dtype=torch.uint16 if hasattr(torch, "uint16") else torch.int16, device=device)
        args = (exp_t, sm_t, out_t)
        sync = torch.cuda.synchronize
        kernel = "triton"
    else:
        args = (exp, sm, np.empty(numel, np.uint16))
        kernel = "numba"
    merge(*args)
    sync()
    n, t0 = 0, time.perf_counter()
    while True:
        merge(*args)
        n += 1
        if n % 4 == 0:
            sync()
            el = time.perf_counter() - t0
            if el >= seconds:
                break
    return {"bw": 2 * numel * n / el, "kernel": kernel, "numel": numel, "per_merge_s": el / n}


def measure_compute(shapes: list[tuple[int, int]], device: str = "cpu", threads: int | None = None,
                    seconds: float = 0.3, dtype: str = "bfloat16") -> dict:
    """One expert's forward for one token: F.linear of each [out, in] tensor in ``dtype``, + SiLU."""
    import torch
    import torch.nn.functional as F

    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(int(threads))
    try:
        dev = torch.device(device)
        g = torch.Generator(device="cpu").manual_seed(0)
        tdt = torch.float32 if dtype in ("float32", "fp32") else torch.bfloat16
        ws = [(torch.randn(o, i, generator=g) * 0.02).to(dtype=tdt, device=dev) for o, i in shapes]
        xs = [torch.randn(1, i, generator=g).to(dtype=tdt, device=dev) for _, i in shapes]
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

        def one():
            for w, x in zip(ws, xs):
                F.silu(F.linear(x, w))

        with torch.inference_mode():
            for _ in range(3):
                one()
            sync()
            times = []
            t_end = time.perf_counter() + seconds
            while time.perf_counter() < t_end or len(times) < 5:
                t0 = time.perf_counter()
                one()
                sync()
                times.append(time.perf_counter() - t0)
        nbytes = sum(ws[0].element_size() * o * i for o, i in shapes)
        med = float(np.median(times))
        return {"s_per_expert": med, "torch_threads": torch.get_num_threads(), "shapes": [list(s) for s in shapes],
                "bytes_per_s": nbytes / med if med > 0 else 0.0, "runs": len(times)}
    finally:
        torch.set_num_threads(old)


def _mem_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 4 << 30


def load_kwargs(dtype: str) -> dict:
    """``zipmoe.load`` keywords for the compute dtype (omitted for the default, bfloat16)."""
    return {} if dtype in ("bfloat16", "bf16") else {"dtype": dtype}


def _miss_pass(model, rt, prompt, tokens: int) -> dict:
    """Decode ``tokens`` steps with the cache emptied before each: every chosen expert is read,
    decompressed and merged as serving does it. Returns the runtime's counters of those steps
    (mean layer makespan, experts per layer, reads of misses: count, bytes, seconds)."""
    import torch

    from zipmoe.runtime.serve.counters import DecodeClock
    from zipmoe.runtime.serve.loop import loop_generate

    # between two forward steps, forget every cached expert
    clock = DecodeClock(rt.counters, between_steps=rt.cache.clear)
    with torch.inference_mode():
        loop_generate(model, prompt, attention_mask=torch.ones_like(prompt), do_sample=False, min_new_tokens=tokens + 1,
                       max_new_tokens=tokens + 1, streamer=clock)
    d = clock.delta()
    reads, read_bytes, read_s = d["reads_by_state"].get("none", [0, 0, 0.0])
    steps = clock.steps()
    sparse = sum(v[0] for v in d["layer_makespan_s"].values())
    # the time outside the sparse layers while every expert is fetched: on few cores the decode
    # workers share them with the dense part's threads
    dense = float(np.median(steps)) - sparse / max(1, len(steps)) if steps else None
    return {
        "steps": tokens,
        "dense_s_per_token": None if dense is None else max(0.0, dense),
        **_layer_figures(d),
        "reads": int(reads), "read_bytes": int(read_bytes), "read_s": float(read_s),
    }


def _layer_figures(d: dict) -> dict:
    """A pass's mean sparse-layer makespan and experts per layer, from its counters' delta."""
    lm = d["layer_makespan_s"]
    layer_calls = max(1, sum(v[1] for v in lm.values()))
    return {"layer_makespan_s": sum(v[0] for v in lm.values()) / layer_calls,
            "experts_per_layer": int(d["expert_calls"]) / layer_calls}


def _compressed_pass(model, rt, prompt, tokens: int) -> dict:
    """Decode ``tokens`` steps with every chosen expert a compressed hit: a warm pass admits the
    experts it reads to a cache that has only a compressed pool (as large as the runtime's
    pools), then the same greedy steps again are timed. Returns the layer makespan, experts per
    layer and the share of fetched tensors that were compressed hits."""
    import torch

    from zipmoe.runtime.serve.cache import ExpertCache
    from zipmoe.runtime.serve.counters import DecodeClock
    from zipmoe.runtime.serve.loop import loop_generate

    old = rt.cache
    rt.cache = ExpertCache({"compressed": old.capacity_bytes()}, demote=None)
    try:
        kw = dict(attention_mask=torch.ones_like(prompt), do_sample=False, min_new_tokens=tokens + 1,
                  max_new_tokens=tokens + 1)
        with torch.inference_mode():
            loop_generate(model, prompt, **kw)
            clock = DecodeClock(rt.counters)
            loop_generate(model, prompt, streamer=clock, **kw)
    finally:
        rt.cache = old
    d = clock.delta()
    fetched = sum(v for k, v in d["hits"].items() if k != "full")
    return {"steps": tokens, **_layer_figures(d), "compressed_share": d["hits"].get("compressed", 0) / max(1, fetched)}


def serving_overheads(costs: Costs, tensors, serving: dict, workers: int, window: int | None,
                      layer_overhead: float = 0.0, compressed: dict | None = None) -> dict:
    """What the runtime adds, while serving, to the costs measured alone.

    With ``compressed`` (``_compressed_pass``'s figures, at least 90% compressed hits) the two
    passes split it:

    * ``merge_overhead_s``: per fetched tensor, what makes the schedule model's layer of
      compressed hits take as long as the measured one (the serving thread's work per tensor:
      staging buffers, copies and kernel launches, hand-offs between threads, admission);
    * ``disk_bw``: then lowered so that the model's all-miss layer takes as long as the
      measured one: reads while serving go slower than alone (``disk_latency`` stays as
      measured alone).

    This is what the H200 box's CPU and GPU showed on the demo model (docs/benchmarks.md §7):
    per expert, a layer cost grew with the bytes it read (misses, then E-only, then SM-only
    hits), and compressed hits cost far less than the all-miss fit charged them.

    Without ``compressed`` (profiles measured before it, or a pass that could not keep the
    experts compressed), the older rule from the all-miss pass alone (``_miss_pass``):
    ``disk_latency`` gets what the runtime's reads took beyond ``latency + bytes / bw`` on
    average, and the rest of the layer's time becomes ``merge_overhead_s``, charged to every
    fetched tensor (which overcharges compressed hits).
    """
    from dataclasses import replace

    from zipmoe.runtime.plan.simulate import makespan_for_counts

    k = int(round(serving.get("experts_per_layer", 0)))
    kc = int(round((compressed or {}).get("experts_per_layer", 0)))
    if (compressed and compressed.get("compressed_share", 0.0) >= 0.9 and kc >= 1 and k >= 1
            and compressed.get("layer_makespan_s") and serving.get("layer_makespan_s")):
        merge = _fit_merge_overhead(costs, {"compressed": kc}, tensors, workers, window,
                                    compressed["layer_makespan_s"] - layer_overhead)
        c = replace(costs, merge_overhead_s=merge)

        def miss(slower: float) -> float:
            return makespan_for_counts({"none": k}, tensors, workers, replace(c, disk_bw=costs.disk_bw / (1 + slower)), window)

        slower = fit_increase(miss, serving["layer_makespan_s"] - layer_overhead, 100.0, steps=50)
        return {"disk_latency": costs.disk_latency, "disk_bw": costs.disk_bw / (1 + slower), "merge_overhead_s": merge}
    return _serving_overheads_all_miss(costs, tensors, serving, workers, window, layer_overhead)


def _serving_overheads_all_miss(costs: Costs, tensors, serving: dict, workers: int, window: int | None,
                                layer_overhead: float = 0.0) -> dict:
    """The rule for a profile without a compressed pass (``serving_overheads``), from the
    all-miss pass's counters alone:

    * ``disk_latency``: per read, the O_DIRECT latency plus what the runtime's reads took beyond
      ``latency + bytes / bw`` on average;
    * ``merge_overhead_s``: per fetched tensor, the overhead that makes the schedule model's
      layer (every chosen expert a miss) take as long as the measured one.
    """
    from dataclasses import replace

    out = {"disk_latency": serving_read_latency(costs, serving.get("reads", 0), serving.get("read_bytes", 0),
                                                serving.get("read_s", 0.0)),
           "merge_overhead_s": costs.merge_overhead_s}
    k = int(round(serving.get("experts_per_layer", 0)))
    if k >= 1 and serving.get("layer_makespan_s"):
        out["merge_overhead_s"] = _fit_merge_overhead(replace(costs, disk_latency=out["disk_latency"]), {"none": k},
                                                      tensors, workers, window, serving["layer_makespan_s"] - layer_overhead)
    return out


def _fit_merge_overhead(costs: Costs, counts: dict, tensors, workers: int, window: int | None, target: float) -> float:
    """``costs.merge_overhead_s`` plus the per-tensor overhead that makes the schedule model's
    layer of ``counts`` take ``target`` seconds (bisection; nothing added when it already does)."""
    from dataclasses import replace

    from zipmoe.runtime.plan.simulate import makespan_for_counts

    def layer(extra: float) -> float:
        return makespan_for_counts(counts, tensors, workers, replace(costs, merge_overhead_s=costs.merge_overhead_s + extra), window)

    # the makespan grows with the per-tensor overhead, by at least the overhead itself
    return costs.merge_overhead_s + fit_increase(layer, target, max(0.0, target - layer(0.0)))


def serving_read_latency(costs: Costs, reads: int, read_bytes: int, read_s: float) -> float:
    """The per-read latency to plan with: the measured one plus what ``reads`` reads of
    ``read_bytes`` took, on average, beyond ``latency + bytes / bw`` (never less)."""
    if not reads:
        return costs.disk_latency
    alone = reads * costs.disk_latency + read_bytes / costs.disk_bw
    return costs.disk_latency + max(0.0, (read_s - alone) / reads)


def fit_increase(f, target: float, hi: float, steps: int = 40) -> float:
    """The ``x`` in ``[0, hi]`` where the increasing ``f(x)`` reaches ``target`` (bisection); 0 when
    ``f(0)`` already does."""
    lo = 0.0
    if f(0.0) >= target:
        return 0.0
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
    return (lo + hi) / 2


def measure_runtime(path, layout, device: str = "cpu", workers: int = 1, tokens: int = 16, warmup: int = 8,
                    miss_tokens: int = 6) -> dict:
    """Serve a few greedy tokens through the runtime and read its counters.

    Gives what a micro-benchmark cannot: the expert compute as the runtime's hook does it
    (``compute_s_per_expert``: counters' compute time per expert call) and everything that is
    not a sparse layer (``dense_s_per_token``: time per decode step minus the sparse layers'
    makespans: attention, norms, router, the Python around them). The budget holds every expert
    when that fits in a quarter of the free memory, else as much as does.
    """
    import torch

    import zipmoe

    from zipmoe.runtime.serve.counters import DecodeClock
    from zipmoe.runtime.serve.loop import loop_generate
    from zipmoe.runtime.serve.loader import default_threads

    want = layout.min_budget(workers) + layout.total_expert_full + (workers + 2) * layout.expert_working
    budget = int(max(layout.min_budget(workers) * 1.5, min(want, _mem_available() // 4)))
    old = torch.get_num_threads()
    model, tok = zipmoe.load(path, budget=budget, device=device, workers=workers, threads=default_threads(workers),
                             **load_kwargs(layout.dtype))
    try:
        rt = model.zipmoe
        prompt = torch.arange(1, 9, dtype=torch.long).unsqueeze(0)
        if tok is not None:
            prompt = tok("The quick brown fox jumps over the lazy dog.", return_tensors="pt")["input_ids"][:, :16]
        prompt = prompt.to(model.device)
        with torch.inference_mode():
            kw = dict(attention_mask=torch.ones_like(prompt), do_sample=False, min_new_tokens=warmup, max_new_tokens=warmup)
            loop_generate(model, prompt, **kw)
            # two timed passes, the one with the shorter median step kept: the dense time is
            # mostly the host launching kernels, which anything else on the machine slows
            best = None
            for _ in range(2):
                clock = DecodeClock(rt.counters)
                loop_generate(model, prompt, attention_mask=torch.ones_like(prompt), do_sample=False, min_new_tokens=tokens + 1,
                               max_new_tokens=tokens + 1, streamer=clock)
                steps = clock.steps()
                if steps and (best is None or np.median(steps) < np.median(best[0])):
                    best = (steps, clock.delta())
        steps, d = best
        calls = max(1, int(d["expert_calls"]))
        lm = d["layer_makespan_s"]
        sparse_total = sum(v[0] for v in lm.values())
        layer_calls = sum(v[1] for v in lm.values())
        tpot = float(np.median(steps)) if steps else 0.0
        sparse_per_step = sparse_total / max(1, len(steps))
        out = {
            "budget": budget,
            "all_experts_resident": budget >= want,
            "tokens": len(steps),
            "tpot_s": tpot,
            "compute_s_per_expert": float(d["time_s"]["compute"]) / calls,
            "layer_makespan_s": sparse_total / max(1, layer_calls),
            "sparse_s_per_step": sparse_per_step,
            "dense_s_per_token": max(0.0, tpot - sparse_per_step),
            "torch_threads": torch.get_num_threads(),
        }
        if budget >= want and layer_calls:
            # every expert whole: a layer's makespan is its computes plus the runtime's own work
            # around them (routing bookkeeping, cache touches, the hook): the per-layer overhead
            per_layer_experts = int(d["expert_calls"]) / layer_calls
            out["layer_overhead_s"] = max(0.0, out["layer_makespan_s"] - per_layer_experts * out["compute_s_per_expert"])
        try:  # optional: a profile without it plans with the costs measured alone
            # each pass twice, the faster kept: on a shared machine anything else only slows them
            # (the CPU box measured the all-miss layer at 14 and at 18 ms in two profiles)
            out["serving"] = min((_miss_pass(model, rt, prompt, tokens=miss_tokens) for _ in range(2)),
                                 key=lambda p: p["layer_makespan_s"])
            out["serving_compressed"] = min((_compressed_pass(model, rt, prompt, tokens=miss_tokens) for _ in range(2)),
                                            key=lambda p: p["layer_makespan_s"])
        except Exception as exc:  # noqa: BLE001
            out["serving_error"] = f"{type(exc).__name__}: {exc}"
        out["window"] = rt.window
        return out
    finally:
        try:
            model.zipmoe.scheduler.close()
        except Exception:  # noqa: BLE001
            pass
        torch.set_num_threads(old)


# ---------------------------------------------------------------------------------- profile
def measure(path, device: str = "cpu", workers: int | None = None, quick: bool = False, dtype: str = "bfloat16") -> dict:
    """Measure everything for ``path`` on ``device``; returns the profile dict (not saved)."""
    from zipmoe.codecs.reader import ContainerReader

    from zipmoe.runtime.serve.loader import default_threads, default_workers
    from zipmoe.runtime.plan.layout import container_layout

    workers = default_workers() if workers is None else int(workers)
    scale = 0.3 if quick else 1.0
    # write back what is pending (a `zipmoe pack` just before leaves gigabytes of dirty pages):
    # the kernel's writeback would otherwise share the disk and the cores with what we measure
    if hasattr(os, "sync"):
        os.sync()
    with ContainerReader(path) as reader:
        layout = container_layout(reader, dtype, device)
        experts = [e for e in reader.entries if e.role == "expert" and e.dtype == "BF16"]
        rng = random.Random(1)
        sample = rng.sample(experts, min(len(experts), 24))
        ranges = []
        for e in experts:
            ranges.append(tuple(e.extent))
        disk = measure_disk(path, ranges, seconds=1.0 * scale)
        decomp = measure_decomp(reader, sample, seconds=0.5 * scale)
        biggest = max(u[2] // 2 for u in layout.units)
        merge = measure_merge(biggest, device, seconds=0.3 * scale)
        compute = measure_compute([u[1] for u in layout.units], device, threads=default_threads(workers),
                                  seconds=0.3 * scale, dtype=layout.dtype)
        prof = {
            "format": PROFILE_FORMAT,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": machine_info(device),
            "container": container_info(path, reader.container_id),
            "workers": workers,
            "dtype": layout.dtype,
            "disk": disk,
            "decomp": decomp,
            "merge": merge,
            "compute": compute,
        }
    # where the runtime merges: on the CPU device the decode workers do it (runtime.scheduler);
    # on CUDA the device does, with the Triton kernel
    on_workers = not device.startswith("cuda") or merge["kernel"] != "triton"
    prof["merge"]["where"] = "workers" if on_workers else "device"
    compute_s = compute["s_per_expert"]
    dense_s = layer_overhead = None
    if not quick:
        try:
            rt = measure_runtime(path, layout, device, workers)
            prof["runtime"] = rt
            compute_s = rt["compute_s_per_expert"]
            dense_s = rt["dense_s_per_token"]
            layer_overhead = rt.get("layer_overhead_s")
        except Exception as exc:  # noqa: BLE001 - the runtime is optional for a profile
            prof["runtime"] = {"error": f"{type(exc).__name__}: {exc}"}
    prof["costs"] = {
        "disk_bw": disk["bw"],
        "disk_latency": disk["latency_s"],
        "decomp_bw_per_worker": decomp["bw_per_worker"],
        "merge_bw": merge["bw"],
        "compute_s_per_expert": compute_s,
        "merge_on_workers": on_workers,
    }
    if dense_s is not None:
        prof["costs"]["dense_s_per_token"] = dense_s
    if layer_overhead is not None:
        prof["costs"]["layer_overhead_s"] = layer_overhead
    serving = (prof.get("runtime") or {}).get("serving")
    if serving and dense_s is not None and serving.get("dense_s_per_token") is not None:
        prof["costs"]["dense_s_per_token_fetching"] = max(dense_s, serving["dense_s_per_token"])
    if serving:
        prof["costs"].update(serving_overheads(costs_of(prof), layout.tensors, serving, workers,
                                               prof["runtime"].get("window"), layer_overhead or 0.0,
                                               prof["runtime"].get("serving_compressed")))
    return prof


def costs_of(profile: dict) -> Costs:
    c = profile["costs"]
    return Costs(float(c["disk_bw"]), float(c["disk_latency"]), float(c["decomp_bw_per_worker"]),
                 float(c["merge_bw"]), float(c["compute_s_per_expert"]),
                 float(c.get("decomp_overhead_s", 0.0)), float(c.get("merge_overhead_s", 0.0)),
                 bool(c.get("merge_on_workers", False)))


def save_profile(profile: dict, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(profile, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def load_profile(path) -> dict:
    path = Path(path)
    try:
        prof = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"profile {path} does not exist") from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"profile {path} is not a zipmoe profile: {exc}") from None
    if not isinstance(prof, dict) or prof.get("format") != PROFILE_FORMAT or "costs" not in prof:
        raise UsageError(f"profile {path} is not a {PROFILE_FORMAT} file")
    try:
        costs_of(prof)
    except (KeyError, TypeError, ValueError) as exc:
        raise UsageError(f"profile {path} has unusable costs: {exc}") from None
    return prof


def check_profile(profile: dict, container_path, container_id: str, device: str, dtype: str = "bfloat16") -> str | None:
    """None when ``profile`` fits this machine, file and dtype, else why it is stale (one phrase)."""
    m, mine = profile.get("machine", {}), machine_info(device)
    for k in ("hostname", "cpu_model", "cores", "device", "device_name"):
        if m.get(k) != mine.get(k):
            return f"it was measured on another machine ({k}: {m.get(k)!r}, here {mine.get(k)!r})"
    c = profile.get("container", {})
    if c.get("container_id") != container_id:
        return f"it was measured with another container ({c.get('container_id')}, this one is {container_id})"
    st = os.stat(container_path)
    if c.get("size") != st.st_size or c.get("mtime_ns") != st.st_mtime_ns:
        return "the container file changed since it was measured"
    if profile.get("dtype", "bfloat16") != dtype:
        return f"it was measured computing in {profile.get('dtype', 'bfloat16')}, not {dtype}"
    return None


def get_profile(container_path, container_id: str, device: str = "cpu", profile_path=None,
                workers: int | None = None, remeasure: bool = False, quick: bool = False,
                dtype: str = "bfloat16") -> tuple[dict, str]:
    """The profile to plan with, and where it came from (``"measured"``, ``"cached"``, ``"file"``).

    ``profile_path`` given and existing: loaded and checked (stale -> UsageError). Given and
    missing: measured and written there. Not given: the per-machine cache, re-measured when stale.
    """
    if profile_path is not None:
        p = Path(profile_path)
        if p.exists() and not remeasure:
            prof = load_profile(p)
            why = check_profile(prof, container_path, container_id, device, dtype)
            if why:
                raise UsageError(f"profile {p} is stale: {why}; measure again with `zipmoe plan FILE --profile-only --profile {p}` after deleting it")
            return prof, "file"
        prof = measure(container_path, device, workers, quick=quick, dtype=dtype)
        save_profile(prof, p)
        return prof, "measured"
    p = default_profile_path(container_id, device, dtype)
    if p.exists() and not remeasure:
        try:
            prof = load_profile(p)
        except UsageError:
            prof = None
        if prof is not None and check_profile(prof, container_path, container_id, device, dtype) is None:
            return prof, "cached"
    prof = measure(container_path, device, workers, quick=quick, dtype=dtype)
    try:
        save_profile(prof, p)
    except OSError:
        pass  # a read-only home: plan anyway
    return prof, "measured"
