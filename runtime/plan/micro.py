"""The planner's micro-benchmarks: each cost of the schedule model measured alone on this machine.

* :func:`measure_disk`: cold reads of the container's expert extents, one request at a time,
  with ``O_DIRECT`` into page-aligned buffers (or ``pread`` after ``posix_fadvise(DONTNEED)``
  where the file system refuses ``O_DIRECT``), fitted to ``t = latency + bytes / bw``;
* :func:`measure_disk_readers`: the same extents read as serving reads them, 1 MiB pieces
  shared by the runtime's reader threads (queue depth = readers), aggregate bytes per second;
* :func:`measure_decomp`: one decode worker decompressing real E chunks with serving's own
  function, bf16 bytes per second;
* :func:`measure_merge`: ``zipmoe.kernels.merge`` on the device, bf16 bytes per second;
* :func:`measure_compute`: one expert's forward for one token.

plan/profile.py explains each figure and how the profile combines them.
"""

from __future__ import annotations

import mmap
import os
import random
import time

import numpy as np

from zipmoe.errors import UsageError

__all__ = ["measure_disk", "measure_disk_readers", "measure_decomp", "measure_merge", "measure_compute"]

ALIGN = 4096


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


def measure_disk_readers(path, ranges: list[tuple[int, int]], readers: int, seconds: float = 1.0, seed: int = 0) -> dict:
    """Cold reads of random expert extents the way serving reads them: each extent cut into the
    runtime's pieces (:meth:`ExpertStore.pieces`), ``readers`` threads taking pieces with
    :meth:`ExpertStore.read_piece` (O_DIRECT where the file system allows it; one ``preadv``
    each, which releases the GIL), so that up to ``readers`` requests are in flight. Stored bytes
    per second over the whole batch. Extents are drawn without repeats while any are left, so
    that the drive's own cache rarely answers."""
    from concurrent.futures import ThreadPoolExecutor

    from zipmoe.runtime.engine.reads import ExpertStore

    readers = max(1, int(readers))
    rng = random.Random(seed)
    order = list(ranges)
    rng.shuffle(order)
    store = ExpertStore(path, None)
    try:
        done = 0
        spent = 0.0
        batches = 0
        with ThreadPoolExecutor(readers) as pool:
            while order and (spent < seconds or batches < 2):
                take, size = [], 0
                while order and (size < (64 << 20) or len(take) < readers):  # about 64 MiB a batch
                    off, ln = order.pop()
                    take.append((off, ln))
                    size += ln
                jobs = []  # (the extent's buffer, one piece of it)
                for off, ln in take:
                    buf = store.new_buffer(off, ln)
                    jobs += [(buf, piece) for piece in store.pieces(off, ln)]
                t0 = time.perf_counter()
                done += sum(pool.map(lambda job: store.read_piece(job[0], *job[1])[0], jobs))
                spent += time.perf_counter() - t0
                batches += 1
        method = "O_DIRECT" if store.direct else "buffered (O_DIRECT refused: the page cache may answer)"
    finally:
        store.close()
    return {"readers": readers, "bw": done / spent if spent > 0 else 0.0, "bytes": int(done), "seconds": spent,
            "method": method, "piece": store.piece}


def measure_decomp(reader, tensors, seconds: float = 0.5) -> dict:
    """One worker decoding real expert tensors' E chunks into a preallocated buffer, with the
    function serving runs (:func:`zipmoe.runtime.engine.decode.decode_exp_into`, checksums
    checked): bf16 bytes per second. ``tensors``: runtime ExpertTensors (plan.layout.expert_tensors)."""
    from zipmoe.codecs.exponent import DecodeContext
    from zipmoe.runtime.engine.decode import decode_exp_into

    work = []
    for t in tensors:
        if not all(seg.e_chunks for seg in t.segments):
            continue
        e_parts = [reader.read_range(*seg.e_range) for seg in t.segments]
        work.append((t, e_parts, np.empty(t.numel, np.uint8)))
    if not work:
        raise UsageError(f"{reader.path} has no compressed expert data to measure decompression with")
    ctx = DecodeContext()
    for t, e_parts, out in work[:2]:  # warm up (library load, first-touch of the buffers)
        decode_exp_into(t, e_parts, out, ctx, True)
    done = 0
    t0 = time.perf_counter()
    elapsed = 0.0
    jobs = 0
    while elapsed < seconds or jobs < len(work):
        t, e_parts, out = work[jobs % len(work)]
        decode_exp_into(t, e_parts, out, ctx, True)
        done += 2 * t.numel
        jobs += 1
        elapsed = time.perf_counter() - t0
    codecs = sorted({c.codec for t, _, _ in work for seg in t.segments for c in seg.e_chunks})
    return {"bw_per_worker": done / elapsed, "codec": ",".join(codecs), "jobs": jobs, "seconds": elapsed,
            "per_job_s": elapsed / jobs}


def measure_admit(reader, tensors, seconds: float = 0.2) -> dict:
    """What a host pool's admission costs the serving thread: the copy of a fetched tensor's E
    and SM parts out of its read buffer into arrays of their own, with the function serving
    runs (:func:`zipmoe.runtime.engine.device_side.own_parts`; a pool keeps them after the read
    buffer is reused), bytes copied per second. On the H100 box a mixed plan spent 219 us per
    fetched tensor admitting where full tensors only spent 36 (docs/benchmarks.md §22k), a cost
    the per-state passes, which serve each state alone and admit nothing, never see."""
    from zipmoe.runtime.engine.device_side import own_parts

    work = []
    for t in tensors:
        ranges = [r for seg in t.segments for r in (seg.e_range, seg.sm_range) if r[1] > 0]
        if not ranges:
            continue
        data = [np.frombuffer(reader.read_range(*r), np.uint8) for r in ranges]
        buf = np.empty(sum(len(d) for d in data) + 4096, np.uint8)  # one buffer, as a read's
        parts, pos = [], 4096
        for d in data:
            buf[pos : pos + len(d)] = d
            parts.append(buf[pos : pos + len(d)])
            pos += len(d)
        work.append(parts)
    if not work:
        return {"bw": 0.0, "jobs": 0, "seconds": 0.0}
    for parts in work[:2]:
        own_parts(parts)
    done, jobs, elapsed = 0, 0, 0.0
    kept: list = []  # a few copies alive at once, as a pool holds them: the heap is not one block reused
    t0 = time.perf_counter()
    while elapsed < seconds or jobs < len(work):
        parts = work[jobs % len(work)]
        kept.append(own_parts(parts))
        if len(kept) > 8:
            kept.pop(0)
        done += sum(p.nbytes for p in parts)
        jobs += 1
        elapsed = time.perf_counter() - t0
    return {"bw": done / elapsed, "jobs": jobs, "seconds": elapsed, "per_job_s": elapsed / jobs,
            "bytes_per_job": done / jobs}


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
