"""Triton bf16 merge on a GPU: exactness first, then throughput against the copy bandwidth.

    python3 benchmarks/gpu_merge.py                 # ~1 GiB of bf16, on CUDA
    python3 benchmarks/gpu_merge.py --json out.json # also write the figures as JSON
    TRITON_INTERPRET=1 python3 benchmarks/gpu_merge.py --small   # smoke run without a GPU

What it does, in order (any mismatch stops it with exit status 1 and the first bad element):

1. exactness: every one of the 65536 bf16 bit patterns; then ~1 GiB of random bit patterns
   (512 Mi elements plus an odd tail, so the element count is not a multiple of any block)
   with NaN payloads, infinities, subnormals and -0 planted; the Triton split is checked
   against a torch-ops reference and the Triton merge must give back the original bits; also
   through ``zipmoe.kernels.merge`` (the dispatcher) where the package imports.
2. throughput, median of ``triton.testing.do_bench``, counting bytes read + written
   (1 + 1 bytes in, 2 bytes out = 4 bytes per element):
   - the Triton merge at the default block and a sweep of block sizes / warps;
   - a device-to-device copy of the same traffic (``dst.copy_(src)`` of n bf16 elements:
     2n bytes read, 2n written), the practical memory-bandwidth ceiling;
   - a plain torch-ops merge (int32 intermediates), the naive baseline;
   - the Triton merge at expert-sized tensors (launch overhead shows there).
3. a table: GB/s and the fraction of the measured copy bandwidth (and of the spec sheet's
   bandwidth for GPUs the script knows).

The kernel comes from ``kernels/triton_merge.py`` next to this script (the code under test),
or from the installed ``zipmoe.kernels.triton_merge`` if the file is not there.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "") == "1"

import triton  # noqa: E402  (after reading TRITON_INTERPRET: it must be set before this import)
import triton.testing  # noqa: E402

# Spec-sheet HBM bandwidth (bytes/s) for a few GPUs, for the second fraction only.
SPEC_BW = {"H200": 4.8e12, "H100 SXM": 3.35e12, "H100 PCIe": 2.0e12, "H100 NVL": 3.9e12,
           "A100-SXM4-80GB": 2.039e12, "A100-SXM4-40GB": 1.555e12, "L40S": 0.864e12}

SPECIAL = [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7F81, 0xFF81, 0x7FFF, 0xFFFF, 0x7FA5,
           0x0001, 0x8001, 0x007F, 0x807F, 0x0080, 0x8080, 0x7F7F, 0xFF7F, 0x3F80, 0xBF80]


class Mismatch(SystemExit):
    pass


def fail(msg: str) -> None:
    print(f"\nFAIL: {msg}", flush=True)
    raise Mismatch(1)


def load_kernels():
    here = Path(__file__).resolve().parent.parent / "kernels" / "triton_merge.py"
    if here.is_file():
        spec = importlib.util.spec_from_file_location("zipmoe_triton_merge_under_test", here)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod, str(here)
    from zipmoe.kernels import triton_merge as mod  # type: ignore

    return mod, mod.__file__


def load_dispatch():
    try:
        from zipmoe import kernels

        if not callable(getattr(kernels, "merge", None)):
            print(f"note: the installed zipmoe.kernels ({kernels.__file__}) has no merge(); dispatcher check skipped")
            return None
        print(f"dispatcher: zipmoe.kernels.merge from {kernels.__file__}")
        return kernels
    except Exception as exc:  # numba missing, package not on the path, ...
        print(f"note: zipmoe.kernels does not import here ({type(exc).__name__}: {exc}); dispatcher check skipped")
        return None


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bench_ms(fn, device: str, rep_ms: int) -> float:
    """Median milliseconds per call."""
    if device == "cuda":
        try:
            return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))
        except TypeError:  # older triton without return_mode
            return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, quantiles=[0.5])[0])
    ts = []
    fn()
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return sorted(ts)[len(ts) // 2]


def ref_split(u: torch.Tensor):
    ui = u.to(torch.int32) & 0xFFFF
    return ((ui >> 7) & 0xFF).to(torch.uint8), (((ui >> 8) & 0x80) | (ui & 0x7F)).to(torch.uint8)


def first_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    idx = torch.nonzero(a.reshape(-1) != b.reshape(-1))
    if idx.numel() == 0:
        return "no differing element"
    i = int(idx[0, 0])
    av, bv = int(a.reshape(-1)[i]) & 0xFFFF, int(b.reshape(-1)[i]) & 0xFFFF
    return f"{idx.shape[0]} differing elements, first at index {i}: got 0x{av:04x}, expected 0x{bv:04x}"


def random_patterns(n: int, device: str, seed: int) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    u = torch.randint(-32768, 32768, (n,), dtype=torch.int16, device=device, generator=g)
    sp = torch.tensor([v - 65536 if v >= 32768 else v for v in SPECIAL], dtype=torch.int16, device=device)
    k = min(n, sp.numel())
    u[:k] = sp[:k]
    if n > 4 * sp.numel():
        # plant them at random positions too, and at the very end (the masked tail)
        pos = torch.randint(0, n, (4096,), device=device, generator=g)
        u[pos] = sp[torch.arange(pos.numel(), device=device) % sp.numel()]
        u[n - k:] = sp[:k]
    return u


def check_exact(tm, kernels, n: int, device: str, seed: int, label: str) -> None:
    u = random_patterns(n, device, seed)
    e = torch.empty(n, dtype=torch.uint8, device=device)
    s = torch.empty(n, dtype=torch.uint8, device=device)
    tm.split_triton(u, e, s)
    re_, rs_ = ref_split(u)
    sync(device)
    if not torch.equal(e, re_):
        fail(f"{label}: Triton split, exponent bytes: {first_diff(e, re_)}")
    if not torch.equal(s, rs_):
        fail(f"{label}: Triton split, sign-mantissa bytes: {first_diff(s, rs_)}")
    del re_, rs_
    out = torch.full((n,), 0x5555, dtype=torch.int16, device=device).view(torch.bfloat16)
    tm.merge_triton(e, s, out)
    sync(device)
    if not torch.equal(out.view(torch.int16), u):
        fail(f"{label}: Triton merge: {first_diff(out.view(torch.int16), u)}")
    if kernels is not None and device == "cuda":
        out2 = torch.empty(n, dtype=torch.uint16, device=device)
        kernels.merge(e, s, out2)
        sync(device)
        if not torch.equal(out2.view(torch.int16), u):
            fail(f"{label}: zipmoe.kernels.merge: {first_diff(out2.view(torch.int16), u)}")
    print(f"  exact: {label} ({n} elements)", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description="Triton bf16 merge: exactness and throughput")
    ap.add_argument("--small", action="store_true", help="tiny sizes (a smoke run, e.g. under TRITON_INTERPRET=1)")
    ap.add_argument("--gib", type=float, default=1.0, help="GiB of bf16 for the big exactness check and timing")
    ap.add_argument("--rep-ms", type=int, default=200, help="do_bench measuring time per case")
    ap.add_argument("--no-sweep", action="store_true", help="skip the block/warps sweep")
    ap.add_argument("--json", help="also write the results as JSON here")
    a = ap.parse_args()

    if torch.cuda.is_available() and not INTERPRET:
        device = "cuda"
        name = torch.cuda.get_device_name(0)
    elif INTERPRET:
        device, name = "cpu", "CPU (TRITON_INTERPRET=1)"
        if not a.small:
            print("note: TRITON_INTERPRET=1 is slow: forcing --small")
            a.small = True
    else:
        print("FAIL: no CUDA device (for a smoke run without one: TRITON_INTERPRET=1 ... --small)")
        return 2

    tm, src = load_kernels()
    kernels = load_dispatch() if device == "cuda" else None
    print(f"device: {name} | torch {torch.__version__} | triton {triton.__version__}")
    print(f"kernel: {src} (BLOCK={tm.BLOCK}, num_warps={tm.NUM_WARPS})", flush=True)

    # ---------------------------------------------------------------- 1. exactness
    print("exactness:")
    allp = torch.arange(-32768, 32768, dtype=torch.int32, device=device).to(torch.int16)
    e = torch.empty(allp.numel(), dtype=torch.uint8, device=device)
    s = torch.empty_like(e)
    tm.split_triton(allp, e, s)
    out = torch.empty(allp.numel(), dtype=torch.bfloat16, device=device)
    tm.merge_triton(e, s, out)
    sync(device)
    if not torch.equal(out.view(torch.int16), allp):
        fail(f"all 65536 patterns: {first_diff(out.view(torch.int16), allp)}")
    print("  exact: all 65536 bf16 bit patterns", flush=True)
    sizes = [1, 17, tm.BLOCK - 1, tm.BLOCK + 1, 3 * tm.BLOCK + 333] if a.small else \
        [1, 17, 4095, 4097, 1_000_003, 12_345_679]
    for i, n in enumerate(sizes):
        check_exact(tm, kernels, n, device, seed=i, label=f"random n={n}")
    big = 50_001 if a.small else int(a.gib * (1 << 30)) // 2 + 12_345
    check_exact(tm, kernels, big, device, seed=99, label=f"random {big * 2 / 2**30:.2f} GiB")
    for blk, w in ((256, 4), (1024, 4), (16384, 16)):
        u = random_patterns(big if not a.small else 10_007, device, seed=blk)
        e, s = ref_split(u)
        o = torch.empty(u.numel(), dtype=torch.bfloat16, device=device)
        tm.merge_triton(e, s, o, block=blk, num_warps=w)
        sync(device)
        if not torch.equal(o.view(torch.int16), u):
            fail(f"merge with block={blk}, num_warps={w}: {first_diff(o.view(torch.int16), u)}")
        print(f"  exact: block={blk} num_warps={w}", flush=True)
        del u, e, s, o
    print("exactness: all checks passed", flush=True)

    # ---------------------------------------------------------------- 2. throughput
    n = 50_000 if a.small else int(a.gib * (1 << 30)) // 2
    u = random_patterns(n, device, seed=7)
    e, s = ref_split(u)
    out = torch.empty(n, dtype=torch.bfloat16, device=device)
    src_copy = u.view(torch.bfloat16)
    dst_copy = torch.empty_like(src_copy)
    traffic = 4 * n  # bytes read + written, merge and copy alike
    rows: list[dict] = []

    def record(label: str, ms: float, nbytes: int = traffic, elems: int = n) -> dict:
        r = {"case": label, "elements": elems, "ms": ms, "GB/s": nbytes / (ms * 1e-3) / 1e9}
        rows.append(r)
        print(f"  {label:<38} {ms:9.4f} ms {r['GB/s']:9.1f} GB/s", flush=True)
        return r

    print(f"throughput ({n} elements, {traffic / 2**30:.2f} GiB moved per call, median of do_bench):")
    copy = record("torch copy_ (d2d, same bytes)", bench_ms(lambda: dst_copy.copy_(src_copy), device, a.rep_ms))
    tri = record(f"triton merge (BLOCK={tm.BLOCK}, warps={tm.NUM_WARPS})",
                 bench_ms(lambda: tm.merge_triton(e, s, out), device, a.rep_ms))
    naive = record("torch-ops merge (int32)", bench_ms(lambda: tm.torch_merge(e, s, out), device, a.rep_ms))
    sweep = []
    if not a.no_sweep and not a.small:
        for blk in (1024, 2048, 4096, 8192, 16384):
            for w in (4, 8, 16):
                r = record(f"triton merge BLOCK={blk} warps={w}",
                           bench_ms(lambda: tm.merge_triton(e, s, out, block=blk, num_warps=w), device, a.rep_ms))
                r.update(block=blk, num_warps=w)
                sweep.append(r)
    sizes_small = []
    for m in ((1 << 12, 1 << 14) if a.small else (1 << 20, 2048 * 1408, 4096 * 14336, 1 << 26)):
        em, sm_, om = e[:m], s[:m], out[:m]
        sizes_small.append(record(f"triton merge n={m}", bench_ms(lambda: tm.merge_triton(em, sm_, om), device, a.rep_ms),
                                  nbytes=4 * m, elems=m))
    # the result after all the timing runs is still exact
    tm.merge_triton(e, s, out)
    sync(device)
    if not torch.equal(out.view(torch.int16), u):
        fail(f"after timing: {first_diff(out.view(torch.int16), u)}")

    # ---------------------------------------------------------------- 3. table
    spec = next((bw for key, bw in SPEC_BW.items() if key.lower() in name.lower()), None)
    best = max(sweep, key=lambda r: r["GB/s"]) if sweep else tri
    if best is not tri:
        best = dict(best, case="best of sweep: " + best["case"].replace("triton merge ", ""))
    print("\nsummary (GB/s counts bytes read + written: 4 bytes per element)")
    hdr = f"{'case':<40} {'GB/s':>9} {'of copy':>8}" + (f" {'of spec':>8}" if spec else "")
    print(hdr)
    print("-" * len(hdr))
    for r in [copy, tri] + ([best] if best is not tri else []) + [naive] + sizes_small:
        line = f"{r['case']:<40} {r['GB/s']:>9.1f} {r['GB/s'] / copy['GB/s']:>8.1%}"
        if spec:
            line += f" {r['GB/s'] * 1e9 / spec:>8.1%}"
        print(line)
    if spec:
        print(f"spec bandwidth for {name}: {spec / 1e12:.2f} TB/s")
    frac = tri["GB/s"] / copy["GB/s"]
    print(f"\nRESULT exact=yes triton_merge={tri['GB/s']:.0f}GB/s copy={copy['GB/s']:.0f}GB/s "
          f"fraction_of_copy={frac:.3f} best_config=BLOCK{best.get('block', tm.BLOCK)}/w{best.get('num_warps', tm.NUM_WARPS)} "
          f"speedup_vs_torch_ops={tri['GB/s'] / naive['GB/s']:.1f}x")
    if a.json:
        doc = {"device": name, "torch": torch.__version__, "triton": triton.__version__, "exact": True,
               "elements": n, "bytes_per_call": traffic, "spec_bw": spec, "rows": rows,
               "fraction_of_copy": frac, "default": {"block": tm.BLOCK, "num_warps": tm.NUM_WARPS}}
        Path(a.json).write_text(json.dumps(doc, indent=2))
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
