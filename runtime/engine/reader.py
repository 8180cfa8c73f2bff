"""The reader threads: read what a fetch needs from the container, make its E / SM views, hand it on.

:class:`Reader` owns the reader threads (``threads`` of them: the queue depth of expert reads)
and reads through an :class:`~zipmoe.runtime.engine.reads.ExpertStore`. A fetch's coalesced file
ranges are cut into pieces (``store.pieces``) that the readers share, so that several requests
are in flight; the reader that finishes the last piece counts the read, makes the views
(``f.e_parts`` / ``f.sm_parts``) and calls ``then(f, rank, need_e, need_sm)`` (the fetcher
queues the decode there). An error is reported to the fetch (``f.report(exc)``), never raised
on a reader thread.
"""

from __future__ import annotations

import time

from zipmoe.runtime.engine.fetch import _Cancelled, _Fetch, _reads_of, fan_out, report_failure
from zipmoe.runtime.engine.reads import fresh_size, slice_of
from zipmoe.runtime.engine.workers import PriorityWorkers

__all__ = ["Reader"]


class Reader:
    """Reads fetches on ``threads`` reader threads from ``store``."""

    def __init__(self, store, threads: int) -> None:
        self.store = store
        self.io = PriorityWorkers(max(1, int(threads)), "zipmoe-io", on_error=report_failure)

    def __len__(self) -> int:
        return len(self.io)

    def prepare(self, f: _Fetch) -> None:
        """Before ``f`` holds its bytes: what it reads, and its read buffers (idle ones first, so
        that the hold that follows counts them as this fetch's and not as idle)."""
        store = self.store
        t = f.tensor
        f.ranges = ranges = t.ranges(*_reads_of(f.state))
        get = store.buffers.get
        if len(ranges) == 1:
            # what the working set counts for this fetch's buffers is a miss's (the tensor's
            # staging bytes), whatever this fetch reads: an idle buffer up to that size will do
            off, ln = ranges[0]
            f.bufs = [get(store.buffer_size(off, ln), t.staging_bytes())]
            return
        sizes = [store.buffer_size(off, ln) for off, ln in ranges]
        # each buffer may take what the others' fresh sizes leave of that count
        room = t.staging_bytes() - sum(fresh_size(n) for n in sizes)
        bufs = []
        for n in sizes:
            m = get(n, fresh_size(n) + room)
            room -= len(m) - fresh_size(n)
            bufs.append(m)
        f.bufs = bufs

    def submit(self, rank, f: _Fetch, then) -> None:
        self.io.submit(rank, self._read_then_decode, f, then, rank)

    def check(self) -> None:
        self.io.check()

    def close(self) -> None:
        self.io.shutdown()

    # ------------------------------------------------------------------ jobs (reader threads)
    def _read(self, f: _Fetch, need_e: bool, need_sm: bool):
        t = f.tensor
        wanted = [r for s in t.segments for r, need in ((s.e_range, need_e), (s.sm_range, need_sm)) if need]
        bufs = []
        for (off, ln), buf in zip(f.ranges, f.bufs):
            payload = sum(r[1] for r in wanted if off <= r[0] < off + ln)
            bufs.append((off, self.store.read(off, ln, payload, buf=buf, state=f.state or "none")))
        if need_e:
            f.e_parts = [slice_of(bufs, s.e_range) for s in t.segments]
        if need_sm:
            f.sm_parts = [slice_of(bufs, s.sm_range) for s in t.segments]

    def _read_then_decode(self, f: _Fetch, then, rank):
        """On a reader: read what ``f`` needs, then ``then(f, rank, need_e, need_sm)``.

        With one reader (or one piece) the ranges are read here one after the other. With
        several, this job queues every piece of every range but the first on the readers (at the
        fetch's rank, so a layer's reads are all in the queue together and the readers keep as
        many requests in flight as there are readers) and reads the first; the reader that
        finishes the last piece makes the views and hands the fetch on. As for the chunk jobs of
        a decode, one queued job fans out, so a Ctrl-C cannot leave a fetch half queued."""
        if f.cancelled:
            f.report(_Cancelled())
            return
        try:
            need_e, need_sm = _reads_of(f.state)
            pieces = []
            if len(self.io) > 1:
                pieces = [(ri, p) for ri, (off, ln) in enumerate(f.ranges) for p in self.store.pieces(off, ln)]
            if len(pieces) <= 1:
                self._read(f, need_e, need_sm)
                then(f, rank, need_e, need_sm)
                return
        except BaseException as exc:  # noqa: BLE001
            f.report(exc)
            return
        f.plog = []
        fan_out(self.io, rank, self._read_piece, f, pieces, rank, then)

    def _read_piece(self, f: _Fetch, ri: int, piece, latch, rank, then) -> None:
        exc = None
        try:
            t0 = time.perf_counter()
            got, direct = self.store.read_piece(f.bufs[ri], *piece)
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
            then(f, rank, need_e, need_sm)
        except BaseException as e:  # noqa: BLE001
            f.report(e)

    def _pieces_read(self, f: _Fetch, need_e: bool, need_sm: bool) -> None:
        """Every piece of ``f`` is in its buffers: count the reads and make the views."""
        store = self.store
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
