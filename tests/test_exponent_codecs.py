"""Exponent codecs: exact round trips over arbitrary bf16 bit patterns, malformed input, fallbacks."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zipmoe.codecs import exponent
from zipmoe.codecs.bitfield import split_ref
from zipmoe.codecs.exponent import CODECS, DecodeContext, compress_or_raw, get_codec
from zipmoe.errors import ContainerError, UnknownCodecError

specials = st.sampled_from([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7FC1, 0xFFFF, 0x0001, 0x807F])
words = st.lists(st.one_of(st.integers(0, 0xFFFF), specials), max_size=2000)


@settings(max_examples=60, deadline=None)
@given(words, st.sampled_from(sorted(CODECS)))
def test_every_codec_round_trips_exponent_bytes(ws, codec_id):
    exp, sm = split_ref(np.array(ws, np.uint16))
    codec = CODECS[codec_id]
    ctx = DecodeContext()
    for data in (exp, sm):
        stored = codec.compress(data)
        out = np.full(len(data), 0xAA, np.uint8)
        codec.decompress_into(stored, out, ctx)
        assert np.array_equal(out, data)


@settings(max_examples=30, deadline=None)
@given(st.binary(max_size=5000), st.sampled_from(sorted(CODECS)))
def test_arbitrary_bytes_round_trip_through_compress_or_raw(data, codec_id):
    cid, stored = compress_or_raw(CODECS[codec_id], data)
    assert cid in (codec_id, "raw")
    if cid == "raw":
        assert stored == data
    out = np.empty(len(data), np.uint8)
    get_codec(cid).decompress_into(stored, out)
    assert out.tobytes() == data


@pytest.fixture(scope="module")
def exps():
    rng = np.random.default_rng(0)
    u = (rng.standard_normal(1 << 16).astype(np.float32) * 0.02).view(np.uint32) >> 16
    return split_ref(u.astype(np.uint16))[0]


@pytest.mark.parametrize("codec_id", ["zstd", "zstd-fast", "lz4", "lz4hc"])
def test_malformed_and_wrong_size_are_container_errors(codec_id, exps):
    codec = CODECS[codec_id]
    stored = codec.compress(exps)
    with pytest.raises(ContainerError):
        codec.decompress_into(stored, np.empty(len(exps) - 1, np.uint8))  # too small
    with pytest.raises(ContainerError):
        codec.decompress_into(stored, np.empty(len(exps) + 1, np.uint8))  # too large
    with pytest.raises(ContainerError):
        codec.decompress_into(stored[: len(stored) // 2], np.empty(len(exps), np.uint8))  # truncated
    with pytest.raises(ContainerError):
        codec.decompress_into(b"\x01\x02garbage" * 10, np.empty(len(exps), np.uint8))


def test_tuned_zstd_is_smallest_and_used_by_default(exps):
    sizes = {k: len(CODECS[k].compress(exps)) for k in ("zstd", "zstd-fast", "lz4", "lz4hc")}
    assert sizes["zstd"] <= min(sizes.values())
    assert exponent.DEFAULT_CODEC == "zstd"


def test_unknown_codec():
    with pytest.raises(UnknownCodecError, match="unknown codec 'brotli'"):
        get_codec("brotli")


def test_native_paths_present_and_python_fallback(monkeypatch, exps):
    assert exponent.native_available() == {"zstd": True, "lz4": True}
    stored = {k: CODECS[k].compress(exps) for k in CODECS}
    monkeypatch.setattr(exponent, "_ZSTD", None)
    monkeypatch.setattr(exponent, "_LZ4_DECOMPRESS", None)
    for k, s in stored.items():
        out = np.empty(len(exps), np.uint8)
        CODECS[k].decompress_into(s, out, DecodeContext())
        assert np.array_equal(out, exps)
        if k != "raw":
            with pytest.raises(ContainerError):
                CODECS[k].decompress_into(s[:-3], np.empty(len(exps), np.uint8), DecodeContext())


def test_python_decoders_are_an_explicit_choice_of_the_context(monkeypatch, exps):
    """``DecodeContext(native=False)`` decodes through the Python APIs even where the ctypes
    symbols exist (they would fail here if called); the default context uses them; no
    environment variable changes either (ZIPMOE_NO_CTYPES is read nowhere)."""
    stored = {k: CODECS[k].compress(exps) for k in CODECS}
    monkeypatch.setenv("ZIPMOE_NO_CTYPES", "1")
    assert DecodeContext().native and DecodeContext()._dctx  # the environment chooses nothing

    calls = []

    def no_lz4(*a):
        calls.append("lz4")
        raise AssertionError("native lz4 called")

    monkeypatch.setattr(exponent, "_LZ4_DECOMPRESS", no_lz4)
    ctx = DecodeContext(native=False)
    assert not ctx.native and ctx._dctx is None
    for k, s in stored.items():
        out = np.empty(len(exps), np.uint8)
        CODECS[k].decompress_into(s, out, ctx)
        assert np.array_equal(out, exps)
        if k != "raw":
            with pytest.raises(ContainerError):
                CODECS[k].decompress_into(s[:-3], np.empty(len(exps), np.uint8), ctx)
    assert calls == []
    with pytest.raises(AssertionError, match="native lz4 called"):  # the default context does use it
        CODECS["lz4"].decompress_into(stored["lz4"], np.empty(len(exps), np.uint8), DecodeContext())


def test_decode_from_many_threads_each_with_its_context(exps):
    stored = CODECS["zstd"].compress(exps)
    errors = []

    def work():
        ctx = DecodeContext()
        out = np.empty(len(exps), np.uint8)
        for _ in range(20):
            CODECS["zstd"].decompress_into(memoryview(stored), out, ctx)
            if not np.array_equal(out, exps):
                errors.append("mismatch")

    ts = [threading.Thread(target=work) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors


def test_dst_must_be_writeable_uint8():
    with pytest.raises(ValueError):
        CODECS["raw"].decompress_into(b"ab", np.empty(1, np.uint16))
