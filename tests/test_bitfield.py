"""bf16 bit-field split/merge: numpy reference vs numba kernels, exhaustive and property-based."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from zipmoe.codecs.bitfield import bound_bytes, exp_entropy_bits, merge_ref, split_ref
from zipmoe.kernels.cpu import merge_into, split_into

ALL = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


def test_every_bit_pattern_round_trips():
    exp, sm = split_ref(ALL)
    assert np.array_equal(merge_ref(exp, sm), ALL)
    e2, s2 = np.empty_like(exp), np.empty_like(sm)
    split_into(ALL, e2, s2)
    assert np.array_equal(e2, exp) and np.array_equal(s2, sm)
    out = np.empty_like(ALL)
    merge_into(exp, sm, out)
    assert np.array_equal(out, ALL)
    # the split is a bijection: every (exp, sm) pair occurs exactly once
    assert len(set((exp.astype(np.uint32) << 8 | sm).tolist())) == 1 << 16


def test_layout_examples_from_format_md():
    exp, sm = split_ref(np.array([0xBF80, 0x3E20, 0x8000, 0x7FC1, 0xFF80, 0x0001], np.uint16))
    assert exp.tolist() == [0x7F, 0x7C, 0x00, 0xFF, 0xFF, 0x00]
    assert sm.tolist() == [0x80, 0x20, 0x80, 0x41, 0x80, 0x01]


specials = st.sampled_from([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7FC1, 0xFFFF, 0x7F81, 0x0001, 0x807F, 0x0080])
words = st.lists(st.one_of(st.integers(0, 0xFFFF), specials), max_size=300)


@settings(max_examples=200, deadline=None)
@given(words)
def test_split_merge_property(ws):
    u = np.array(ws, dtype=np.uint16)
    exp, sm = split_ref(u)
    e2, s2 = np.empty(len(u), np.uint8), np.empty(len(u), np.uint8)
    split_into(u, e2, s2)
    assert np.array_equal(e2, exp) and np.array_equal(s2, sm)
    out = np.empty(len(u), np.uint16)
    merge_into(e2, s2, out)
    assert np.array_equal(out, u)


def test_entropy_and_bound():
    assert exp_entropy_bits(np.zeros(10, np.uint8)) == 0.0
    assert abs(exp_entropy_bits(np.arange(256, dtype=np.uint8)) - 8.0) < 1e-12
    assert bound_bytes(np.zeros(8, np.uint8)) == 8.0  # 8 values, 16 bytes: sm bytes only
