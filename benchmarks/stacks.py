"""Read py-spy's raw collapsed stacks (``py-spy record --threads --format raw``): where one thread's
samples go, under one function.

    python benchmarks/stacks.py STACKS.txt[.gz] [--thread MainThread] [--under measure_served/_timed] [--top 30]
        [--owner runtime/]

Prints the thread's samples under the frame named ``--under`` (a function name; ``a/b``: a frame
``b`` called, at any depth, under a frame ``a``) three ways:

* ``self``: by leaf frame (where the CPU was, a C call shown by its Python caller when py-spy
  sees no native frames);
* ``owner``: by the innermost frame whose file path contains ``--owner`` (default ``runtime/``,
  zipmoe's runtime): a torch call, a lock or numpy work charged to the runtime function that made
  it, which is what a change in the runtime can act on;
* ``inclusive``: every function on the stack, once per sample.

Used on the GPU box by ``benchmarks/drive.sh``'s host-ab stage (docs/runtime.md, "Host work per
fetched tensor"): the serving thread (MainThread) of ``profile_fetch.py``'s served pass, sampled
on-CPU (py-spy without ``--idle``), so that the figures are the thread's CPU, like ``host_cpu``.
"""

from __future__ import annotations

import argparse
import gzip
import re
import sys
from collections import Counter

_FRAME = re.compile(r"^(?P<fn>.*?) \((?P<file>.*?)(?::(?P<line>\d+))?\)$")


def parse(lines, thread: str | None = None, under: str | None = None):
    """Yield ``(frames, count)`` for each stack of ``thread`` (its name, or None: every thread)
    that has the frames named in ``under`` (``"a/b"``: a frame ``b`` below a frame ``a``; None:
    every stack), cut to the frames from the last of them down. A frame is ``(function, file)``."""
    for raw in lines:
        raw = raw.rstrip("\n")
        if not raw:
            continue
        body, _, n = raw.rpartition(" ")
        try:
            count = int(n)
        except ValueError:
            continue
        parts = body.split(";")
        head = parts[0]
        name = head.split(": ", 1)[1] if ": " in head else ""
        if thread is not None and name != thread:
            continue
        frames = []
        for p in parts[1:]:
            m = _FRAME.match(p)
            frames.append((m["fn"], m["file"]) if m else (p, ""))
        if under:
            at = 0
            for want in under.split("/"):
                at = next((i for i in range(at, len(frames)) if frames[i][0] == want), -1)
                if at < 0:
                    break
            if at < 0:
                continue
            frames = frames[at:]
        yield frames, count


def tally(stacks, owner: str = "runtime/") -> dict:
    total = 0
    own, leaf, incl = Counter(), Counter(), Counter()
    for frames, n in stacks:
        total += n
        if not frames:
            continue
        fn, f = frames[-1]
        leaf[f"{fn} ({_short(f)})"] += n
        mine = [x for x in frames if owner in x[1]]
        o = mine[-1] if mine else frames[0]
        own[f"{o[0]} ({_short(o[1])})"] += n
        for key in {f"{fn} ({_short(f)})" for fn, f in frames}:
            incl[key] += n
    return {"total": total, "self": leaf, "owner": own, "inclusive": incl}


def _short(path: str) -> str:
    for mark in ("/zipmoe/", "/site-packages/", "/lib/python"):
        if mark in path:
            return path.split(mark, 1)[1]
    return path.rsplit("/", 1)[-1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("stacks")
    ap.add_argument("--thread", default="MainThread")
    ap.add_argument("--under", default=None)
    ap.add_argument("--owner", default="runtime/")
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args(argv)
    try:
        opener = gzip.open if a.stacks.endswith(".gz") else open  # results/ keeps the samples gzipped
        with opener(a.stacks, "rt", encoding="utf-8", errors="replace") as fh:
            t = tally(parse(fh, a.thread or None, a.under), a.owner)
    except (OSError, EOFError) as e:
        print(f"stacks: cannot read {a.stacks}: {getattr(e, 'strerror', None) or e}", file=sys.stderr)
        return 1
    if not t["total"]:
        print(f"stacks: no samples of thread {a.thread!r} under {a.under!r} in {a.stacks}", file=sys.stderr)
        return 1
    print(f"{t['total']} samples of thread {a.thread!r} under {a.under!r}")
    for what in ("owner", "self", "inclusive"):
        print(f"\n--- {what}")
        for k, n in t[what].most_common(a.top):
            print(f"{100 * n / t['total']:6.1f}%  {n:7d}  {k}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # `| head`: the reader has all it wanted
        sys.stderr.close()
        sys.exit(0)
