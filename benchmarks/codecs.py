"""Exponent codecs on synthetic bf16 tensors: size vs the bound, decode + merge speed per core.

    python benchmarks/codecs.py [--values 64Mi] [--shard-size 1M] [--repeat 3]

For 64 Mi bf16 values drawn from a normal and a Student-t (5 degrees of freedom) distribution
(scale 0.02, rounded to bf16 by torch), prints for each codec: the stored size as % of the bf16
bytes (E chunks in shards + raw SM bytes, as `zipmoe pack` stores them, without the 4096-byte
padding), next to the bound (8 + H(exp)) / 16; and decode + merge throughput on one thread:
each shard is decoded into one reused buffer and merged with its SM bytes into the output
(GB/s of bf16 output, 1 GB = 1e9 bytes, best of --repeat; ``--clock cpu`` times by the
thread's CPU time, the fair per-core figure on a machine shared with other work). Also the zstd level 1 baseline on
the interleaved bf16 bytes (no split).
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import zstandard

from zipmoe.codecs.bitfield import exp_entropy_bits
from zipmoe.codecs.exponent import CODECS, DecodeContext, native_available
from zipmoe.kernels.cpu import merge_into, split_into
from zipmoe.units import format_size, parse_size


CLOCK = time.perf_counter


def synth(kind: str, n: int, seed: int = 0) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        x = torch.randn(n, generator=g)
    else:
        x = torch.distributions.StudentT(5.0).sample((n,))
    return (x * 0.02).to(torch.bfloat16).view(torch.uint16).numpy()


def compress_shards(codec, exp: np.ndarray, shard: int, workers: int) -> list[bytes]:
    views = [exp[a:a + shard] for a in range(0, exp.shape[0], shard)]
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(codec.compress, views))


def decode_merge(codec, shards: list[bytes], sm: np.ndarray, out: np.ndarray, shard: int) -> float:
    ctx = DecodeContext()
    buf = np.empty(shard, np.uint8)
    t0 = CLOCK()
    pos = 0
    for s in shards:
        n = min(shard, out.shape[0] - pos)
        b = buf[:n]
        codec.decompress_into(s, b, ctx)
        merge_into(b, sm[pos:pos + n], out[pos:pos + n])
        pos += n
    return CLOCK() - t0


def decode_only(codec, shards, n_total, shard) -> float:
    ctx = DecodeContext()
    buf = np.empty(shard, np.uint8)
    t0 = CLOCK()
    pos = 0
    for s in shards:
        n = min(shard, n_total - pos)
        codec.decompress_into(s, buf[:n], ctx)
        pos += n
    return CLOCK() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--values", default="64M", help="bf16 values per tensor (K/M binary: 64M = 64 Mi)")
    ap.add_argument("--shard-size", default="1M")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="threads for compression only")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="time decode by wall clock, or by the thread's CPU time (fair on a shared machine)")
    args = ap.parse_args()
    global CLOCK
    CLOCK = time.perf_counter if args.clock == "wall" else time.thread_time
    n = parse_size(args.values)
    shard = parse_size(args.shard_size)
    print(f"# {n} bf16 values ({format_size(2 * n)}), shards of {format_size(shard)}, decode on 1 thread, "
          f"best of {args.repeat}, {args.clock} clock; {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"native decode {native_available()}")
    rows = []
    for kind in ("normal", "student-t"):
        u = synth(kind, n)
        exp, sm = np.empty(n, np.uint8), np.empty(n, np.uint8)
        split_into(u, exp, sm)
        bound = (8 + exp_entropy_bits(exp)) / 16
        out = np.empty(n, np.uint16)
        rows.append((kind, "bound (8 + H(exp))/16", 100 * bound, None, None, None))
        for cid in ("zstd", "zstd-fast", "lz4hc", "lz4", "raw"):
            codec = CODECS[cid]
            t0 = time.perf_counter()
            shards = compress_shards(codec, exp, shard, args.workers)
            t_c = time.perf_counter() - t0
            size = (sum(len(s) for s in shards) + n) / (2 * n)
            t_dm = min(decode_merge(codec, shards, sm, out, shard) for _ in range(args.repeat))
            assert np.array_equal(out, u), cid
            t_d = min(decode_only(codec, shards, n, shard) for _ in range(args.repeat))
            rows.append((kind, cid, 100 * size, 2 * n / t_dm / 1e9, 2 * n / t_d / 1e9, 2 * n / t_c / 1e6))
        # baseline: zstd level 1 on the interleaved bf16 bytes, same shard size in bf16 bytes
        raw = u.view(np.uint8)
        cctx, dctx = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()
        t0 = time.perf_counter()
        blocks = [cctx.compress(raw[a:a + 2 * shard]) for a in range(0, raw.shape[0], 2 * shard)]
        t_c = time.perf_counter() - t0
        t_d = float("inf")
        for _ in range(args.repeat):
            t0 = CLOCK()
            for b in blocks:
                dctx.decompress(b)
            t_d = min(t_d, CLOCK() - t0)
        rows.append((kind, "zstd-1 on interleaved bf16 (no split)", 100 * sum(map(len, blocks)) / raw.shape[0],
                     None, 2 * n / t_d / 1e9, 2 * n / t_c / 1e6))
        del u, exp, sm, out
    print()
    print(f"| data | coding | size % of bf16 | decode+merge GB/s/core | decode only GB/s/core | compress MB/s ({args.workers} threads) |")
    print("|---|---|---:|---:|---:|---:|")
    f = lambda v, p: "–" if v is None else f"{v:.{p}f}"  # noqa: E731
    for kind, cid, size, dm, d, c in rows:
        print(f"| {kind} | {cid} | {size:.2f}% | {f(dm, 2)} | {f(d, 2)} | {f(c, 0)} |")


if __name__ == "__main__":
    main()
