"""The I/O side of a fetch, on the reader threads: read its ranges (split into pieces the readers
share), make the E / SM views, then queue its decode. A mixin of
:class:`zipmoe.runtime.engine.scheduler.LayerScheduler`."""

from __future__ import annotations

import time

from zipmoe.runtime.engine.fetch import _Cancelled, _Fetch, _Latch, _reads_of
from zipmoe.runtime.engine.reads import slice_of

__all__ = ["ReadJobs"]


class ReadJobs:
    """Reader jobs of :class:`LayerScheduler` (uses its ``rt`` and ``io``, and queues decodes with
    ``_submit_decode``)."""

    def _read(self, f: _Fetch, need_e: bool, need_sm: bool):
        t = f.tensor
        wanted = [r for s in t.segments for r, need in ((s.e_range, need_e), (s.sm_range, need_sm)) if need]
        bufs = []
        for (off, ln), buf in zip(f.ranges, f.bufs):
            payload = sum(r[1] for r in wanted if off <= r[0] < off + ln)
            bufs.append((off, self.rt.store.read(off, ln, payload, buf=buf, state=f.state or "none")))
        if need_e:
            f.e_parts = [slice_of(bufs, s.e_range) for s in t.segments]
        if need_sm:
            f.sm_parts = [slice_of(bufs, s.sm_range) for s in t.segments]

    def _read_then_decode(self, f: _Fetch, done, rank):
        """On a reader: read what ``f`` needs, then queue its decode.

        With one reader (or one piece) the ranges are read here one after the other. With
        several, this job queues every piece of every range but the first on the readers (at the
        fetch's rank, so a layer's reads are all in the queue together and the readers keep as
        many requests in flight as there are readers) and reads the first; the reader that
        finishes the last piece makes the views and queues the decode. As for the chunk jobs of
        a decode, one queued job fans out, so a Ctrl-C cannot leave a fetch half queued."""
        if f.cancelled:
            f.report(_Cancelled())
            return
        try:
            need_e, need_sm = _reads_of(f.state)
            store = self.rt.store
            pieces = []
            if len(self.io) > 1:
                pieces = [(ri, p) for ri, (off, ln) in enumerate(f.ranges) for p in store.pieces(off, ln)]
            if len(pieces) <= 1:
                self._read(f, need_e, need_sm)
                self._submit_decode(f, rank, need_e, need_sm, done)
                return
        except BaseException as exc:  # noqa: BLE001
            f.report(exc)
            return
        f.plog = []
        latch = _Latch(len(pieces))
        queued = 1
        try:
            for ri, p in pieces[1:]:
                self.io.submit(rank, self._read_piece, f, ri, p, latch, rank)
                queued += 1
        except BaseException as exc:  # noqa: BLE001
            for _ in range(len(pieces) - queued):
                latch.count_down(exc)
        self._read_piece(f, *pieces[0], latch, rank)

    def _read_piece(self, f: _Fetch, ri: int, piece, latch, rank) -> None:
        exc = None
        try:
            t0 = time.perf_counter()
            got, direct = self.rt.store.read_piece(f.bufs[ri], *piece)
            f.plog.append((ri, got, time.perf_counter() - t0, direct))
        except BaseException as e:  # noqa: BLE001
            exc = e
        last, first = latch.count_down(exc)
        if not last:
            return
        if first is not None:
            f.report(first)
            return
        try:
            need_e, need_sm = _reads_of(f.state)
            self._pieces_read(f, need_e, need_sm)
            self._submit_decode(f, rank, need_e, need_sm, f.done)
        except BaseException as e:  # noqa: BLE001
            f.report(e)

    def _pieces_read(self, f: _Fetch, need_e: bool, need_sm: bool) -> None:
        """Every piece of ``f`` is in its buffers: count the reads and make the views."""
        store = self.rt.store
        t = f.tensor
        wanted = [r for s in t.segments for r, need in ((s.e_range, need_e), (s.sm_range, need_sm)) if need]
        bufs = []
        for ri, ((off, ln), buf) in enumerate(zip(f.ranges, f.bufs)):
            log = [x for x in f.plog if x[0] == ri]
            payload = sum(r[1] for r in wanted if off <= r[0] < off + ln)
            store.account(payload, sum(x[1] for x in log), sum(x[2] for x in log), f.state or "none",
                          all(x[3] for x in log))
            bufs.append((off, store.view(buf, off, ln)))
        f.plog = None
        if need_e:
            f.e_parts = [slice_of(bufs, s.e_range) for s in t.segments]
        if need_sm:
            f.sm_parts = [slice_of(bufs, s.sm_range) for s in t.segments]
