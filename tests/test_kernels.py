"""zipmoe.kernels on the CPU: numba split/merge and the dispatching merge, bit-exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zipmoe import kernels
from zipmoe.kernels import cpu

SPECIAL = np.array(
    [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7F81, 0xFFFF, 0x7FFF, 0x0001, 0x807F,
     0x007F, 0x0080, 0x7F7F, 0xFF7F, 0x3F80, 0xBF80],
    dtype=np.uint16,
)


def _ref_split(u):
    u = u.astype(np.uint32)
    return ((u >> 7) & 0xFF).astype(np.uint8), (((u >> 8) & 0x80) | (u & 0x7F)).astype(np.uint8)


def _patterns(n, seed=0):
    u = np.random.default_rng(seed).integers(0, 1 << 16, n, dtype=np.uint16)
    k = min(n, SPECIAL.size)
    u[:k] = SPECIAL[:k]
    return u


@pytest.mark.parametrize("n", [0, 1, 7, 8, 63, 64, 65, 1000, 4097, 1 << 16])
def test_split_merge_exact(n):
    u = _patterns(n)
    e, s = cpu.split(u)
    re, rs = _ref_split(u)
    assert np.array_equal(e, re) and np.array_equal(s, rs)
    out = np.empty(n, np.uint16)
    cpu.merge_into(e, s, out)
    assert np.array_equal(out, u)


def test_all_65536_patterns():
    u = np.arange(1 << 16, dtype=np.uint16)
    e, s = cpu.split(u)
    out = np.empty_like(u)
    cpu.merge_into(e, s, out)
    assert np.array_equal(out, u)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 0xFFFF), max_size=300), st.integers(0, 15))
def test_property_roundtrip(vals, offset):
    # unaligned views too: numpy slices starting at odd offsets
    u = np.zeros(len(vals) + offset, np.uint16)
    u[offset:] = vals
    u = u[offset:]
    e = np.empty(len(vals) + 3, np.uint8)[3:]
    s = np.empty(len(vals) + 1, np.uint8)[1:]
    cpu.split_into(u, e, s)
    out = np.empty(len(vals), np.uint16)
    kernels.merge(e, s, out)
    assert np.array_equal(out, u)


def test_merge_dispatch_numpy_and_torch_cpu():
    n = 10_001
    u = _patterns(n, 3)
    e, s = cpu.split(u)
    out = np.empty(n, np.uint16)
    assert kernels.merge(e, s, out) is out
    assert np.array_equal(out, u)
    # torch CPU tensors, bf16 output, 2-D shapes, shared memory (no copy)
    te, ts = torch.from_numpy(e).reshape(1, n), torch.from_numpy(s).reshape(n, 1)
    tb = torch.empty(n, dtype=torch.bfloat16)
    assert kernels.merge(te, ts, tb) is tb
    assert np.array_equal(tb.view(torch.int16).numpy().view(np.uint16), u)
    tu = torch.empty((73, 137), dtype=torch.uint16)
    kernels.merge(te, ts, tu)
    assert np.array_equal(tu.view(torch.int16).numpy().reshape(-1).view(np.uint16), u)
    # mixed numpy / torch CPU is fine
    tb2 = torch.empty(n, dtype=torch.bfloat16)
    kernels.merge(e, ts, tb2)
    assert torch.equal(tb.view(torch.int16), tb2.view(torch.int16))
    # split through dispatch
    e2 = torch.empty(n, dtype=torch.uint8)
    s2 = np.empty(n, np.uint8)
    kernels.split(tb, e2, s2)
    assert np.array_equal(e2.numpy(), e) and np.array_equal(s2, s)


def test_merge_rejects_bad_input():
    e = np.zeros(4, np.uint8)
    with pytest.raises(ValueError):
        kernels.merge(e, e, np.empty(5, np.uint16))
    with pytest.raises(ValueError):
        kernels.merge(e, e, np.empty(4, np.float32))
    with pytest.raises(ValueError):
        kernels.merge(e.astype(np.int16), e, np.empty(4, np.uint16))
    with pytest.raises(ValueError):
        kernels.merge(e, e, np.empty(8, np.uint16)[::2])
    with pytest.raises(ValueError):
        kernels.merge(torch.zeros(4, dtype=torch.uint8), e, torch.empty(4, dtype=torch.float32))


def test_triton_available_is_bool():
    assert isinstance(kernels.triton_available(), bool)


def test_torch_ops_fallback_exact():
    """The CUDA-without-triton fallback is device-agnostic torch code: check it on CPU tensors."""
    from zipmoe.kernels import dispatch

    u = _patterns(5000, 9)
    e, s = cpu.split(u)
    out = torch.empty(5000, dtype=torch.bfloat16)
    with pytest.warns(RuntimeWarning):
        dispatch._warned = False
        dispatch._torch_merge(torch.from_numpy(e), torch.from_numpy(s), out)
    assert np.array_equal(out.view(torch.int16).numpy().view(np.uint16), u)
