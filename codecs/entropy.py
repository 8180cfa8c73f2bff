"""Bit-field entropy of bf16 tensors, the size bound, and (optionally) real codec sizes/speeds.

For a bf16 value as uint16 ``u``: sign ``u >> 15``, exponent ``(u >> 7) & 0xFF``, mantissa
``u & 0x7F``. One joint histogram of the 65536 bit patterns per tensor (numba, streamed over
the tensor in chunks read with pread) gives all three marginals, and the sign-mantissa byte
(what zipmoe stores raw) as the joint of sign and mantissa.

The bound. zipmoe stores the sign-mantissa byte raw (8 bits) and entropy-codes the exponent,
so an ideal per-tensor coder needs ``(8 + H(exp)) / 16`` of the bf16 size. The model's bound is
the size-weighted mean of the per-tensor bounds (each tensor is coded on its own statistics),
which is what ``zipmoe pack``'s ratio is compared against. The *pooled* exponent entropy
(one histogram over all bf16 values) is reported too; it is never below the weighted mean of
per-tensor entropies.

Non-bf16 tensors are listed with their entropy fields ``None``; so are empty bf16 tensors.

``measure=True`` also compresses each bf16 tensor's exponent bytes with each codec of
:mod:`zipmoe.codecs.exponent`, in shards as the writer does, and times decompression into a
preallocated buffer (best of ``repeat``) plus the merge, per shard, so that the bytes stay
in cache (as the runtime does). Sizes include the raw sign-mantissa bytes.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, Iterator

import numpy as np

from zipmoe.kernels.cpu import histogram_u16_into, merge_into, split_into

from .bitfield import entropy_from_counts as entropy_bits
from .checkpoint import Checkpoint, SourceTensor, open_checkpoint
from .naming import classify

__all__ = [
    "FieldEntropy",
    "CodecMeasure",
    "TensorReport",
    "Totals",
    "Analysis",
    "entropy_bits",
    "field_entropy",
    "tensor_histogram",
    "bound_fraction",
    "analyze",
    "analyze_checkpoint",
]

CHUNK_ELEMENTS = 8 << 20  # elements read per pread while streaming a tensor (16 MiB of bf16)


def bound_fraction(exp_bits: float) -> float:
    """Ideal stored size as a fraction of bf16: raw sign-mantissa byte + entropy-coded exponent."""
    return (8.0 + exp_bits) / 16.0


@dataclass
class FieldEntropy:
    """Entropies (bits per value) of one tensor's bit fields."""

    n: int
    sign_bits: float
    exp_bits: float
    mant_bits: float
    sm_bits: float  # the sign-mantissa byte (sign and mantissa jointly)
    distinct_exponents: int

    @property
    def bound(self) -> float:
        return bound_fraction(self.exp_bits)


def field_entropy(hist: np.ndarray) -> FieldEntropy:
    """Marginal entropies from a 65536-bin joint histogram of bf16 bit patterns."""
    h = np.asarray(hist, dtype=np.int64).reshape(2, 256, 128)  # sign, exponent, mantissa
    exp = h.sum(axis=(0, 2))
    return FieldEntropy(
        n=int(h.sum()),
        sign_bits=entropy_bits(h.sum(axis=(1, 2))),
        exp_bits=entropy_bits(exp),
        mant_bits=entropy_bits(h.sum(axis=(0, 1))),
        sm_bits=entropy_bits(h.sum(axis=1).reshape(-1)),
        distinct_exponents=int((exp > 0).sum()),
    )


def _chunks(t: SourceTensor, chunk_elements: int) -> Iterator[tuple[int, int]]:
    n = t.nbytes // 2
    for a in range(0, n, chunk_elements):
        yield a, min(n, a + chunk_elements)


def tensor_histogram(ck: Checkpoint, t: SourceTensor, chunk_elements: int = CHUNK_ELEMENTS,
                     buf: np.ndarray | None = None) -> np.ndarray:
    """65536-bin histogram of a BF16 tensor's bit patterns, streamed chunk by chunk."""
    counts = np.zeros(65536, np.int64)
    if buf is None:
        buf = np.empty(2 * min(chunk_elements, max(1, t.nbytes // 2)), np.uint8)
    for a, b in _chunks(t, chunk_elements):
        raw = ck.read(t, 2 * a, 2 * (b - a), out=buf[: 2 * (b - a)])
        histogram_u16_into(raw.view(np.uint16), counts)
    return counts


@dataclass
class CodecMeasure:
    """One codec on one tensor: stored bytes (E chunks + raw SM) and decode speeds."""

    codec: str
    stored_bytes: int
    ratio: float  # stored / bf16 bytes
    compress_s: float
    decode_s: float  # exponent decompression only, best of `repeat`, summed over shards
    merge_s: float

    @property
    def decode_gbps(self) -> float:  # GB/s of bf16 output
        return 0.0 if self.decode_s <= 0 else self._bf16 / self.decode_s / 1e9

    _bf16: int = field(default=0, repr=False)

    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
        tot = self.decode_s + self.merge_s
        d["decode_gbps"] = round(self._bf16 / self.decode_s / 1e9, 4) if self.decode_s > 0 else None
        d["decode_merge_gbps"] = round(self._bf16 / tot / 1e9, 4) if tot > 0 else None
        return d


@dataclass
class TensorReport:
    name: str
    dtype: str
    shape: tuple
    nbytes: int
    role: str
    layer: int | None
    expert: int | None
    proj: str | None
    fused: bool
    entropy: FieldEntropy | None = None
    codecs: list[CodecMeasure] = field(default_factory=list)

    @property
    def bf16(self) -> bool:
        return self.dtype == "BF16"

    def to_dict(self) -> dict:
        e = self.entropy
        d = {
            "name": self.name, "dtype": self.dtype, "shape": list(self.shape), "nbytes": self.nbytes,
            "role": self.role, "layer": self.layer, "expert": self.expert, "proj": self.proj,
            "fused": self.fused,
            "sign_entropy_bits": None if e is None else round(e.sign_bits, 6),
            "exp_entropy_bits": None if e is None else round(e.exp_bits, 6),
            "mant_entropy_bits": None if e is None else round(e.mant_bits, 6),
            "sm_entropy_bits": None if e is None else round(e.sm_bits, 6),
            "distinct_exponents": None if e is None else e.distinct_exponents,
            "bound": None if e is None else round(e.bound, 6),
        }
        if self.codecs:
            d["codecs"] = {c.codec: c.to_dict() for c in self.codecs}
        return d


@dataclass
class Totals:
    """Sums over a group of tensors (the model, or one role)."""

    tensors: int = 0
    nbytes: int = 0
    bf16_tensors: int = 0
    bf16_values: int = 0
    bound_bytes: float = 0.0  # sum over bf16 tensors of n * (8 + H_i) / 8
    exp_bits_weighted: float = 0.0  # sum of n * H_i(exp)
    sign_bits_weighted: float = 0.0
    mant_bits_weighted: float = 0.0
    hist: np.ndarray = field(default_factory=lambda: np.zeros(65536, np.int64), repr=False)
    codec_bytes: dict = field(default_factory=dict)  # codec -> stored bytes over bf16 tensors
    codec_decode_s: dict = field(default_factory=dict)
    codec_merge_s: dict = field(default_factory=dict)

    def add(self, r: TensorReport, hist: np.ndarray | None) -> None:
        self.tensors += 1
        self.nbytes += r.nbytes
        if r.entropy is None:
            return
        e = r.entropy
        self.bf16_tensors += 1
        self.bf16_values += e.n
        self.bound_bytes += e.n * (8.0 + e.exp_bits) / 8.0
        self.exp_bits_weighted += e.n * e.exp_bits
        self.sign_bits_weighted += e.n * e.sign_bits
        self.mant_bits_weighted += e.n * e.mant_bits
        if hist is not None:
            self.hist += hist
        for c in r.codecs:
            self.codec_bytes[c.codec] = self.codec_bytes.get(c.codec, 0) + c.stored_bytes
            self.codec_decode_s[c.codec] = self.codec_decode_s.get(c.codec, 0.0) + c.decode_s
            self.codec_merge_s[c.codec] = self.codec_merge_s.get(c.codec, 0.0) + c.merge_s

    @property
    def bf16_bytes(self) -> int:
        return 2 * self.bf16_values

    @property
    def bound(self) -> float | None:
        """Size-weighted per-tensor bound as a fraction of the bf16 bytes."""
        return self.bound_bytes / self.bf16_bytes if self.bf16_values else None

    def _mean(self, x: float) -> float | None:
        return x / self.bf16_values if self.bf16_values else None

    def to_dict(self) -> dict:
        pooled = field_entropy(self.hist) if self.bf16_values else None
        d = {
            "tensors": self.tensors, "nbytes": self.nbytes, "bf16_tensors": self.bf16_tensors,
            "bf16_bytes": self.bf16_bytes,
            "sign_entropy_bits": _r(self._mean(self.sign_bits_weighted)),
            "exp_entropy_bits": _r(self._mean(self.exp_bits_weighted)),
            "mant_entropy_bits": _r(self._mean(self.mant_bits_weighted)),
            "pooled_exp_entropy_bits": None if pooled is None else _r(pooled.exp_bits),
            "bound": _r(self.bound),
            "bound_bytes": None if not self.bf16_values else int(math.ceil(self.bound_bytes)),
        }
        if self.codec_bytes:
            d["codecs"] = {}
            for c, b in self.codec_bytes.items():
                ds, ms = self.codec_decode_s[c], self.codec_merge_s[c]
                d["codecs"][c] = {
                    "stored_bytes": b, "ratio": _r(b / self.bf16_bytes) if self.bf16_values else None,
                    "decode_gbps": _r(self.bf16_bytes / ds / 1e9) if ds > 0 else None,
                    "decode_merge_gbps": _r(self.bf16_bytes / (ds + ms) / 1e9) if ds + ms > 0 else None,
                }
        return d


def _r(x: float | None, nd: int = 6) -> float | None:
    return None if x is None else round(x, nd)


@dataclass
class Analysis:
    path: str
    model_type: str | None
    tensors: list[TensorReport]
    total: Totals
    by_role: dict[str, Totals]
    measured: list[str]
    shard_size: int
    seconds: float

    def to_dict(self) -> dict:
        return {
            "path": self.path, "model_type": self.model_type,
            "measured_codecs": self.measured, "shard_size": self.shard_size if self.measured else None,
            "seconds": round(self.seconds, 3),
            "tensors": [t.to_dict() for t in self.tensors],
            "by_role": {k: v.to_dict() for k, v in self.by_role.items()},
            "total": self.total.to_dict(),
        }


def _measure(ck: Checkpoint, t: SourceTensor, codecs: list, shard: int, repeat: int,
             chunk_elements: int) -> list[CodecMeasure]:
    """Compress the exponent bytes shard by shard with each codec; time decode + merge."""
    from .exponent import DecodeContext  # the codec layer: imported only when measuring

    n = t.nbytes // 2
    chunk_elements = max(shard, chunk_elements // shard * shard)  # chunks hold whole shards
    m = min(n, chunk_elements)
    raw = np.empty(2 * m, np.uint8)
    exp = np.empty(m, np.uint8)
    sm = np.empty(m, np.uint8)
    scratch = np.empty(min(shard, m), np.uint8)
    merged = np.empty(min(shard, m), np.uint16)
    ctx = DecodeContext()
    acc = {c.id: [0, 0.0, 0.0, 0.0] for c in codecs}  # bytes, compress_s, decode_s, merge_s
    for a, b in _chunks(t, chunk_elements):
        k = b - a
        u = ck.read(t, 2 * a, 2 * k, out=raw[: 2 * k]).view(np.uint16)
        split_into(u, exp[:k], sm[:k])
        for s0 in range(0, k, shard):
            s1 = min(k, s0 + shard)
            src = exp[s0:s1]
            for c in codecs:
                t0 = time.perf_counter()
                blob = c.compress(memoryview(src))
                t1 = time.perf_counter()
                buf = scratch[: s1 - s0]
                best_d = best_m = float("inf")
                for _ in range(repeat):
                    t2 = time.perf_counter()
                    c.decompress_into(blob, buf, ctx)
                    t3 = time.perf_counter()
                    merge_into(buf, sm[s0:s1], merged[: s1 - s0])
                    t4 = time.perf_counter()
                    best_d, best_m = min(best_d, t3 - t2), min(best_m, t4 - t3)
                if not np.array_equal(merged[: s1 - s0], u[s0:s1]):
                    raise RuntimeError(f"codec {c.id} did not round-trip tensor {t.name} (a bug)")
                st = acc[c.id]
                st[0] += len(blob)
                st[1] += t1 - t0
                st[2] += best_d
                st[3] += best_m
    ctx.close()
    out = []
    for c in codecs:
        nb, cs, ds, ms = acc[c.id]
        stored = nb + n  # + the raw sign-mantissa bytes
        out.append(CodecMeasure(c.id, stored, stored / (2 * n), cs, ds, ms, _bf16=2 * n))
    return out


def analyze_checkpoint(ck: Checkpoint, measure: bool = False, codecs: Iterable[str] | None = None,
                       shard_size: int = 1 << 20, repeat: int = 3, chunk_elements: int = CHUNK_ELEMENTS,
                       workers: int | None = None,
                       on_tensor: Callable[[int, int, TensorReport], None] | None = None) -> Analysis:
    """Analyse every tensor of an opened checkpoint, one at a time (memory bounded by a chunk).

    ``on_tensor(i, count, report)`` is called after each tensor, in file order (progress).
    ``workers`` threads compute histograms (default: up to 4, one per core); ``measure`` forces 1.
    """
    t_start = time.perf_counter()
    codec_objs: list = []
    if measure:
        from . import exponent

        default = getattr(exponent, "PACK_CODECS", None) or [c for c in exponent.CODECS if c != "raw"]
        get_codec = exponent.get_codec
        ids = list(codecs) if codecs else list(default)
        codec_objs = [get_codec(i) for i in ids]  # UnknownCodecError for a bad id
    if shard_size <= 0:
        raise ValueError("shard_size must be positive")
    total = Totals()
    by_role: dict[str, Totals] = {}
    reports: list[TensorReport] = []
    # Histograms run on `workers` threads (numba releases the GIL; pread too), in a window of
    # 2 * workers tensors so memory stays bounded; results are consumed in file order.
    # --measure times decoding, so it runs on one thread only.
    if workers is None:
        workers = min(4, os.cpu_count() or 1)
    workers = 1 if codec_objs else max(1, workers)
    local = threading.local()

    def hist_of(t: SourceTensor) -> np.ndarray | None:
        if t.dtype != "BF16" or not t.nbytes:
            return None
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = np.empty(2 * chunk_elements, np.uint8)
        return tensor_histogram(ck, t, chunk_elements, buf)

    def consume(i: int, t: SourceTensor, hist: np.ndarray | None) -> None:
        role = classify(t.name, t.shape, ck.config)
        r = TensorReport(t.name, t.dtype, tuple(t.shape), t.nbytes, role.role, role.layer,
                         role.expert, role.proj, role.fused)
        if hist is not None:
            r.entropy = field_entropy(hist)
            if codec_objs:
                r.codecs = _measure(ck, t, codec_objs, shard_size, repeat, chunk_elements)
        key = role.role if t.dtype == "BF16" else "other"
        by_role.setdefault(key, Totals()).add(r, hist)
        total.add(r, hist)
        reports.append(r)
        if on_tensor is not None:
            on_tensor(i, len(ck.tensors), r)

    if workers == 1:
        for i, t in enumerate(ck.tensors):
            consume(i, t, hist_of(t))
    else:
        with ThreadPoolExecutor(workers, thread_name_prefix="zipmoe-analyze") as pool:
            window: deque = deque()
            for i, t in enumerate(ck.tensors):
                window.append((i, t, pool.submit(hist_of, t)))
                if len(window) >= 2 * workers:
                    j, tj, fut = window.popleft()
                    consume(j, tj, fut.result())
            while window:
                j, tj, fut = window.popleft()
                consume(j, tj, fut.result())
    return Analysis(str(getattr(ck, "path", ck.root)),
                    ck.model_type, reports, total, by_role, [c.id for c in codec_objs], shard_size,
                    time.perf_counter() - t_start)


def analyze(path, **kw) -> Analysis:
    """Open ``path`` (a model folder or a .safetensors file) and :func:`analyze_checkpoint` it."""
    with open_checkpoint(path) as ck:
        return analyze_checkpoint(ck, **kw)
