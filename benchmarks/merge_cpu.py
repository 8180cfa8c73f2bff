"""CPU merge and decode+merge throughput, one core (GB/s of bf16 output).

    python benchmarks/merge_cpu.py [--elements 16M] [--shard 1M] [--repeat 7]

1. ``kernels.cpu.merge_into`` alone at sizes from L2-resident to DRAM-bound, next to a numpy
   memcpy of the output size (the machine's ceiling for a streaming write).
2. exponent decode + merge, one thread, per codec, two ways: the whole tensor decoded into
   one buffer then merged, and shard by shard (decode one shard into an L2-sized scratch
   buffer, merge it straight away, so the exponent bytes never leave the cache).
   Synthetic weights: normal(0, 0.02) rounded to bf16.

Figures are the best of ``--repeat`` runs (the machine is shared; the best run is the least
disturbed one).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from zipmoe.kernels import cpu


def _parse_n(text: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper()
    return int(float(t[:-1]) * mult[t[-1]]) if t[-1] in mult else int(t)


def best_time(fn, repeat: int, inner: int = 1) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t0) / inner)
    return best


def synth_bf16(n: int, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).normal(0, 0.02, n).astype(np.float32)
    u32 = x.view(np.uint32)
    # round to nearest even, as torch does for float32 -> bfloat16
    return ((u32 + 0x7FFF + ((u32 >> 16) & 1)) >> 16).astype(np.uint16)


def merge_table(repeat: int) -> None:
    print("merge_into alone (GB/s of bf16 written; memcpy = numpy copy of the same output bytes)")
    print(f"{'elements':>12} {'merge':>8} {'memcpy':>8}")
    for n in (1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24, 1 << 26):
        u = np.random.default_rng(1).integers(0, 1 << 16, n, dtype=np.uint16)
        e, s = cpu.split(u)
        out = np.empty(n, np.uint16)
        cpu.merge_into(e, s, out)
        assert np.array_equal(out, u)
        inner = max(1, (1 << 25) // n)
        tm = best_time(lambda: cpu.merge_into(e, s, out), repeat, inner)
        dst = np.empty_like(out)
        tc = best_time(lambda: np.copyto(dst, out), repeat, inner)
        print(f"{n:>12} {2 * n / tm / 1e9:>8.2f} {2 * n / tc / 1e9:>8.2f}")


def decode_merge_table(n: int, shard: int, repeat: int) -> None:
    try:
        from zipmoe.codecs.exponent import CODECS, DecodeContext
    except ImportError:  # pragma: no cover
        print("zipmoe.codecs.exponent not available: skipping decode + merge")
        return
    u = synth_bf16(n)
    e, s = cpu.split(u)
    shards = [(a, min(n, a + shard)) for a in range(0, n, shard)]
    ctx = DecodeContext()
    out = np.empty(n, np.uint16)
    exp_full = np.empty(n, np.uint8)
    scratch = np.empty(shard, np.uint8)
    print(f"\ndecode + merge, one thread, {n} elements, {shard}-byte shards (GB/s of bf16 output)")
    print(f"{'codec':>10} {'size %':>7} {'decode':>8} {'whole':>8} {'sharded':>8}")
    for cid, codec in CODECS.items():
        blobs = [codec.compress(memoryview(e[a:b])) for a, b in shards]
        size = sum(len(x) for x in blobs) + n  # + the raw SM bytes

        def decode_only():
            for (a, b), blob in zip(shards, blobs):
                codec.decompress_into(blob, exp_full[a:b], ctx)

        def whole():
            decode_only()
            cpu.merge_into(exp_full, s, out)

        def sharded():
            for (a, b), blob in zip(shards, blobs):
                buf = scratch[: b - a]
                codec.decompress_into(blob, buf, ctx)
                cpu.merge_into(buf, s[a:b], out[a:b])

        sharded()
        assert np.array_equal(out, u), cid
        td, tw, ts = (best_time(f, repeat) for f in (decode_only, whole, sharded))
        print(f"{cid:>10} {100 * size / (2 * n):>7.2f} {2 * n / td / 1e9:>8.2f} {2 * n / tw / 1e9:>8.2f} {2 * n / ts / 1e9:>8.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", default="16M", help="elements for decode + merge (default 16M)")
    ap.add_argument("--shard", default="1M", help="exponent bytes per shard (default 1M)")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--skip-merge", action="store_true")
    a = ap.parse_args()
    if not a.skip_merge:
        merge_table(a.repeat)
    decode_merge_table(_parse_n(a.elements), _parse_n(a.shard), a.repeat)


if __name__ == "__main__":
    main()
