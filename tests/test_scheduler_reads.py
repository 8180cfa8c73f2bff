"""Reads at queue depth > 1: pieces shared by several reader threads, bit-identical; the O_DIRECT fall-back counted."""

from __future__ import annotations

import errno
import json

import numpy as np
import pytest
import torch

import zipmoe
from zipmoe.runtime.engine.counters import Counters
from zipmoe.runtime.engine.reads import ALIGN, ExpertStore

from test_runtime_fixtures import container, inputs, reference


@pytest.mark.parametrize("piece", [4096, 3 * 4096, 1 << 20])
def test_pieces_cover_the_aligned_range_and_read_the_same_bytes(tmp_path, piece):
    data = np.random.default_rng(1).integers(0, 256, 40 * 4096 + 777, dtype=np.uint8)
    p = tmp_path / "f.bin"
    p.write_bytes(data.tobytes())
    s = ExpertStore(p, Counters(), piece=piece)
    for off, ln in ((0, 1), (4095, 2), (5000, 70000), (0, data.size), (40 * 4096, 777), (123, data.size - 123)):
        ps = s.pieces(off, ln)
        assert ps[0][0] == off - off % ALIGN and all(n <= piece and n % ALIGN == 0 for _, _, n, _ in ps)
        assert sum(n for _, _, n, _ in ps) == s.buffer_size(off, ln)
        assert sum(need for *_, need in ps) == off % ALIGN + ln
        buf = s.new_buffer(off, ln)
        for q in reversed(ps):  # any order: each piece has its own place
            s.read_piece(buf, *q)
        assert np.array_equal(s.view(buf, off, ln), data[off:off + ln])
        assert np.array_equal(s.read(off, ln), data[off:off + ln])
    s.close()


def test_a_refused_o_direct_read_falls_back_counted(tmp_path):
    data = np.arange(3 * 4096, dtype=np.uint32).view(np.uint8)
    p = tmp_path / "f.bin"
    p.write_bytes(data.tobytes())
    c = Counters()
    s = ExpertStore(p, c)
    if not s.direct:
        pytest.skip("no O_DIRECT on this file system (the open fall-back is counted: see below)")
    fill = s._fill

    def refuse_direct(fd, mv, off, need):
        if fd == s._dfd:
            raise OSError(errno.EINVAL, "Invalid argument")
        return fill(fd, mv, off, need)

    s._fill = refuse_direct
    assert np.array_equal(s.read(100, 5000), data[100:5100])
    assert not s.direct and c.direct_fallbacks == 1 and c.buffered_reads == 1
    assert "O_DIRECT" in s.fallback_reason
    s.read(0, 10)
    assert c.direct_fallbacks == 1 and c.buffered_reads == 2 and c.snapshot()["buffered_reads"] == 2
    s.close()


def test_o_direct_refused_at_open_is_counted(tmp_path, monkeypatch):
    import os

    p = tmp_path / "f.bin"
    p.write_bytes(b"x" * 5000)
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", no_direct)
    c = Counters()
    s = ExpertStore(p, c)
    assert not s.direct and c.direct_fallbacks == 1 and "Invalid argument" in s.fallback_reason
    s.read(0, 10)
    assert c.buffered_reads == 1
    s.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_reads_shared_by_readers_stay_bit_identical(tmp_path_factory, family):
    src, path = container(tmp_path_factory, family)
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    ref = reference(src)
    batch = inputs(vocab, False, batch=3, seed=4)
    with torch.no_grad():
        want = ref(**batch).logits
    figures = []
    for readers in (1, 4):
        model, _ = zipmoe.load(path, budget="64M", workers=2, readers=readers)
        rt = model.zipmoe
        rt.store.piece = ALIGN  # every range in 4 KiB pieces: many reads in flight at once
        assert rt.readers == readers and len(rt.fetcher.reader) == readers
        try:
            with torch.no_grad():
                for _ in range(2):
                    rt.cache.clear()
                    assert torch.equal(model(**batch).logits, want)
            snap = rt.counters.snapshot()
            figures.append((snap["bytes_read"], snap["bytes_read_disk"], snap["reads"]))
            assert rt._inflight == 0 and rt.describe()["readers"] == readers
        finally:
            rt.close()
    assert figures[0] == figures[1]  # the same reads, counted the same, whoever read the pieces


def test_an_idle_buffer_is_reused_up_to_the_limit_the_caller_counts():
    """ReadBuffers.get: the smallest idle buffer from the size asked to ``limit`` (by default the
    size and its slack); a read of half a tensor may so take the buffer a whole read of it left."""
    from zipmoe.runtime.engine.reads import ReadBuffers, fresh_size, reuse_slack

    b = ReadBuffers(Counters())
    whole = b.get(160 * ALIGN)
    assert len(whole) == fresh_size(160 * ALIGN) and b.made == 1
    b.put([whole], max_idle=1 << 30)
    half = 80 * ALIGN
    assert len(whole) > half + reuse_slack(half)
    fresh = b.get(half)  # the default limit: the whole buffer is too large
    assert fresh is not whole and b.made == 2
    b.put([fresh], max_idle=1 << 30)
    assert b.get(half, limit=len(whole)) is fresh  # the smallest that fits comes first
    assert b.get(half, limit=len(whole)) is whole and b.made == 2
    b.put([whole], max_idle=1 << 30)
    assert b.get(half, limit=len(whole) - 1) is not whole and b.made == 3  # never beyond the limit


def test_a_fetch_counts_the_read_buffers_it_took():
    """WorkingSet.bytes_of with the fetch's buffers: their lengths stand for a miss's staging
    bytes (what a fetch of the tensor may take at most), the rest of its bytes unchanged."""
    import mmap
    from types import SimpleNamespace

    from zipmoe.runtime.engine.reads import ReadBuffers
    from zipmoe.runtime.engine.working import WorkingSet, working_bytes_of

    t = SimpleNamespace(uid=3, full_bytes=2 * 4096 * 64, compute_bytes=2 * 4096 * 64, compute_itemsize=2,
                        staging_bytes=lambda: 6 * 4096 * 16)
    for staged in (False, True):
        w = WorkingSet(ReadBuffers(), window=2, expert_working=1 << 24, staged=staged)
        base = working_bytes_of(t) - (t.full_bytes if staged else 0)
        assert w.bytes_of(t) == base
        bufs = [mmap.mmap(-1, 5 * 4096), mmap.mmap(-1, 3 * 4096)]
        assert w.bytes_of(t, bufs) == base - t.staging_bytes() + 8 * 4096
        assert w.bytes_of(t, []) == base - t.staging_bytes()  # a compressed hit reads nothing
