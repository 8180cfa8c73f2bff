"""Per sparse layer: fetch the chosen experts' weights and compute them while the rest load.

Once the router of a layer has chosen, :meth:`LayerScheduler.run` gets the chosen experts (in
ascending id, the eager order) and a ``compute(expert, weights)`` callback. Each chosen
expert tensor's state in the cache decides its task graph (docs/architecture.md,
``schedule_model``):

========== ======================================== ========
state      tasks                                    type
========== ======================================== ========
full       compute                                  –
compressed decompress E, merge, compute             II
sm_only    read E, decompress E, merge, compute     II
e_only     read SM, decompress E, merge, compute    I
none       read SM+E, decompress E, merge, compute  I
========== ======================================== ========

Resources: ``readers`` I/O threads (each miss's ranges are cut into pieces the readers share:
queue depth = readers; see ``_read_then_decode``), ``workers`` decode threads (each decompresses with its own
DecodeContext into reusable scratch and merges with numba, both without the GIL: on the CPU
the merge runs in the same worker job, ``Costs.merge_on_workers``), and the serving thread
(the device), which computes. Order: the list schedule of
:func:`zipmoe.runtime.plan.simulate.order`, the one the planner simulates: the I/O thread and
the workers each take the queued op that comes first in it (priority queues, not FIFO), i.e.
Type I before Type II: ``none`` (shortest read first) < ``e_only`` < ``sm_only`` <
``compressed`` (largest first). So the disk starts with Type-I reads and stays busy while the
workers fill with Type-II decompressions, which need no read. An expert computes as soon as
all its tensors are whole (fully cached experts first, then in completion order), while the
others load. The number of experts in flight is bounded by the *window* the budget leaves room
for (their working buffers are counted in the budget); experts enter it by their first task's
rank.

Bit-identity: experts are computed in whatever order they become ready, but their outputs are
accumulated by the caller in ascending expert order, as transformers' eager loop does; the
per-expert products do not depend on when they were computed.

On CUDA the workers decode and merge into a (pinned) host buffer and the serving thread copies
it to the device; with the Triton merge available (``zipmoe.kernels.merge``), the workers only
decompress and the serving thread copies E and SM bytes to the device and merges there,
straight into the tensor the expert computes with.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque

import numpy as np
import torch

from zipmoe.errors import ContainerError, ServingError, ZipmoeError

from zipmoe.runtime.serve.order import Task, order as priority_order
from zipmoe.codecs.checksum import verify_chunk
from zipmoe.runtime.serve.decode import decode_e_chunk, decode_exp_into, decode_into, u16_view
from zipmoe.runtime.serve.reads import slice_of
from zipmoe.runtime.serve.tensors import ExpertTensor

__all__ = ["LayerScheduler", "issue_order", "expert_type", "PriorityWorkers", "demote"]

def _reads_of(state) -> tuple[bool, bool]:
    """(read E?, read SM?) for a tensor fetched from this cache state."""
    return state in (None, "none", "sm_only"), state in (None, "none", "e_only")


def expert_type(states: list) -> str:
    """``full`` when every tensor is whole, ``I`` when one must read its SM chunk, else ``II``."""
    if all(s == "full" for s in states):
        return "full"
    if any(_reads_of(s)[1] for s in states):
        return "I"
    return "II"


def issue_order(experts: list, states: dict, tensors: dict) -> tuple[list, dict]:
    """Experts that need work, in the order they enter the window, and each tensor's rank.

    Ranks come from :func:`schedule_model.order` over the layer's tensor tasks; an expert's
    place is its best-ranked tensor's. Returns ``(experts, {uid: rank})``.
    """
    tasks, uids = [], []
    for e in experts:
        for t, st in zip(tensors[e], states[e]):
            tasks.append(Task(st or "none", t.full_bytes, t.e_bytes, t.sm_bytes, expert=e))
            uids.append(t.uid)
    rank = {}
    for r, i in enumerate(priority_order(tasks)):
        rank[uids[i]] = r
    need = [e for e in experts if expert_type(states[e]) != "full"]
    need.sort(key=lambda e: min(rank[t.uid] for t in tensors[e]))
    return need, rank


class PriorityWorkers:
    """Threads that run queued jobs, the lowest rank first (ties: first queued first).

    A job that raises does not kill its thread: the exception goes to ``on_error(fn, args,
    exc)`` (the scheduler hands it to the fetch the job was for, so that the layer waiting for
    that fetch learns it at once), or, without a handler, is kept in :attr:`failure` for
    whoever waits to find (:meth:`check`). A thread that stops anyway (the handler itself
    failed) is seen by :meth:`check` too: the layer waits with a timeout and asks.
    """

    def __init__(self, n: int, name: str, on_error=None) -> None:
        self._q: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()
        self.name = name
        self.on_error = on_error
        self.failure: BaseException | None = None
        self._stopping = False
        self._threads = [threading.Thread(target=self._loop, name=f"{name}-{i}", daemon=True) for i in range(n)]
        for th in self._threads:
            th.start()

    def __len__(self) -> int:
        return len(self._threads)

    def submit(self, rank, fn, *args) -> None:
        self._q.put((rank, next(self._seq), fn, args))

    def _loop(self) -> None:
        while True:
            _, _, fn, args = self._q.get()
            if fn is None:
                return
            try:
                fn(*args)
            except BaseException as exc:  # noqa: BLE001 - a job's failure must not stop the thread
                handler = self.on_error
                if handler is None:
                    self.failure = exc
                    continue
                try:
                    handler(fn, args, exc)
                except BaseException as exc2:  # noqa: BLE001
                    self.failure = exc2
                    raise

    def check(self) -> None:
        """Raise :class:`ServingError` if a job failed unhandled or a thread stopped."""
        exc = self.failure
        if exc is not None:
            self.failure = None
            raise ServingError(f"a {self.name} thread failed: {_one_line(exc)}") from None
        if not self._stopping and not all(th.is_alive() for th in self._threads):
            raise ServingError(f"a {self.name} thread stopped; reload the model")

    def shutdown(self) -> None:
        self._stopping = True
        if not any(th.is_alive() for th in self._threads):
            return
        for _ in self._threads:
            self._q.put((float("inf"), next(self._seq), None, ()))
        for th in self._threads:
            th.join()


def _one_line(exc: BaseException) -> str:
    msg = " ".join(str(exc).split()) or "(no message)"
    return msg if isinstance(exc, ZipmoeError) else f"{type(exc).__name__}: {msg}"


class _Fetch:
    """One expert tensor being made whole."""

    __slots__ = ("tensor", "state", "out", "e_parts", "sm_parts", "host", "exp_host", "sm_host", "pinned", "w", "bufs",
                 "ranges", "done", "reported", "_lock", "plog", "group", "cancelled")

    def __init__(self, tensor: ExpertTensor, state):
        self.tensor = tensor
        self.state = state
        self.done = None  # done(f, exc): tells the layer this fetch finished (set when submitted)
        self.reported = False
        self._lock = threading.Lock()
        self.plog = None  # (range index, bytes, seconds, direct?) of each piece read
        self.group = None  # the _Group (one expert's fetches) it belongs to
        self.cancelled = False  # a dropped prefetch: jobs not started yet skip their work
        self.out = None
        self.e_parts = None
        self.sm_parts = None
        self.host = None
        self.exp_host = None
        self.sm_host = None
        self.pinned = None  # the pinned torch tensors behind exp_host / sm_host (for async copies)
        self.w = None  # the tensor the expert computes with (out, or out converted to the compute dtype)
        self.ranges: list = []  # the file ranges it reads (coalesced), one buffer each
        self.bufs: list = []  # the aligned read buffers (store.buffers) behind e_parts / sm_parts


    def report(self, exc) -> None:
        """Tell the layer once that this fetch finished (``exc``: its error or None); a second
        report (a job that failed after its fetch was reported) is ignored."""
        with self._lock:
            if self.reported:
                return
            self.reported = True
        self.done(self, exc)


class _Cancelled(Exception):
    """A dropped prefetch's job that had not started yet (not an error)."""


class _Group:
    """The fetches of one expert: one window slot, its working bytes, done when all report."""

    __slots__ = ("layer", "expert", "prefetch", "fetches", "states", "remaining", "reserved", "errors",
                 "dropped", "released")

    def __init__(self, layer, expert, prefetch: bool) -> None:
        self.layer = layer
        self.expert = expert
        self.prefetch = prefetch  # issued on a prediction and not (yet) needed
        self.fetches: list = []  # per tensor: a _Fetch, or None when whole in the cache
        self.states: list = []
        self.remaining = 0  # fetches submitted and not yet reported
        self.reserved = 0
        self.errors: list = []
        self.dropped = False
        self.released = False


PREFETCH_RANK = 1 << 40  # added to a prefetch's ranks: after every demand job in the queues


class _Latch:
    """Counts down the jobs of one split tensor; the last one learns the first error."""

    __slots__ = ("n", "exc", "lock")

    def __init__(self, n: int) -> None:
        self.n = n
        self.exc = None
        self.lock = threading.Lock()

    def count_down(self, exc) -> tuple[bool, BaseException | None]:
        with self.lock:
            if exc is not None and self.exc is None:
                self.exc = exc
            self.n -= 1
            return self.n == 0, self.exc


class LayerScheduler:
    def __init__(self, runtime, workers: int) -> None:
        self.rt = runtime
        self.workers = max(1, int(workers))
        self._q: queue.Queue = queue.Queue()  # (fetch, exc) of every finished fetch
        self._slots = 0  # window slots held: groups issued and not yet released
        self._unreported = 0  # fetches submitted whose report has not been handled
        self._pf: dict = {}  # (layer, expert) -> prefetched _Group not yet needed
        self._pf_pending: deque = deque()  # predicted experts waiting for a window slot
        self._predicted: dict = {}  # layer -> experts predicted for it (precision / recall)
        self.readers = max(1, int(getattr(runtime, "readers", 1)))
        self.io = PriorityWorkers(self.readers, "zipmoe-io", on_error=self._job_failed)
        self.pool = PriorityWorkers(self.workers, "zipmoe-decode", on_error=self._job_failed)
        self._local = threading.local()
        self.device = runtime.device
        self.cuda = self.device.type == "cuda"
        self.device_merge = False
        if self.cuda:
            try:
                from zipmoe import kernels

                self.device_merge = bool(getattr(kernels, "triton_available", lambda: False)()) and hasattr(kernels, "merge")
            except Exception:  # pragma: no cover - depends on the install
                self.device_merge = False

    def close(self) -> None:
        self.io.shutdown()
        self.pool.shutdown()

    # ------------------------------------------------------------------ worker side
    @staticmethod
    def _job_failed(fn, args, exc) -> None:
        """A queued job raised outside its own error handling: report it to its fetch's layer."""
        f = args[0] if args and isinstance(args[0], _Fetch) else None
        if f is None or f.done is None:
            raise exc
        f.report(exc)

    def _ctx(self):
        ctx = getattr(self._local, "ctx", None)
        if ctx is None:
            from zipmoe.codecs.exponent import DecodeContext

            ctx = self._local.ctx = DecodeContext()
        return ctx

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

    # ------------------------------------------------------------------ serving side
    def run(self, layer, experts: list, compute, predict=None) -> None:
        """Make the weights of ``experts`` (ascending ids) whole and call ``compute(e, weights)``.

        ``predict``: None, or a callable returning ``(next layer, experts it will probably
        choose)``: those are prefetched (module :mod:`.prefetch`) once this layer's own fetches
        are all issued, at a lower priority."""
        rt = self.rt
        cache = rt.cache
        tensors = {e: rt.expert_tensors[(layer, e)] for e in experts}
        states = {}
        for e in experts:
            st = []
            for t in tensors[e]:
                cache.touch(t.uid)
                s = cache.state_of(t.uid)
                rt.counters.add_hit(s)
                st.append(s)
                cache.pinned.add(t.uid)
            states[e] = st
        guess = self._predicted.pop(layer, None)
        if guess is not None:
            rt.counters.add_prediction(layer, guess, experts)
        try:
            if predict is None and not self._pf and not self._pf_pending and \
                    all(expert_type(states[e]) == "full" for e in experts):
                # everything whole (the common case with a large budget): no pipeline at all
                counters = rt.counters
                t0 = time.perf_counter()
                for e in experts:
                    compute(e, [cache.get(t.uid) for t in tensors[e]])
                counters.add_time("compute", time.perf_counter() - t0)
            else:
                self._run(layer, experts, tensors, states, compute, predict)
        finally:
            cache.pinned.clear()

    # --- fetch groups (one expert's fetches), shared by demand and prefetch
    def _put(self, f, exc) -> None:
        self._q.put((f, exc))

    def _issue(self, layer, e, tens, sts, rank: dict, prefetch: bool, into: dict, key) -> _Group:
        """Take the working bytes of expert ``e``'s fetches and submit them (one group, one
        window slot). The group is in ``into[key]`` before it holds anything, so that an
        interruption while it is queued still finds (and releases) it."""
        rt = self.rt
        cache = rt.cache
        g = _Group(layer, e, prefetch)
        g.states = list(sts)
        need = 0
        for t, st in zip(tens, sts):
            if st == "full":
                g.fetches.append(None)
                continue
            f = _Fetch(t, st)
            f.group = g
            if st in ("compressed", "sm_only"):
                data = cache.get(t.uid)
                if st == "compressed":
                    f.e_parts, f.sm_parts = data
                else:
                    f.sm_parts = data
            elif st == "e_only":
                f.e_parts = cache.get(t.uid)
            need += rt.working_bytes(t)
            if any(_reads_of(st)):
                # what it reads, and its read buffers, taken now (idle ones first) so that
                # the hold below counts them as this fetch's and not as idle
                store = rt.store
                f.ranges = t.ranges(*_reads_of(st))
                f.bufs = [store.buffers.get(store.buffer_size(off, ln)) for off, ln in f.ranges]
            f.done = self._put
            g.fetches.append(f)
        into[key] = g
        rt.hold(need)
        g.reserved = need
        self._slots += 1
        for f in g.fetches:
            if f is None:
                continue
            t = f.tensor
            f.out = torch.empty(t.shape, dtype=torch.bfloat16, device=rt.device)
            if self.cuda:
                pin = self.device.type == "cuda"  # (False only when a test forces this path on the CPU)
                if self.device_merge:
                    f.pinned = (torch.empty(t.numel, dtype=torch.uint8, pin_memory=pin),
                                torch.empty(t.numel, dtype=torch.uint8, pin_memory=pin))
                    f.exp_host = f.pinned[0].numpy()
                    f.sm_host = f.pinned[1].numpy()
                else:
                    f.host = torch.empty(t.shape, dtype=torch.bfloat16, pin_memory=pin)
        for f in g.fetches:
            if f is None:
                continue
            r = rank[f.tensor.uid] + (PREFETCH_RANK if prefetch else 0)
            if f.state == "compressed":
                self._submit_decode(f, r, False, False, self._put)
            else:
                self.io.submit(r, self._read_then_decode, f, self._put, r)
            g.remaining += 1  # only once submitted: its report will come
            self._unreported += 1
        return g

    def _report(self, f, exc, ready: deque) -> None:
        """One fetch finished: count it in its group; a group whose fetches all finished is
        ready (demand), kept (a prefetch not yet needed) or released (a dropped prefetch)."""
        self._unreported -= 1
        g = f.group
        g.remaining -= 1
        if exc is not None and not isinstance(exc, _Cancelled):
            g.errors.append(exc)
        if g.remaining:
            return
        if g.dropped:
            if g.errors:
                self.rt.counters.add_prefetch("failed")
            self._release(g)
        elif not g.prefetch:
            ready.append(g)

    def _release(self, g: _Group) -> None:
        """Give back a finished group's bytes, read buffers and window slot."""
        if g.released:
            return
        g.released = True
        self.rt.release(g.reserved)
        self._slots -= 1
        bufs = [b for f in g.fetches if f is not None for b in f.bufs]
        if bufs and not g.remaining:
            self.rt.recycle(bufs)
        for f in g.fetches:
            if f is not None:
                f.bufs = []

    def _drop(self, g: _Group) -> None:
        """A prefetched expert that will not be used: cancel what has not started; release it
        once every job that did start has finished (never while a thread writes into it)."""
        g.dropped = True
        self.rt.counters.add_prefetch("dropped")
        for f in g.fetches:
            if f is not None:
                f.cancelled = True
        if not g.remaining:
            if g.errors:
                self.rt.counters.add_prefetch("failed")
            self._release(g)

    def _drain(self, ready: deque) -> bool:
        """Wait for every submitted fetch; False when a thread is gone (its fetches will never
        report)."""
        while self._unreported:
            try:
                f, exc = self._wait(self._q)
            except ServingError:
                return False
            self._report(f, exc, ready)
        return True

    def _run(self, layer, experts, tensors, states, compute, predict=None) -> None:
        rt = self.rt
        cache = rt.cache
        counters = rt.counters
        W = rt.window
        # prefetched groups: those for this layer's chosen experts are adopted (used as if
        # fetched now, provided the tensors they left to the cache are still whole there);
        # every other one is dropped
        adopted = {}
        for key in list(self._pf):
            g = self._pf.pop(key)
            e = key[1]
            if key[0] == layer and e in states and all(
                    f is not None or st == "full" for f, st in zip(g.fetches, states[e])):
                adopted[e] = g
                g.prefetch = False
                counters.add_prefetch("used")
            else:
                self._drop(g)
        self._pf_pending.clear()
        todo = [e for e in experts if e not in adopted]
        need, rank = issue_order(todo, states, tensors)
        order = deque(need)
        groups: dict[int, _Group] = dict(adopted)
        ready: deque = deque(g for g in adopted.values() if not g.remaining)
        active = len(adopted)  # groups of this layer not yet computed
        errors: list = []

        def weights_of(e):
            g = groups.get(e)
            fl = g.fetches if g is not None else [None] * len(tensors[e])
            return [cache.get(t.uid) if f is None else f.w for t, f in zip(tensors[e], fl)]

        def fill():
            nonlocal active
            while order and self._slots < W and not errors:
                e = order.popleft()
                self._issue(layer, e, tensors[e], states[e], rank, False, groups, e)
                active += 1
            if not order and not errors:
                self._prefetch_fill()

        try:
            fill()
            if predict is not None:
                nxt, guess = predict()
                if nxt is not None:
                    self._predicted[nxt] = list(guess)
                    self._plan_prefetch(nxt, guess)
                    fill()
            # experts whose weights are all whole compute first, while the pipeline loads the rest
            for e in experts:
                if e not in groups and expert_type(states[e]) == "full":
                    t0 = time.perf_counter()
                    compute(e, weights_of(e))
                    counters.add_time("compute", time.perf_counter() - t0)
            while active or (order and not errors):
                if not ready:
                    t0 = time.perf_counter()
                    f, exc = self._wait(self._q)
                    counters.add_time("wait", time.perf_counter() - t0)
                    self._report(f, exc, ready)
                    if not ready:
                        fill()  # a dropped prefetch may have freed a slot
                        continue
                g = ready.popleft()
                active -= 1
                e = g.expert
                if g.errors:
                    errors.extend(g.errors)
                if not errors:
                    fl = g.fetches
                    if self.cuda:
                        self._to_device(fl)
                    self._finish(fl)
                    t0 = time.perf_counter()
                    compute(e, weights_of(e))
                    t1 = time.perf_counter()
                    counters.add_time("compute", t1 - t0)
                    self._admit(fl)
                    counters.add_time("admit", time.perf_counter() - t1)
                self._release(g)
                fill()
            if not self._pf and not self._pf_pending:
                # nothing prefetched for the next layer (the last sparse layer, or prefetch
                # off): wait for the dropped prefetches still running, so that nothing is held
                # between forward steps
                self._drain(ready)
        except BaseException:
            # Ctrl-C (or an error in compute), wherever it lands in the layer (also while the
            # window fills or a fully cached expert computes): let every submitted fetch finish,
            # so that no thread writes into buffers we drop and the byte accounting stays exact.
            # Only fetches whose submission completed are waited for: one interrupted while it
            # was being queued may never report, and waiting for it would hang.
            self._abandon(groups)
            raise
        if errors:
            self._abandon(groups)
            exc = errors[0]
            if isinstance(exc, ContainerError):
                counters.checksum_failures += 1
                raise type(exc)(str(exc)) from None
            if isinstance(exc, (ZipmoeError, KeyboardInterrupt)):
                raise exc
            # a bug or an OS failure in a reader or decode job: one line naming the layer
            raise ServingError(f"fetching the experts of layer {layer} failed: {_one_line(exc)}") from exc

    def _wait(self, done_q: queue.Queue, poll: float = 0.5):
        """The next finished fetch; while none comes, check every ``poll`` seconds that the
        reader and decode threads are alive and no job failed unreported (ServingError)."""
        while True:
            try:
                return done_q.get(timeout=poll)
            except queue.Empty:
                self.io.check()
                self.pool.check()

    def _abandon(self, groups: dict) -> None:
        """After an error: drop every prefetch, wait for every fetch, give back every byte."""
        dropped = []
        for key in list(self._pf):
            g = self._pf.pop(key)
            dropped.append(g)
            self._drop(g)
        self._pf_pending.clear()
        self._predicted.clear()
        for g in groups.values():
            for f in g.fetches:
                if f is not None:
                    f.cancelled = True
        ready: deque = deque()
        complete = self._drain(ready)
        for g in list(groups.values()) + dropped:
            if complete or g.remaining:
                # (a thread is gone: what it held will not come back; give its bytes back)
                self._release(g)
        if not complete:
            self._unreported = 0
    # --- prefetch
    def _plan_prefetch(self, layer, guess) -> None:
        """Queue the predicted experts of ``layer`` that are not whole in the cache (issued by
        :meth:`_prefetch_fill` as window slots free up, after the current layer's own fetches)."""
        rt = self.rt
        cache = rt.cache
        want, sts = [], {}
        for e in guess:
            tens = rt.expert_tensors.get((layer, e))
            if tens is None or (layer, e) in self._pf:
                continue
            st = [cache.state_of(t.uid) for t in tens]
            if expert_type(st) == "full":
                continue
            want.append(e)
            sts[e] = st
        if not want:
            return
        tens = {e: rt.expert_tensors[(layer, e)] for e in want}
        order, rank = issue_order(want, sts, tens)
        for e in order:
            self._pf_pending.append((layer, e, tens[e], sts[e], rank))

    def _prefetch_fill(self) -> None:
        W = self.rt.window
        cache = self.rt.cache
        while self._pf_pending and self._slots < W:
            layer, e, tens, sts, rank = self._pf_pending.popleft()
            # the state may have changed since the guess (the current layer admits): re-read it
            now = [cache.state_of(t.uid) for t in tens]
            if now != sts:
                if expert_type(now) == "full":
                    continue
                sts = now
                rank = issue_order([e], {e: now}, {e: tens})[1]
            self._issue(layer, e, tens, sts, rank, True, self._pf, (layer, e))
            self.rt.counters.add_prefetch("issued")

    def _to_device(self, fl) -> None:
        for f in fl:
            if f is None:
                continue
            t0 = time.perf_counter()
            if self.device_merge:
                from zipmoe import kernels

                # copy from the pinned torch tensors themselves (not numpy views) so that the
                # host allocator keeps them alive until the asynchronous copies are done
                exp_d = f.pinned[0].to(self.device, non_blocking=True)
                sm_d = f.pinned[1].to(self.device, non_blocking=True)
                kernels.merge(exp_d, sm_d, f.out.view(-1))
                f.pinned = f.exp_host = f.sm_host = None
                self.rt.counters.add_time("merge", time.perf_counter() - t0)
            else:
                f.out.copy_(f.host, non_blocking=False)
                f.host = None

    def _finish(self, fl) -> None:
        """The weights the expert computes with: the merged bf16 tensor, or its conversion
        (exact) when the model computes in float32."""
        dtype = self.rt.compute_dtype
        for f in fl:
            if f is not None:
                f.w = f.out if f.out.dtype == dtype else f.out.to(dtype)
                if f.w is not f.out:
                    f.out = None

    def _admit(self, fl) -> None:
        cache = self.rt.cache
        for f in fl:
            if f is None:
                continue
            t = f.tensor
            forms = {"full": (t.compute_bytes, f.w)}
            if f.e_parts is not None and f.sm_parts is not None:
                e_parts, sm_parts = f.e_parts, f.sm_parts
                forms["compressed"] = (t.e_bytes + t.sm_bytes, lambda e=e_parts, s=sm_parts: (_own(e), _own(s)))
            if f.sm_parts is not None:
                forms["sm_only"] = (t.sm_bytes, lambda s=f.sm_parts: _own(s))
            if f.e_parts is not None:
                forms["e_only"] = (t.e_bytes, lambda e=f.e_parts: _own(e))
            cache.offer(t.uid, forms)
            f.out = f.w = None


def demote(pool_name: str, data):
    """What an expert tensor evicted from ``pool_name`` keeps, for the cache's cascade: the
    compressed pool's data is ``(E parts, SM parts)`` (``_admit``), each of which is the data of
    the E-only and SM-only pools. The other pools' data keeps nothing a lower pool holds."""
    if pool_name != "compressed":
        return None
    e_parts, sm_parts = data
    return {"sm_only": (sum(p.nbytes for p in sm_parts), sm_parts), "e_only": (sum(p.nbytes for p in e_parts), e_parts)}


def _own(parts: list) -> list:
    """Exact-size copies (read buffers are views into larger aligned buffers)."""
    out = []
    for p in parts:
        if isinstance(p, np.ndarray) and p.base is None and p.flags.owndata:
            out.append(p)
        else:
            out.append(np.array(p, dtype=np.uint8, copy=True))
    return out

