"""The decode side of a fetch, on the decode workers: decompress E (and SM), merge on the CPU
or stage for the device merge, a tensor split into one job per E chunk when workers can share it.
A mixin of :class:`zipmoe.runtime.engine.scheduler.LayerScheduler`."""

from __future__ import annotations

import time

from zipmoe.codecs.checksum import verify_chunk
from zipmoe.runtime.engine.decode import decode_e_chunk, decode_exp_into, decode_into, u16_view
from zipmoe.runtime.engine.fetch import _Cancelled, _Fetch, _Latch

__all__ = ["DecodeJobs"]


class DecodeJobs:
    """Decode jobs of :class:`LayerScheduler` (uses its ``rt``, ``pool``, ``workers``, ``cuda``,
    ``device_merge`` and ``_local``)."""

    def _ctx(self):
        ctx = getattr(self._local, "ctx", None)
        if ctx is None:
            from zipmoe.codecs.exponent import DecodeContext

            ctx = self._local.ctx = DecodeContext()
        return ctx

    def _decode(self, f: _Fetch, verify_e: bool, verify_sm: bool):
        t = f.tensor
        ctx = self._ctx()
        timer = self.rt.counters.add_time
        if self.cuda and self.device_merge:
            decode_exp_into(t, f.e_parts, f.exp_host, ctx, verify_e)
            from zipmoe.codecs.exponent import get_codec

            for seg, sm in zip(t.segments, f.sm_parts):
                if verify_sm:
                    verify_chunk(seg.sm_chunk, sm, seg.name, len(seg.e_chunks))
                dst = f.sm_host[seg.dst : seg.dst + seg.numel]
                if seg.sm_chunk.codec == "raw":
                    dst[:] = sm
                else:
                    get_codec(seg.sm_chunk.codec).decompress_into(sm, dst, ctx)
            return
        out_u16 = u16_view(f.host if self.cuda else f.out)
        decode_into(t, f.e_parts, f.sm_parts, out_u16, ctx, verify_e, verify_sm, timer)

    def _split(self, f: _Fetch) -> bool:
        """Decode this tensor as one job per E chunk? When several workers can share it and its
        SM bytes are stored raw (each chunk's elements then merge on their own)."""
        return self.workers > 1 and all(getattr(s.sm_chunk, "codec", None) == "raw" and s.e_chunks for s in f.tensor.segments)

    def _submit_decode(self, f: _Fetch, rank, verify_e: bool, verify_sm: bool, done) -> None:
        """Queue the decode (and, on the CPU, merge) of ``f``; ``done(f, exc)`` once all of it ran.

        Split, each E chunk is a job of its own (decompress it, then merge its elements with
        their SM bytes, or copy both to the pinned staging for the device merge), so that the
        idle workers share one tensor: a miss then waits for about a chunk's decode rather than
        the whole tensor's. A segment's SM checksum is verified by the job of its first chunk;
        the tensor is used only when every job succeeded, so nothing computes with bytes whose
        checksum failed.

        The chunk jobs are queued by a worker (:meth:`_fan_out`) from one queued job: one queue
        operation is either done or not, so a Ctrl-C (it lands only in the serving thread,
        which queues a compressed hit's decode) cannot leave a tensor half queued, its queued
        jobs running unwatched while the layer gives their bytes back; and the I/O thread goes
        back to reading after one queue operation.
        """
        if not self._split(f):
            self.pool.submit(rank, self._whole, f, verify_e, verify_sm, done)
            return
        jobs = [(i, k) for i, seg in enumerate(f.tensor.segments) for k in range(len(seg.e_chunks))]
        self.pool.submit(rank, self._fan_out, f, jobs, rank, verify_e, verify_sm, done)

    def _fan_out(self, f: _Fetch, jobs: list, rank, verify_e: bool, verify_sm: bool, done) -> None:
        """On a decode worker: queue every chunk job of ``f`` but the first, then run the first.
        A job that could not be queued counts as failed (the last job that runs reports it)."""
        latch = _Latch(len(jobs))
        queued = 1
        try:
            for i, k in jobs[1:]:
                self.pool.submit(rank, self._piece, f, i, k, verify_e, verify_sm, latch, done)
                queued += 1
        except BaseException as exc:  # noqa: BLE001
            for _ in range(len(jobs) - queued):
                latch.count_down(exc)  # never the last: the first job below is still to run
        i, k = jobs[0]
        self._piece(f, i, k, verify_e, verify_sm, latch, done)

    def _whole(self, f: _Fetch, verify_e: bool, verify_sm: bool, done) -> None:
        if f.cancelled:
            f.report(_Cancelled())
            return
        try:
            t0 = time.perf_counter()
            self._decode(f, verify_e, verify_sm)
            if self.cuda and self.device_merge:
                self.rt.counters.add_time("decode", time.perf_counter() - t0)
            f.report(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the serving thread
            f.report(exc)

    def _piece(self, f: _Fetch, i: int, k: int, verify_e: bool, verify_sm: bool, latch, done) -> None:
        exc = None
        try:
            self._decode_chunk(f, i, k, verify_e, verify_sm and k == 0)
        except BaseException as e:  # noqa: BLE001
            exc = e
        last, first_exc = latch.count_down(exc)
        if last:
            f.report(first_exc)

    def _decode_chunk(self, f: _Fetch, i: int, k: int, verify_e: bool, verify_sm: bool) -> None:
        from zipmoe.kernels.cpu import merge_into

        seg = f.tensor.segments[i]
        c = seg.e_chunks[k]
        sm = f.sm_parts[i]
        timer = self.rt.counters.add_time
        t0 = time.perf_counter()
        if verify_sm:
            verify_chunk(seg.sm_chunk, sm, seg.name, len(seg.e_chunks))
        lo, n = c.raw_offset, c.raw_length
        dst = seg.dst + lo
        if self.cuda and self.device_merge:
            decode_e_chunk(seg, k, f.e_parts[i], f.exp_host[dst : dst + n], self._ctx(), verify_e)
            f.sm_host[dst : dst + n] = sm[lo : lo + n]
            timer("decode", time.perf_counter() - t0)
            return
        exp = self._ctx().scratch("exp", n)
        decode_e_chunk(seg, k, f.e_parts[i], exp, self._ctx(), verify_e)
        t1 = time.perf_counter()
        out_u16 = u16_view(f.host if self.cuda else f.out)
        merge_into(exp, sm[lo : lo + n], out_u16[dst : dst + n])
        timer("decode", t1 - t0)
        timer("merge", time.perf_counter() - t1)
