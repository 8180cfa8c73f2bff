"""Size as % of bf16 against the bound, per codec, on a synthetic checkpoint of every family.

    python benchmarks/families.py [--preset small] [--workdir out/families]

For each family: `zipmoe synth FAMILY --preset PRESET`, then `pack` with each codec; prints the
bf16 tensors' stored size as % of their bf16 bytes next to the per-tensor bound (8 + H(exp))/16.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

from zipmoe.codecs.writer import pack
from zipmoe.runtime import synth

CODECS = ("zstd", "zstd-fast", "lz4", "lz4hc")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--workdir", default="out/families")
    args = ap.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for family in synth.FAMILIES:
        src = work / family
        r = synth.write(family, src, preset=args.preset, force=True, progress=False)
        row = {"family": family, "bf16": r.nbytes}
        for codec in CODECS:
            t = time.perf_counter()
            s = pack(src, work / f"{family}.{codec}.zmoe", codec=codec, force=True)
            row[codec] = 100 * s.bf16_ratio
            row["bound"] = 100 * s.bound_ratio
            row[codec + "_s"] = time.perf_counter() - t
            (work / f"{family}.{codec}.zmoe").unlink()
        shutil.rmtree(src)
        rows.append(row)
        print(f"{family}: done", flush=True)
    print(f"\n| family ({args.preset}) | bf16 | bound | " + " | ".join(CODECS) + " |")
    print("|---|---:|---:|" + "---:|" * len(CODECS))
    for r in rows:
        cells = " | ".join(f"{r[c]:.2f}%" for c in CODECS)
        print(f"| {r['family']} | {r['bf16'] / 2**20:.0f} MiB | {r['bound']:.2f}% | {cells} |")


if __name__ == "__main__":
    main()
