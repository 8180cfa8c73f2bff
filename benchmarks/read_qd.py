"""Expert reads at queue depth 1, 2, 4, 8: the container's expert ranges, O_DIRECT, as serving reads them.

    python benchmarks/read_qd.py FILE.zmoe [--qd 1,2,4,8] [--max-bytes 2G] [--piece 1M] [--repeat 1]

For each queue depth QD, QD reader threads share the pieces (``--piece`` bytes, the runtime's
``reads.READ_PIECE``) of the container's expert tensors' ranges (E and SM chunks of each stored
tensor, coalesced as the runtime coalesces them), read with ``ExpertStore.read_piece`` (one
``os.preadv`` each, which releases the GIL) into reused page-aligned buffers: exactly what the
runtime's reader threads do. Also "whole": one read call per range (the runtime before
2026-12-01: one thread, one call per range), at the same QD. Each QD reads a different
part of the file (so a read is never served from the drive's own cache of the previous run),
up to ``--max-bytes``. Cold: O_DIRECT bypasses the page cache; without O_DIRECT (tmpfs, some
overlay file systems) the script says so and the figures are the page cache's, not the disk's.
Prints GB/s (1 GB = 1e9 bytes) per QD; the runtime's ``readers`` should be the smallest QD
near the plateau.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from zipmoe.codecs.reader import ContainerReader
from zipmoe.runtime.engine.counters import Counters
from zipmoe.runtime.engine.reads import READ_PIECE, ExpertStore, _coalesce
from zipmoe.units import parse_size


def expert_ranges(path) -> list[tuple[int, int]]:
    out = []
    with ContainerReader(path) as r:
        for e in r.entries:
            if e.role != "expert":
                continue
            out.extend(_coalesce([(c.offset, c.length) for c in e.chunks]))
    return sorted(out)


def run(path, ranges, qd: int, piece: int, whole: bool) -> tuple[float, int, bool]:
    store = ExpertStore(path, Counters(), piece=(1 << 40) if whole else piece)
    jobs = []
    bufs = {}
    for i, (off, ln) in enumerate(ranges):
        size = store.buffer_size(off, ln)
        bufs[i] = store.new_buffer(off, ln)
        for p in store.pieces(off, ln):
            jobs.append((i, p))
        del size

    def one(job):
        i, p = job
        return store.read_piece(bufs[i], *p)[0]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(qd) as ex:
        got = sum(ex.map(one, jobs, chunksize=1))
    took = time.perf_counter() - t0
    direct = store.direct
    store.close()
    return took, got, direct


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("container")
    ap.add_argument("--qd", default="1,2,4,8")
    ap.add_argument("--max-bytes", default="1G", help="bytes read per queue depth and mode (default 1G)")
    ap.add_argument("--piece", default=str(READ_PIECE))
    ap.add_argument("--no-whole", action="store_true", help="skip the one-call-per-range comparison")
    a = ap.parse_args(argv)
    qds = [int(x) for x in a.qd.split(",")]
    limit = parse_size(a.max_bytes)
    piece = parse_size(a.piece)
    ranges = expert_ranges(a.container)
    total = sum(ln for _, ln in ranges)
    modes = ["pieces"] + ([] if a.no_whole else ["whole"])
    print(f"# {a.container}: {len(ranges)} expert ranges, {total / 1e9:.2f} GB; {platform.node()}, "
          f"{os.cpu_count()} cores; piece {piece} B; up to {limit / 1e9:.2f} GB per run")
    # consecutive, disjoint parts of the file per run (wrapping around when it is small)
    parts, pos = [], 0
    for _ in range(len(qds) * len(modes)):
        sel, n = [], 0
        while n < limit and len(sel) < len(ranges):
            r = ranges[pos % len(ranges)]
            sel.append(r)
            n += r[1]
            pos += 1
        parts.append(sel)
    if total < limit * len(qds) * len(modes):
        print("# note: the file is smaller than the runs together: later runs re-read ranges (the drive may cache them)")
    print(f"{'QD':>3} " + " ".join(f"{m + ' GB/s':>12}" for m in modes))
    k = 0
    direct_all = True
    for qd in qds:
        row = []
        for m in modes:
            took, got, direct = run(a.container, parts[k], qd, piece, m == "whole")
            direct_all = direct_all and direct
            k += 1
            row.append(got / took / 1e9)
        print(f"{qd:>3} " + " ".join(f"{x:>12.2f}" for x in row), flush=True)
    if not direct_all:
        print("# O_DIRECT was refused on this file system: these are buffered reads (page cache), not the disk", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
