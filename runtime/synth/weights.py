"""Weights drawn like trained ones, deterministically, fast, one chunk at a time.

Every tensor has its own random stream: PCG64 seeded with ``(seed, blake2b(name))``, so a
tensor's values depend on the family's seed and the tensor's canonical name only (not on the
layout, the shard it lands in or the order of writing). Values are drawn by inverse-CDF
lookup: 16 raw random bits per value index a 65,536-entry quantile table of the tensor's
distribution, already scaled and rounded to bf16. That is about 4x faster than
``standard_normal`` plus a conversion, and exact at bf16 resolution over the body of the
distribution; the tails end at the 1/131,072 quantile (about 4.3 sigma for the normal) and
values below about 0.005 sigma are coarser than bf16 (0.4% of values).

Scales follow initialisation practice: std = 1/sqrt(fan_in) for linear layers, divided by
sqrt(2 * layers) for the projections that write into the residual stream (o_proj, down_proj,
w2, wo), times a per-tensor log-normal jitter (trained tensors differ in scale). Norm weights
are 1 + small noise. The embeddings share a common direction (the "mean hidden state" that
trained models have); routers get a bias along that direction whose size follows a Zipf-like
profile over a random ranking of the experts, so that a few experts per layer are hot
(``skew`` is the Zipf exponent; 0 gives uniform popularity). Routing ``natural`` picks the
exponent that gives a trained model's per-layer selection entropy (``natural_skew``);
``skewed`` uses the exponent given (default 1).
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np
import torch

from zipmoe.codecs.bitfield import entropy_from_counts as entropy_bits
from zipmoe.errors import UsageError

#: Values per generated chunk (a multiple of 4: four values per 64-bit raw draw).
CHUNK = 1 << 20

DISTRIBUTIONS = ("normal", "student-t")
#: Degrees of freedom of the heavy-tailed option (closed-form quantile; variance 2, rescaled to 1).
STUDENT_NU = 4

# Embedding entries ~ N(0, 1) plus the common direction (entries ~ N(0, 1)): large enough that
# the common direction still dominates the mean of the residual stream after every sublayer has
# added its output (each of norm ~ sqrt(hidden / (2 * layers))), so routers can be biased along it.
EMBED_STD = 1.0
JITTER = 0.25  # std of log(scale) across tensors
_U = 1.0 / (1 << 53)


def name_seed(seed: int, name: str) -> np.random.Generator:
    """The tensor's own random generator: PCG64 seeded with (seed, hash of name)."""
    h = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed & 0xFFFFFFFFFFFFFFFF, h])))


@functools.lru_cache(maxsize=4)
def quantile_table(dist: str) -> np.ndarray:
    """65,536 quantiles (float64, unit variance) at p = (i + 0.5) / 65536."""
    p = (np.arange(65536, dtype=np.float64) + 0.5) / 65536.0
    if dist == "normal":
        q = math.sqrt(2.0) * torch.special.erfinv(torch.from_numpy(2.0 * p - 1.0)).numpy()
    elif dist == "student-t":
        # Student's t with 4 degrees of freedom has a closed-form quantile function:
        # a = 4p(1-p), q = cos(acos(sqrt(a)) / 3) / sqrt(a), t = sign(p - 1/2) * 2 * sqrt(q - 1).
        a = 4.0 * p * (1.0 - p)
        qq = np.cos(np.arccos(np.sqrt(a)) / 3.0) / np.sqrt(a)
        q = np.sign(p - 0.5) * 2.0 * np.sqrt(np.maximum(qq - 1.0, 0.0)) / math.sqrt(2.0)
    else:
        raise UsageError(f"unknown distribution {dist!r}: use one of {', '.join(DISTRIBUTIONS)}")
    return np.ascontiguousarray(q)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32/float64 array -> uint16 bf16 bit patterns, rounded to nearest even (what
    torch's ``.to(torch.bfloat16)`` does for finite values; numpy only, no thread pool)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)


def bits_to_float(u16: np.ndarray) -> np.ndarray:
    """uint16 bf16 bit patterns -> float32."""
    return (u16.astype(np.uint32) << 16).view(np.float32)


def _uniform(rng: np.random.Generator) -> float:
    return (int(rng.bit_generator.random_raw()) >> 11) * _U + _U / 2


def _normal(rng: np.random.Generator) -> float:
    return NormalDist().inv_cdf(_uniform(rng))


@dataclass(frozen=True)
class Init:
    """How one tensor is drawn.

    kind: ``linear`` (std/jitter, dist), ``norm`` (1 + 0.05 N), ``bias``, ``embedding`` (with
    the common direction), ``router`` (with the Zipf bias), ``table`` (small lookup tables,
    e.g. relative attention biases).
    """

    kind: str
    std: float = 1.0
    dist: str = "normal"


@dataclass(frozen=True)
class Context:
    """What the draws of one checkpoint share: seed, hidden size, skew, layer count."""

    seed: int
    hidden: int
    skew: float
    num_layers: int


def common_direction(ctx: Context) -> np.ndarray:
    """The shared embedding direction m (float32 [hidden], entries ~ N(0, 1))."""
    rng = name_seed(ctx.seed, "__zipmoe_common_direction__")
    return bits_to_float(_lookup(rng, ctx.hidden, quantile_table("normal").astype(np.float32)))


def _lookup(rng: np.random.Generator, n: int, table: np.ndarray) -> np.ndarray:
    raw = rng.bit_generator.random_raw((n + 3) // 4)
    idx = raw.view(np.uint16)[:n]
    if table.dtype == np.uint16:
        return np.take(table, idx)
    return bf16_bits(np.take(table, idx))


def generate(name: str, shape: tuple, init: Init, ctx: Context):
    """Yield the tensor's values as uint16 bf16 bit patterns, in row-major chunks."""
    n = int(np.prod(shape)) if shape else 1
    rng = name_seed(ctx.seed, name)
    jitter = math.exp(JITTER * _normal(rng))
    if init.kind == "norm":
        table = bf16_bits(1.0 + 0.05 * jitter * quantile_table("normal"))
        yield _lookup(rng, n, table)
        return
    if init.kind == "router":
        yield router(name, shape, rng, ctx, jitter)
        return
    if init.kind == "embedding":
        m = common_direction(ctx)
        rows = max(1, CHUNK // shape[-1])
        table = (quantile_table("normal") * (EMBED_STD * jitter)).astype(np.float32)
        for r0 in range(0, shape[0], rows):
            r = min(rows, shape[0] - r0)
            vals = bits_to_float(_lookup(rng, r * shape[-1], bf16_bits(table))).reshape(r, shape[-1])
            vals += m
            yield bf16_bits(vals).reshape(-1)
        return
    std = init.std * jitter
    table = bf16_bits(quantile_table(init.dist) * std)
    for start in range(0, n, CHUNK):
        yield _lookup(rng, min(CHUNK, n - start), table)


def router(name: str, shape: tuple, rng: np.random.Generator, ctx: Context, jitter: float) -> np.ndarray:
    """Router rows: noise (logits ~ N(0, 1) on a normalised hidden state) plus a bias along the
    common direction that gives expert of popularity rank r a logit offset of
    ``-skew * ln(r + 1)`` (a Zipf profile); the ranking is a random permutation per layer."""
    experts, hidden = shape
    noise = bits_to_float(_lookup(rng, experts * hidden, quantile_table("normal").astype(np.float32)))
    w = noise.reshape(experts, hidden).astype(np.float64) / math.sqrt(hidden)
    # Random ranking of experts, from the same stream (Fisher-Yates on raw draws).
    order = list(range(experts))
    for i in range(experts - 1, 0, -1):
        j = int(rng.bit_generator.random_raw()) % (i + 1)
        order[i], order[j] = order[j], order[i]
    m = common_direction(ctx).astype(np.float64)
    u = m / np.linalg.norm(m)
    # A normalised hidden state x has |x| = sqrt(hidden) and x.u ~ COS * sqrt(hidden), where COS is
    # the cosine between the residual stream and the common direction (about 0.7 after the
    # embedding, a little lower in deeper layers).
    cos = 0.6
    # Remove the noise rows' own component along u, so that at skew 0 no expert is favoured.
    w -= np.outer(w @ u, u)
    for rank, e in enumerate(order):
        beta = -ctx.skew * math.log(rank + 1.0)
        w[e] += beta / (cos * math.sqrt(hidden)) * u
    return bf16_bits(w).reshape(-1)


ROUTINGS = ("natural", "skewed")
#: Logit noise of the idealised router that ``natural_skew`` solves for: the router rows give a
#: normalised hidden state logits ~ N(0, 1) besides the bias (see ``router``).
_NATURAL_SIGMA = 1.0
_NATURAL_DRAWS = 8192


@functools.lru_cache(maxsize=64)
def _natural_noise(experts: int) -> np.ndarray:
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([0x5A1B, experts])))
    return _NATURAL_SIGMA * rng.standard_normal((_NATURAL_DRAWS, experts))


def selection_entropy(skew: float, experts: int, top_k: int) -> float:
    """Entropy (bits) of the top-k selection distribution of the idealised router: logits
    ``-skew * ln(rank + 1) + N(0, 1)`` per token, iid (a fixed sample of 8,192 tokens)."""
    beta = -skew * np.log(np.arange(experts, dtype=np.float64) + 1.0)
    logits = _natural_noise(experts) + beta
    k = min(top_k, experts)
    top = np.argpartition(-logits, k - 1, axis=1)[:, :k] if k < experts else np.tile(np.arange(experts), (len(logits), 1))
    p = np.bincount(top.reshape(-1), minlength=experts) / top.size
    nz = p[p > 0]
    return float(-(nz * np.log2(nz)).sum())


@functools.lru_cache(maxsize=64)
def natural_skew(experts: int, top_k: int, target: float) -> float:
    """The Zipf exponent whose idealised selection entropy is ``target`` x log2(experts)
    (``target`` is the normalised entropy, 1 = uniform), by bisection; rounded to 1e-4 so the
    written bytes do not hang on the last bits of a float. Deterministic."""
    if not 0.0 < target <= 1.0:
        raise UsageError(f"natural routing needs a normalised entropy in (0, 1], got {target}")
    want = target * math.log2(experts)
    lo, hi = 0.0, 4.0
    if selection_entropy(lo, experts, top_k) <= want:
        return 0.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if selection_entropy(mid, experts, top_k) > want:
            lo = mid
        else:
            hi = mid
    return round((lo + hi) / 2, 4)


def exponent_histogram(u16: np.ndarray, step: int = 1) -> np.ndarray:
    """Counts of the 256 exponent byte values of bf16 bit patterns (every ``step``-th value)."""
    return np.bincount(((u16[::step] >> 7) & 0xFF).astype(np.uint8), minlength=256)


