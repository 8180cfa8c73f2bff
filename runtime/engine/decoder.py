"""The decode workers: decompress a fetch's E (and SM) bytes and merge them into its bf16 tensor.

:class:`Decoder` owns the decode threads (each with its own ``DecodeContext``: the zstd context
and scratch buffers). Where a fetch's bytes go is what the device side gave it
(:meth:`zipmoe.runtime.engine.device_side.DeviceSide.place`):

* ``f.exp_host`` / ``f.sm_host`` (CUDA with the Triton merge): the E bytes decompressed and the
  SM bytes copied into the two halves of the group's staging slot; the device merges;
* ``f.host`` (CUDA, host merge): merged into the staging slot as bf16;
* else ``f.out``: merged into the tensor itself (the CPU).

A tensor whose SM bytes are stored raw is split into one job per E chunk when several workers
can share it (:meth:`Decoder.split`), so that a miss waits for about a chunk's decode rather
than the whole tensor's. Every job ends with ``f.report(exc)`` (None when it succeeded), never
raising on a worker thread.
"""

from __future__ import annotations

import threading
import time

from zipmoe.codecs.checksum import verify_chunk
from zipmoe.runtime.engine.decode import decode_e_chunk, decode_exp_into, decode_into, decode_sm_into, u16_view
from zipmoe.runtime.engine.fetch import _Cancelled, _Fetch, fan_out, report_failure
from zipmoe.runtime.engine.workers import PriorityWorkers

__all__ = ["Decoder"]


class Decoder:
    """Decodes fetches on ``threads`` worker threads; ``timer(stage, seconds)`` gets the times."""

    def __init__(self, threads: int, timer=None) -> None:
        self.workers = max(1, int(threads))
        self.pool = PriorityWorkers(self.workers, "zipmoe-decode", on_error=report_failure)
        self.timer = timer if timer is not None else (lambda stage, seconds: None)
        self._local = threading.local()
        self._jobs: dict = {}  # uid -> (tensor, its chunk jobs when split, else None): worked out once per tensor

    def check(self) -> None:
        self.pool.check()

    def close(self) -> None:
        self.pool.shutdown()

    def _ctx(self):
        ctx = getattr(self._local, "ctx", None)
        if ctx is None:
            from zipmoe.codecs.exponent import DecodeContext

            ctx = self._local.ctx = DecodeContext()
        return ctx

    def split(self, f: _Fetch) -> bool:
        """Decode this tensor as one job per E chunk? When several workers can share it and its
        SM bytes are stored raw (each chunk's elements then merge on their own)."""
        return self.workers > 1 and all(getattr(s.sm_chunk, "codec", None) == "raw" and s.e_chunks for s in f.tensor.segments)

    def submit(self, f: _Fetch, rank, verify_e: bool, verify_sm: bool) -> None:
        """Queue the decode (and, but for a device merge, the merge) of ``f``; ``f.report`` once
        all of it ran.

        Split, each E chunk is a job of its own (decompress it, then merge its elements with
        their SM bytes, or copy both into the staging slot for the device merge). A segment's
        SM checksum is verified by the job of its first chunk; the tensor is used only when every
        job succeeded, so nothing computes with bytes whose checksum failed.

        The chunk jobs are queued by a worker (:meth:`_fan_out`) from one queued job: one queue
        operation is either done or not, so a Ctrl-C (it lands only in the serving thread,
        which queues a compressed hit's decode) cannot leave a tensor half queued, its queued
        jobs running unwatched while the layer gives their bytes back; and a reader goes back to
        reading after one queue operation.
        """
        t = f.tensor
        memo = self._jobs.get(t.uid)
        if memo is None or memo[0] is not t:
            memo = self._jobs[t.uid] = (t, [(i, k) for i, seg in enumerate(t.segments) for k in range(len(seg.e_chunks))]
                                        if self.split(f) else None)
        jobs = memo[1]
        if jobs is None:
            self.pool.submit(rank, self._whole, f, verify_e, verify_sm)
            return
        self.pool.submit(rank, self._fan_out, f, jobs, rank, verify_e, verify_sm)

    # ------------------------------------------------------------------ jobs (worker threads)
    def _decode(self, f: _Fetch, verify_e: bool, verify_sm: bool):
        t = f.tensor
        ctx = self._ctx()
        if f.exp_host is not None:  # the device merges
            decode_exp_into(t, f.e_parts, f.exp_host, ctx, verify_e)
            decode_sm_into(t, f.sm_parts, f.sm_host, ctx, verify_sm)
            return
        out_u16 = u16_view(f.host if f.host is not None else f.out)
        decode_into(t, f.e_parts, f.sm_parts, out_u16, ctx, verify_e, verify_sm, self.timer)

    def _fan_out(self, f: _Fetch, jobs: list, rank, verify_e: bool, verify_sm: bool) -> None:
        """On a decode worker: queue every chunk job of ``f`` but the first, then run the first
        (:func:`~zipmoe.runtime.engine.fetch.fan_out`)."""
        fan_out(self.pool, rank, self._piece, f, jobs, verify_e, verify_sm)

    def _whole(self, f: _Fetch, verify_e: bool, verify_sm: bool) -> None:
        if f.cancelled:
            f.report(_Cancelled())
            return
        try:
            t0 = time.perf_counter()
            self._decode(f, verify_e, verify_sm)
            if f.exp_host is not None:
                self.timer("decode", time.perf_counter() - t0)
            f.report(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the serving thread
            f.report(exc)

    def _piece(self, f: _Fetch, i: int, k: int, latch, verify_e: bool, verify_sm: bool) -> None:
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
        t0 = time.perf_counter()
        if verify_sm:  # split tensors store SM raw: the check is all there is to do
            verify_chunk(seg.sm_chunk, sm, seg.name, len(seg.e_chunks))
        lo, n = c.raw_offset, c.raw_length
        dst = seg.dst + lo
        if f.exp_host is not None:  # the device merges
            decode_e_chunk(seg, k, f.e_parts[i], f.exp_host[dst : dst + n], self._ctx(), verify_e)
            f.sm_host[dst : dst + n] = sm[lo : lo + n]
            self.timer("decode", time.perf_counter() - t0)
            return
        exp = self._ctx().scratch("exp", n)
        decode_e_chunk(seg, k, f.e_parts[i], exp, self._ctx(), verify_e)
        t1 = time.perf_counter()
        out_u16 = u16_view(f.host if f.host is not None else f.out)
        merge_into(exp, sm[lo : lo + n], out_u16[dst : dst + n])
        self.timer("decode", t1 - t0)
        self.timer("merge", time.perf_counter() - t1)
