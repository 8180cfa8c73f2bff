"""bf16 bit fields: numpy reference of the split into exponent and sign-mantissa bytes.

The fast path lives in :mod:`zipmoe.kernels.cpu` (numba, nogil, into preallocated arrays);
these functions define the layout (docs/format.md section 2) and are what the tests compare
the fast path against. ``u`` is a bf16 value viewed as uint16::

    exp = (u >> 7) & 0xFF
    sm  = ((u >> 8) & 0x80) | (u & 0x7F)
    u   = ((sm & 0x80) << 8) | (exp << 7) | (sm & 0x7F)
"""

from __future__ import annotations

import numpy as np

from zipmoe.kernels.cpu import histogram_u8_into, merge_into, split_into

__all__ = ["split_ref", "merge_ref", "split_into", "merge_into", "exp_entropy_bits", "bound_bytes"]


def split_ref(u16: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Split uint16 bf16 words into (exp, sm) uint8 arrays (numpy, allocating)."""
    u = np.ascontiguousarray(u16, dtype=np.uint16).reshape(-1)
    exp = ((u >> 7) & 0xFF).astype(np.uint8)
    sm = (((u >> 8) & 0x80) | (u & 0x7F)).astype(np.uint8)
    return exp, sm


def merge_ref(exp: np.ndarray, sm: np.ndarray) -> np.ndarray:
    """Merge (exp, sm) uint8 arrays back into uint16 bf16 words (numpy, allocating)."""
    e = np.asarray(exp, dtype=np.uint16)
    s = np.asarray(sm, dtype=np.uint16)
    return (((s & 0x80) << 8) | (e << 7) | (s & 0x7F)).astype(np.uint16)


def entropy_from_counts(counts: np.ndarray) -> float:
    """Shannon entropy (bits per symbol) of a histogram; 0.0 for an empty one."""
    c = np.asarray(counts, dtype=np.float64)
    total = c.sum()
    if total <= 0:
        return 0.0
    p = c[c > 0] / total
    return float(max(0.0, -(p * np.log2(p)).sum()))


def exp_entropy_bits(exp: np.ndarray) -> float:
    """Shannon entropy (bits per value) of exponent bytes."""
    return entropy_from_counts(np.bincount(np.asarray(exp).reshape(-1), minlength=256))


def bound_bytes(exp: np.ndarray) -> float:
    """The per-tensor size bound: n · (8 + H(exp)) / 8 bytes for n bf16 values (2n bytes)."""
    return exp.size * (8.0 + exp_entropy_bits(exp)) / 8.0


def histogram_into(exp: np.ndarray, counts: np.ndarray) -> None:
    """Add the byte histogram of ``exp`` (1-D uint8) into ``counts`` (int64[256]); nogil."""
    histogram_u8_into(exp, counts)
