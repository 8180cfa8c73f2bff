"""The .zmoe container: exact round trips, layout rules, and detection of every kind of damage."""

from __future__ import annotations

import errno
import json
import os
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_container_helpers import rewrite_index, write_dense, write_fused, write_mixtral
from zipmoe.codecs import format as fmt
from zipmoe.codecs.reader import ContainerReader, decode_exp_into
from zipmoe.codecs.verify import verify_container
from zipmoe.codecs.writer import ContainerWriter, pack
from zipmoe.errors import ChecksumError, ContainerError, OutOfSpaceError, UnknownCodecError, UsageError

specials = st.sampled_from([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7FC1, 0xFFFF, 0x0001, 0x807F])
bf16_words = st.lists(st.one_of(st.integers(0, 0xFFFF), specials), min_size=0, max_size=700)


def _torch_bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy().reshape(-1)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(bf16_words, min_size=1, max_size=4), st.binary(max_size=300),
       st.sampled_from(["zstd", "zstd-fast", "lz4", "lz4hc"]), st.integers(16, 400))
def test_container_round_trip_is_exact(tensors, other, codec, shard):
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "t.zmoe"
        other = other[: len(other) // 4 * 4]
        with ContainerWriter(out, codec, shard_size=shard, workers=2) as w:
            for i, ws in enumerate(tensors):
                w.add_tensor(f"model.layers.0.mlp.experts.{i}.up_proj.weight", "BF16", (len(ws),),
                             np.array(ws, np.uint16).view(np.uint8), role="expert", layer=0, expert=i, proj="up")
            w.add_tensor("f", "F32", (len(other) // 4,), np.frombuffer(other, np.uint8))
            w.add_file("config.json", b'{"model_type": "x"}')
            w.finish({"model": {}})
        with ContainerReader(out) as r:
            assert r.config == {"model_type": "x"}
            by = {e.name: e for e in r.entries}
            for i, ws in enumerate(tensors):
                e = by[f"model.layers.0.mlp.experts.{i}.up_proj.weight"]
                assert e.extent[0] % 4096 == 0
                assert np.array_equal(r.decode_entry(e).view(np.uint16), np.array(ws, np.uint16))
                if ws:  # the runtime helper decodes E chunks alone
                    exp_chunks = e.chunks_of("exp")
                    a, b = exp_chunks[0].offset, exp_chunks[-1].offset + exp_chunks[-1].length
                    exp = np.empty(len(ws), np.uint8)
                    decode_exp_into(e, r.read_range(a, b - a), exp)
                    assert np.array_equal(exp, (np.array(ws, np.uint16) >> 7).astype(np.uint8))
            assert r.decode_entry(by["f"]).tobytes() == other
        verify_container(out)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> bytes:
    """A small container (a few KB of data, several chunks per tensor) as bytes."""
    d = tmp_path_factory.mktemp("tiny")
    rng = np.random.default_rng(1)
    with ContainerWriter(d / "t.zmoe", "zstd", shard_size=128, workers=1) as w:
        for i in range(3):
            u = (rng.standard_normal(300).astype(np.float32) * 0.02).view(np.uint32) >> 16
            w.add_tensor(f"model.layers.0.mlp.experts.{i}.up_proj.weight", "BF16", (20, 15),
                         u.astype(np.uint16).view(np.uint8), role="expert", layer=0, expert=i, proj="up")
        w.add_tensor("norm", "F32", (40,), rng.standard_normal(40).astype(np.float32).view(np.uint8))
        w.add_file("config.json", b'{"model_type": "mixtral"}')
        w.finish({"model": {}})
    return (d / "t.zmoe").read_bytes()


def _full_check(path: Path) -> None:
    verify_container(path, workers=1)


def test_tiny_is_valid(tiny, tmp_path):
    p = tmp_path / "ok.zmoe"
    p.write_bytes(tiny)
    _full_check(p)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pos=st.data(), xor=st.integers(1, 255))
def test_flipping_any_byte_is_detected(tiny, tmp_path, pos, xor):
    i = pos.draw(st.integers(0, len(tiny) - 1))
    bad = bytearray(tiny)
    bad[i] ^= xor
    p = tmp_path / "bad.zmoe"
    p.write_bytes(bytes(bad))
    with pytest.raises(ContainerError):
        _full_check(p)


def test_flipping_any_header_or_index_byte_fails_on_open(tiny, tmp_path):
    """Every header byte and ~150 evenly spread index bytes: the reader refuses the file on open."""
    ioff = struct.unpack_from("<Q", tiny, 24)[0]
    p = tmp_path / "bad.zmoe"
    for i in list(range(64)) + list(range(ioff, len(tiny), max(1, (len(tiny) - ioff) // 150))) + [len(tiny) - 1]:
        bad = bytearray(tiny)
        bad[i] ^= 0x01 if i % 2 else 0x80
        p.write_bytes(bytes(bad))
        with pytest.raises(ContainerError):
            ContainerReader(p)


def test_flipping_chunk_bytes_names_tensor_and_chunk(tiny, tmp_path):
    p = tmp_path / "ok.zmoe"
    p.write_bytes(tiny)
    with ContainerReader(p) as r:
        e = r.entries[1]
        c = e.chunks[1]
    bad = bytearray(tiny)
    bad[c.offset + c.length // 2] ^= 0x10
    p.write_bytes(bytes(bad))
    with pytest.raises(ChecksumError, match=rf"tensor {e.name} chunk 1 \(exp\): checksum mismatch"):
        _full_check(p)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.data())
def test_truncating_anywhere_is_detected(tiny, tmp_path, n):
    cut = n.draw(st.integers(0, len(tiny) - 1))
    p = tmp_path / "cut.zmoe"
    p.write_bytes(tiny[:cut])
    with pytest.raises(ContainerError):
        ContainerReader(p)


def test_appended_bytes_are_detected(tiny, tmp_path):
    p = tmp_path / "long.zmoe"
    p.write_bytes(tiny + b"\0")
    with pytest.raises(ContainerError, match="unexpected bytes after the index"):
        ContainerReader(p)


def _rewrite(tiny: bytes, major: int = 1, index_fn=None) -> bytes:
    """Re-emit ``tiny`` with another version and/or an edited index (a function of the index
    document, chunks inline), checksums made valid."""
    return rewrite_index(tiny, index_fn, major=major, minor=0 if major != 1 else None)


def test_wrong_magic(tiny, tmp_path):
    p = tmp_path / "m.zmoe"
    p.write_bytes(b"GGUF" + tiny[4:])
    with pytest.raises(ContainerError, match="not a .zmoe file"):
        ContainerReader(p)


def test_future_major_version_is_refused_clearly(tiny, tmp_path):
    p = tmp_path / "v2.zmoe"
    p.write_bytes(_rewrite(tiny, major=2))
    with pytest.raises(ContainerError, match=r"newer zipmoe \(format version 2\.0\).*upgrade"):
        ContainerReader(p)


def test_unknown_codec_in_index(tiny, tmp_path):
    p = tmp_path / "c.zmoe"
    def zpaq(doc):
        doc["tensors"][0]["chunks"][-1]["codec"] = "zpaq"

    p.write_bytes(_rewrite(tiny, index_fn=zpaq))
    with pytest.raises(UnknownCodecError, match="unknown codec 'zpaq'"):
        ContainerReader(p)


def test_inconsistent_index_is_refused(tiny, tmp_path):
    def shift(doc):
        doc["tensors"][0]["chunks"][0]["raw_length"] += 1

    p = tmp_path / "i.zmoe"
    p.write_bytes(_rewrite(tiny, index_fn=shift))
    with pytest.raises(ContainerError, match="invalid index"):
        ContainerReader(p)


def test_interrupted_file_has_no_magic(tmp_path):
    w = ContainerWriter(tmp_path / "x.zmoe", workers=1)
    w.add_tensor("a", "BF16", (4,), np.zeros(8, np.uint8))
    w.flush()
    partial = w.tmp_path.read_bytes()
    w.abort()
    assert partial[:8] == b"\0" * 8
    assert os.listdir(tmp_path) == []
    p = tmp_path / "partial.zmoe"
    p.write_bytes(partial)
    with pytest.raises(ContainerError, match="interrupted"):
        ContainerReader(p)


# ------------------------------------------------------------------ pack() on checkpoints


def test_pack_mixtral_round_trip_and_layout(tmp_path):
    src = write_mixtral(tmp_path / "mx")
    s = pack(tmp_path / "mx", tmp_path / "mx.zmoe", shard_size=256, workers=2)
    assert not s.dense_only and s.num_expert_entries == 2 * 4 * 3
    with ContainerReader(tmp_path / "mx.zmoe") as r:
        assert r.meta["model"]["num_experts"] == 4 and r.meta["model"]["top_k"] == 2
        assert set(r.files) >= {"config.json", "generation_config.json", "tokenizer_config.json", "chat_template.jinja"}
        assert json.loads(r.read_file("generation_config.json")) == {"do_sample": False}
        dense_end = 0
        for e in r.entries:
            assert np.array_equal(r.decode_entry(e), _torch_bytes(src[e.name])), e.name
            if e.role == "expert":  # experts keep their 4096-aligned one-read layout
                assert e.extent[0] % 4096 == 0
            else:  # small dense tensors (all of them here) are packed back to back
                assert e.extent[0] == dense_end or dense_end == 0
                dense_end = e.extent[0] + e.extent[1]
        for L in range(2):
            for x in range(4):
                es = r.expert_entries(L, x)
                assert [e.proj for e in es] == ["gate", "up", "down"]
                for a, b in zip(es, es[1:]):  # one expert = one contiguous read
                    assert b.extent[0] == fmt.align_up(a.extent[0] + a.extent[1])
        assert r.entries[0].role == "dense"
        assert {e.name for e in r.dense_entries()} == {n for n in src if ".experts." not in n}
    verify_container(tmp_path / "mx.zmoe", against=tmp_path / "mx")


def test_pack_fused_stores_one_entry_per_expert(tmp_path):
    src = write_fused(tmp_path / "fu")
    pack(tmp_path / "fu", tmp_path / "fu.zmoe", workers=1)
    with ContainerReader(tmp_path / "fu.zmoe") as r:
        es = r.expert_entries(1, 2)
        assert [(e.proj, e.fused_index, e.shape) for e in es] == [("gate_up", 2, (16, 16)), ("down", 2, (16, 8))]
        fused = src["model.layers.1.mlp.experts.gate_up_proj"]
        assert np.array_equal(r.decode_entry(es[0]), _torch_bytes(fused[2]))
        assert es[0].source_shape == (4, 16, 16)
        shared = [e for e in r.entries if "shared_expert" in e.name]
        assert shared and all(e.role == "dense" for e in shared)
    verify_container(tmp_path / "fu.zmoe", against=tmp_path / "fu")


def test_verify_against_detects_a_different_source(tmp_path):
    write_mixtral(tmp_path / "a", seed=0)
    write_mixtral(tmp_path / "b", seed=5)
    pack(tmp_path / "a", tmp_path / "a.zmoe", workers=1)
    with pytest.raises(ContainerError, match="differs from the source"):
        verify_container(tmp_path / "a.zmoe", against=tmp_path / "b")


def test_dense_model_packs(tmp_path):
    write_dense(tmp_path / "d")
    s = pack(tmp_path / "d", tmp_path / "d.zmoe", workers=1)
    assert s.dense_only and s.num_expert_entries == 0


def test_refuses_to_overwrite_without_force(tmp_path):
    write_dense(tmp_path / "d")
    (tmp_path / "d.zmoe").write_bytes(b"keep me")
    with pytest.raises(UsageError, match="--force"):
        pack(tmp_path / "d", tmp_path / "d.zmoe")
    assert (tmp_path / "d.zmoe").read_bytes() == b"keep me"
    pack(tmp_path / "d", tmp_path / "d.zmoe", force=True)
    ContainerReader(tmp_path / "d.zmoe").close()


def test_refuses_to_write_over_a_source_file(tmp_path):
    write_dense(tmp_path / "d")
    before = (tmp_path / "d" / "model.safetensors").read_bytes()
    with pytest.raises(UsageError, match="part of the source"):
        pack(tmp_path / "d", tmp_path / "d" / "model.safetensors", force=True)
    assert (tmp_path / "d" / "model.safetensors").read_bytes() == before


def test_no_space_left_removes_the_partial_file(tmp_path, monkeypatch):
    """os.write raising ENOSPC (a full disk) mid-pack: OutOfSpaceError and no file left."""
    write_mixtral(tmp_path / "mx")
    real, calls = os.write, {"n": 0}

    def full_disk(fd, data):
        calls["n"] += 1
        if calls["n"] > 5:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(os, "write", full_disk)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(OutOfSpaceError, match="no space left"):
        pack(tmp_path / "mx", out / "mx.zmoe", workers=1)
    assert calls["n"] > 5
    assert os.listdir(out) == []


def test_ctrl_c_removes_the_partial_file(tmp_path):
    write_mixtral(tmp_path / "mx")
    out = tmp_path / "out"
    out.mkdir()

    def interrupt(done, total):
        if done > total // 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        pack(tmp_path / "mx", out / "mx.zmoe", workers=2, progress=interrupt)
    assert os.listdir(out) == []
    assert (tmp_path / "mx" / "model-00001-of-00002.safetensors").exists()


def test_size_within_half_a_point_of_the_bound(tmp_path):
    """MB-sized tensors: padding and frame overhead cost less than 0.5 pp with the default codec."""
    rng = np.random.default_rng(0)
    with ContainerWriter(tmp_path / "b.zmoe", "zstd", workers=2) as w:
        for i in range(3):
            x = rng.standard_normal(1 << 21).astype(np.float32) * 0.02
            u = (x.view(np.uint32) >> 16).astype(np.uint16)
            w.add_tensor(f"model.layers.0.mlp.experts.{i}.up_proj.weight", "BF16", (1024, 2048), u.view(np.uint8),
                         role="expert", layer=0, expert=i, proj="up")
        st_ = w.finish({})
    stored = (tmp_path / "b.zmoe").stat().st_size
    bf16 = st_.bf16_bytes
    assert stored / bf16 - st_.bound_bytes / bf16 < 0.005, (stored / bf16, st_.bound_bytes / bf16)


def test_format_1_0_files_still_read(tmp_path):
    """A 1.0 file (chunks inline, every extent aligned; the writer's version="1.0" path) opens,
    verifies against its source and unpacks to the same bytes as a 1.1 file of the same model."""
    from zipmoe.codecs.safetensors_out import unpack

    src = write_mixtral(tmp_path / "mx")
    pack(tmp_path / "mx", tmp_path / "old.zmoe", shard_size=256, workers=1, version="1.0")
    pack(tmp_path / "mx", tmp_path / "new.zmoe", shard_size=256, workers=1)
    old = (tmp_path / "old.zmoe").read_bytes()
    assert struct.unpack_from("<HH", old, 8) == (1, 0)
    assert struct.unpack_from("<HH", (tmp_path / "new.zmoe").read_bytes(), 8) == (1, 1)
    ioff, ilen = struct.unpack_from("<QQ", old, 24)
    doc = json.loads(old[ioff:ioff + ilen])
    assert doc["format_version"] == "1.0" and "chunk_table" not in doc and all("chunks" in t for t in doc["tensors"])
    with ContainerReader(tmp_path / "old.zmoe") as r:
        assert all(e.extent[0] % 4096 == 0 for e in r.entries)
        assert all(f.offset % 4096 == 0 for f in r.file_entries.values())
        for e in r.entries:
            assert np.array_equal(r.decode_entry(e), _torch_bytes(src[e.name]))
    verify_container(tmp_path / "old.zmoe", against=tmp_path / "mx")
    unpack(tmp_path / "old.zmoe", tmp_path / "u_old")
    unpack(tmp_path / "new.zmoe", tmp_path / "u_new")
    assert (tmp_path / "u_old" / "model.safetensors").read_bytes() == (tmp_path / "u_new" / "model.safetensors").read_bytes()


def test_a_1_0_file_with_an_unaligned_extent_is_refused(tmp_path):
    """What 1.1 allows for small dense tensors, 1.0 does not: a reader holds each file to its version."""
    write_mixtral(tmp_path / "mx")
    pack(tmp_path / "mx", tmp_path / "old.zmoe", shard_size=256, workers=1, version="1.0")
    data = (tmp_path / "old.zmoe").read_bytes()

    def shift(doc):
        e = next(t for t in doc["tensors"] if t["role"] == "dense" and t["chunks"])
        e["extent"][0] += 8
        for c in e["chunks"]:
            c["offset"] += 8

    p = tmp_path / "bad.zmoe"
    p.write_bytes(rewrite_index(data, shift))
    with pytest.raises(ContainerError, match="not aligned to 4096"):
        ContainerReader(p)


def test_many_small_tensors_pay_no_padding(tmp_path):
    """Hundreds of small dense tensors (biases, norms): 1.1 packs them back to back, so the file
    stays within 0.5 points of the per-tensor bound; 1.0 aligned each one (several points)."""
    rng = np.random.default_rng(0)
    sizes = {}

    for version in ("1.0", "1.1"):
        out = tmp_path / f"s{version}.zmoe"
        with ContainerWriter(out, "zstd", workers=1, version=version) as w:
            for L in range(4):
                for k, n in enumerate((768 * 768, 768 * 3072, 3072 * 768)):
                    x = rng.standard_normal(n).astype(np.float32) * 0.02
                    w.add_tensor(f"encoder.layer.{L}.w{k}.weight", "BF16", (n,),
                                 (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8))
                for k in range(10):  # biases and norms of 768 or 3072 values
                    n = 3072 if k == 0 else 768
                    x = (rng.standard_normal(n) * 0.05 + (1.0 if k % 3 == 0 else 0.0)).astype(np.float32)
                    w.add_tensor(f"encoder.layer.{L}.small{k}", "BF16", (n,),
                                 (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8))
            st_ = w.finish({})
        sizes[version] = (out.stat().st_size / st_.bf16_bytes - st_.bound_bytes / st_.bf16_bytes)
    assert sizes["1.1"] < 0.005, sizes  # (0.49 points: most of it is zstd's Huffman coding of the big ones)
    assert sizes["1.0"] > sizes["1.1"] + 0.002, sizes
