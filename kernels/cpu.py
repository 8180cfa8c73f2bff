"""CPU split/merge of bf16 bit fields with numba (nopython, nogil).

The functions write into caller-provided arrays, so a decode worker can reuse its buffers,
and they release the GIL, so several worker threads run them at once. All arrays are 1-D and
contiguous; lengths must agree.

Bit layout (normative; docs/format.md): for a bf16 value as uint16 ``u``::

    exp = (u >> 7) & 0xFF
    sm  = ((u >> 8) & 0x80) | (u & 0x7F)
    u   = ((sm & 0x80) << 8) | (exp << 7) | (sm & 0x7F)
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _split(u16, exp_out, sm_out):  # pragma: no cover - compiled
    for i in range(u16.shape[0]):
        u = u16[i]
        exp_out[i] = (u >> 7) & 0xFF
        sm_out[i] = ((u >> 8) & 0x80) | (u & 0x7F)


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _merge(exp, sm, out):  # pragma: no cover - compiled
    for i in range(out.shape[0]):
        s = np.uint16(sm[i])
        out[i] = ((s & 0x80) << 8) | (np.uint16(exp[i]) << 7) | (s & 0x7F)


def _check(name: str, arr: np.ndarray, dtype, n: int | None) -> None:
    if arr.dtype != dtype or arr.ndim != 1 or not arr.flags.c_contiguous:
        raise ValueError(f"{name} must be a 1-D contiguous {np.dtype(dtype).name} array")
    if n is not None and arr.shape[0] != n:
        raise ValueError(f"{name} has {arr.shape[0]} elements, expected {n}")


def split_into(u16: np.ndarray, exp_out: np.ndarray, sm_out: np.ndarray) -> None:
    """Split bf16 values (as uint16) into exponent bytes and sign-mantissa bytes."""
    _check("u16", u16, np.uint16, None)
    _check("exp_out", exp_out, np.uint8, u16.shape[0])
    _check("sm_out", sm_out, np.uint8, u16.shape[0])
    _split(u16, exp_out, sm_out)


def merge_into(exp: np.ndarray, sm: np.ndarray, out_u16: np.ndarray) -> None:
    """Merge exponent bytes and sign-mantissa bytes back into bf16 values (as uint16)."""
    _check("out_u16", out_u16, np.uint16, None)
    _check("exp", exp, np.uint8, out_u16.shape[0])
    _check("sm", sm, np.uint8, out_u16.shape[0])
    _merge(exp, sm, out_u16)


def split(u16: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Allocating convenience form of :func:`split_into`."""
    u16 = np.ascontiguousarray(u16).reshape(-1)
    exp = np.empty(u16.shape[0], np.uint8)
    sm = np.empty(u16.shape[0], np.uint8)
    split_into(u16, exp, sm)
    return exp, sm


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _histogram_u16(u16, counts):  # pragma: no cover - compiled
    for i in range(u16.shape[0]):
        counts[u16[i]] += 1


def histogram_u16_into(u16: np.ndarray, counts: np.ndarray) -> None:
    """Add the values of ``u16`` to a 65536-bin int64 histogram (the joint bf16 bit pattern).

    Sign, exponent and mantissa histograms are its marginals (``counts.reshape(2, 256, 128)``).
    About 5x faster than ``np.bincount`` on uint16 (which converts to intp first), no temporary.
    """
    _check("u16", u16, np.uint16, None)
    if counts.dtype != np.int64 or counts.shape != (65536,) or not counts.flags.c_contiguous:
        raise ValueError("counts must be a contiguous int64 array of 65536 bins")
    _histogram_u16(u16, counts)


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _histogram_u8(exp, counts):  # pragma: no cover - compiled
    for i in range(exp.shape[0]):
        counts[exp[i]] += 1


def histogram_u8_into(exp: np.ndarray, counts: np.ndarray) -> None:
    """Add the byte histogram of ``exp`` (1-D uint8) into ``counts`` (int64[256]); nogil."""
    _histogram_u8(exp, counts)
