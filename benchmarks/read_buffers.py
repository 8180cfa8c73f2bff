"""O_DIRECT reads into fresh anonymous mappings against reused ones (why runtime/engine/reads.py keeps
its read buffers): random aligned reads of one size from a file, both ways, interleaved.

    python benchmarks/read_buffers.py FILE [--size 1700K] [--reads 400] [--rounds 3]
"""

from __future__ import annotations

import argparse
import mmap
import os
import random
import time

from zipmoe.units import parse_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("--size", default="1700K", help="bytes per read (rounded up to 4 KiB)")
    ap.add_argument("--reads", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    size = -(-parse_size(a.size) // 4096) * 4096
    total = os.path.getsize(a.file)
    fd = os.open(a.file, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    rng = random.Random(0)
    offs = [rng.randrange(0, total - size) // 4096 * 4096 for _ in range(a.reads)]
    reused = mmap.mmap(-1, size)

    def fresh():
        for o in offs:
            buf = mmap.mmap(-1, size)  # what the store did before: a new mapping per read
            os.preadv(fd, [buf], o)
            del buf

    def reuse():
        for o in offs:
            os.preadv(fd, [reused], o)

    for r in range(a.rounds):
        for name, fn in (("fresh mapping", fresh), ("reused buffer", reuse)):
            t = time.perf_counter()
            fn()
            gib_s = len(offs) * size / (time.perf_counter() - t) / 2**30
            print(f"round {r + 1}  {name:14s} {gib_s:6.2f} GiB/s  ({len(offs)} reads of {size >> 10} KiB)")


if __name__ == "__main__":
    main()
