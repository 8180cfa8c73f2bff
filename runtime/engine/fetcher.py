"""Per sparse layer: fetch the chosen experts' weights and compute them while the rest load.

:class:`Fetcher` is the serving thread's side of the pipeline. It owns three stages, each an
object built with what it needs (docs/architecture.md, "The decode path"):

* a :class:`~zipmoe.runtime.engine.reader.Reader` (the reader threads and the store),
* a :class:`~zipmoe.runtime.engine.decoder.Decoder` (the decode workers),
* a :class:`~zipmoe.runtime.engine.device_side.DeviceSide` (where tensors land, staging and
  copies to the device, the compute dtype, the forms offered to the cache),

and works with the cache (:class:`~zipmoe.runtime.engine.cache.ExpertCache`: ``touch``,
``state_of``, ``get``, ``pin``/``unpin_all``, ``offer``: placement and admission), the
:class:`~zipmoe.runtime.engine.working.WorkingSet` (the window and the bytes in flight) and the
counters. It reaches into nothing else.

Once the router of a layer has chosen, :meth:`Fetcher.run` gets the chosen experts (in
ascending id, the eager order) and a ``compute(expert, weights)`` callback. Each chosen
expert tensor's state in the cache decides its task graph (runtime/engine/order.py):

========== ======================================== ========
state      tasks                                    type
========== ======================================== ========
full       compute                                  –
compressed decompress E, merge, compute             II
sm_only    read E, decompress E, merge, compute     II
e_only     read SM, decompress E, merge, compute    I
none       read SM+E, decompress E, merge, compute  I
========== ======================================== ========

Order: the list schedule of :func:`zipmoe.runtime.engine.order.order`, the one the planner
simulates: the readers and the workers each take the queued job that comes first in it
(priority queues, not FIFO), i.e. Type I before Type II. So the disk starts with Type-I reads
and stays busy while the workers fill with Type-II decompressions, which need no read. An
expert computes as soon as all its tensors are whole (fully cached experts first, then in
completion order), while the others load. The number of experts in flight is bounded by the
*window* the budget leaves room for (their working bytes are counted in the budget); experts
enter it by their first task's rank.

Bit-identity: experts are computed in whatever order they become ready, but their outputs are
accumulated by the caller in ascending expert order, as transformers' eager loop does; the
per-expert products do not depend on when they were computed.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque

from zipmoe.errors import ContainerError, ServingError, ZipmoeError

from zipmoe.runtime.engine.adopt import Adopter
from zipmoe.runtime.engine.fetch import (PREFETCH_RANK, _Cancelled, _Fetch, _Group, _Latch, _reads_of, expert_type,
                                         issue_order)
from zipmoe.runtime.engine.workers import PriorityWorkers, _one_line

__all__ = ["Fetcher"]


class Fetcher:
    def __init__(self, *, expert_tensors: dict, cache, counters, working, reader, decoder, device) -> None:
        self.expert_tensors = expert_tensors  # {(layer, expert): [ExpertTensor]}
        # the compressed pool keeps the read buffers themselves (engine/adopt.py)
        self.adopter = Adopter(reader.store, working)
        self.cache = cache
        self.counters = counters
        self.working = working
        self.reader = reader
        self.decoder = decoder
        self.device = device
        self._q: queue.Queue = queue.Queue()  # (fetch, exc) of every finished fetch
        self._slots = 0  # window slots held: groups issued and not yet released
        self._unreported = 0  # fetches submitted whose report has not been handled
        self._pf: dict = {}  # (layer, expert) -> prefetched _Group not yet needed
        self._pf_pending: deque = deque()  # predicted experts waiting for a window slot
        self._predicted: dict = {}  # layer -> experts predicted for it (precision / recall)
        self._stager = None  # staged: the one thread that queues finished groups' copies (_put_staged)
        self._stager_lock = threading.Lock()

    @property
    def cache(self):
        return self._cache

    @cache.setter
    def cache(self, cache) -> None:
        self._cache = cache
        self.adopter.attach(cache)

    def close(self) -> None:
        self.reader.close()
        self.decoder.close()
        if self._stager is not None:
            self._stager.shutdown()

    # ------------------------------------------------------------------ the layer's lookup
    def lookup(self, layer, experts: list, pin: bool = True) -> tuple[dict, dict]:
        """Every chosen tensor used once: its count and hit state counted, pinned for the layer
        (``pin``); the prediction made for this layer scored. Returns ``(tensors, states)``."""
        cache, counters = self.cache, self.counters
        touch, state_of, add_hit = cache.touch, cache.state_of, counters.add_hit
        tensors = {e: self.expert_tensors[(layer, e)] for e in experts}
        states = {}
        for e in experts:
            st = []
            for t in tensors[e]:
                touch(t.uid)
                s = state_of(t.uid)
                add_hit(s)
                st.append(s)
                if pin:
                    cache.pin(t.uid)
            states[e] = st
        self._score_prediction(layer, experts)
        return tensors, states

    def account_resident(self, layer, experts: list) -> None:
        """A layer computed elsewhere (a CUDA graph) from tensors resident in the full pool: the
        uses, hits and prediction score :meth:`lookup` counts (nothing is fetched or admitted,
        so nothing is pinned)."""
        touch = self.cache.touch
        n = 0
        for e in experts:
            for t in self.expert_tensors[(layer, e)]:
                touch(t.uid)
                n += 1
        self.counters.add_hit("full", n)
        self._score_prediction(layer, experts)

    def _score_prediction(self, layer, experts: list) -> None:
        if self._predicted:
            guess = self._predicted.pop(layer, None)
            if guess is not None:
                self.counters.add_prediction(layer, guess, experts)

    def run(self, layer, experts: list, compute, predict=None) -> None:
        """Make the weights of ``experts`` (ascending ids) whole and call ``compute(e, weights)``.

        ``predict``: None, or a callable returning ``(next layer, experts it will probably
        choose)``: those are prefetched (module :mod:`.prefetch`) once this layer's own fetches
        are all issued, at a lower priority."""
        cache = self.cache
        ts = self.counters.time_s
        start = time.perf_counter()
        busy = ts["compute"] + ts["wait"] + ts["predict"]  # (only this thread adds to these three)
        try:
            tensors, states = self.lookup(layer, experts)
            self.counters.host_parts["lookup"] += time.perf_counter() - start
            if predict is None and not self._pf and not self._pf_pending and \
                    all(expert_type(states[e]) == "full" for e in experts):
                # everything whole (the common case with a large budget): no pipeline at all
                t0 = time.perf_counter()
                for e in experts:
                    compute(e, [cache.get(t.uid) for t in tensors[e]])
                self.counters.add_time("compute", time.perf_counter() - t0)
            else:
                self._run(layer, experts, tensors, states, compute, predict)
        finally:
            cache.unpin_all()
            # the serving thread's own work in this layer: all of it but compute, waits (for the
            # layer's fetches, and for dropped prefetches at the end of a step) and the predictor's
            # forward (the next layer's router on the GPU, read back to the host)
            self.counters.add_time("host", max(0.0, time.perf_counter() - start -
                                               (ts["compute"] + ts["wait"] + ts["predict"] - busy)))

    def fetch_whole(self, layer, expert) -> list:
        """The compute tensors of one expert, made whole through the pipeline without counting a
        use or offering them to the cache (the runtime's warm start puts them in the full pool)."""
        tensors = {expert: self.expert_tensors[(layer, expert)]}
        states = {expert: [self.cache.state_of(t.uid) for t in tensors[expert]]}
        out = {}
        parts = dict(self.counters.host_parts)
        try:
            self._run(layer, [expert], tensors, states, lambda e, w: out.setdefault(e, w), None, admit=False)
        finally:
            # the warm start is not serving: like ``host``, which only ``run`` adds to, its parts stay as they were
            self.counters.host_parts.update(parts)
        return out[expert]

    # --- fetch groups (one expert's fetches), shared by demand and prefetch
    def _put(self, f, exc) -> None:
        self._q.put((f, exc))

    def _put_staged(self, f, exc) -> None:
        """A fetch of a staged group finished (on the reader or decode thread that finished it).
        The group's last fetch hands the group to the stager thread, which queues its copy to
        the device (and the device merge) as soon as the bytes are whole, and only then reports
        that fetch: the serving thread spends nothing on the copy, and a group it sees finished
        is staged (docs/runtime.md, "Host work per fetched tensor"). One thread makes every
        copy-stream call: the reader and decode threads that used to stage a group themselves
        contended for the CUDA driver and the stream's lock, 0.3-0.6 ms of their time per fetched
        tensor on an H100 (docs/benchmarks.md §22n). A failed stage is that fetch's error."""
        g = f.group
        last, first = g.latch.count_down(exc)
        if last and first is None:
            try:
                self._stager_pool().submit(PREFETCH_RANK if g.prefetch else 0, self._stage_and_report, f)
                return
            except BaseException as e:  # noqa: BLE001 - handed to the serving thread
                exc = e
        self._q.put((f, exc))

    def _stager_pool(self) -> PriorityWorkers:
        st = self._stager
        if st is None:
            with self._stager_lock:
                st = self._stager
                if st is None:
                    st = self._stager = PriorityWorkers(1, "zipmoe-stage")
        return st

    def _stage_and_report(self, f) -> None:
        """(the stager thread) Stage ``f``'s group, then report ``f``, its last fetch."""
        exc = None
        try:
            self._stage_done(f.group)
        except BaseException as e:  # noqa: BLE001 - handed to the serving thread
            exc = e
        self._q.put((f, exc))

    def _stage_done(self, g: _Group) -> None:
        """Stage a group whose fetches all finished without error, unless it was dropped or
        cancelled meanwhile (then nothing reads it: its slot goes back when it is released)."""
        if not g.dropped and not any(x is not None and x.cancelled for x in g.fetches):
            self.device.stage(g)

    def _decode_next(self, f, rank, need_e: bool, need_sm: bool) -> None:
        """A fetch's reads are in: queue its decode (every chunk read is verified before use)."""
        self.decoder.submit(f, rank, need_e, need_sm)

    def _issue(self, layer, e, tens, sts, rank: dict, prefetch: bool, into: dict, key) -> _Group:
        """Take the working bytes of expert ``e``'s fetches and submit them (one group, one
        window slot). The group is in ``into[key]`` before it holds anything, so that an
        interruption while it is queued still finds (and releases) it."""
        t_issue = time.perf_counter()
        cache = self.cache
        staged = self.device.staged
        done = self._put_staged if staged else self._put
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
                    self.adopter.borrow(t.uid)  # until the group is released: its buffers stay
                else:
                    f.sm_parts = data
            elif st == "e_only":
                f.e_parts = cache.get(t.uid)
            if any(_reads_of(st)):
                self.reader.prepare(f)
            need += self.working.bytes_of(t, f.bufs)
            f.done = done
            g.fetches.append(f)
        into[key] = g
        fl = [f for f in g.fetches if f is not None]
        need += self.device.group_bytes(g, fl)
        self.working.hold(need)
        g.reserved = need
        self._slots += 1
        self.device.place(g, fl)
        if staged:
            g.latch = _Latch(len(fl) + 1)  # + this issue: no fetch stages the group before all are queued
        for f in fl:
            r = rank[f.tensor.uid] + (PREFETCH_RANK if prefetch else 0)
            if f.state == "compressed":
                self.decoder.submit(f, r, False, False)
            else:
                self.reader.submit(r, f, self._decode_next)
            g.remaining += 1  # only once submitted: its report will come
            self._unreported += 1
        if staged:
            last, first = g.latch.count_down(None)
            if last and first is None:  # every fetch finished while the others were queued
                self._stage_done(g)
        self.counters.host_parts["issue"] += time.perf_counter() - t_issue
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
        if self.device.staged and not g.errors:
            self._stage_done(g)  # (staged already by the stager, or by the issue: then nothing to do)
        if g.dropped:
            if g.errors:
                self.counters.add_prefetch("failed")
            self._release(g)
        elif not g.prefetch:
            ready.append(g)

    def _release(self, g: _Group) -> None:
        """Give back a finished group's bytes, read buffers and window slot."""
        if g.released:
            return
        g.released = True
        self.device.release(g)
        self.working.release(g.reserved)
        self._slots -= 1
        bufs = [b for f in g.fetches if f is not None for b in f.bufs]
        if bufs and not g.remaining:
            self.working.recycle(bufs)
        if not g.remaining:  # (a thread that is gone may still read: its borrows stay)
            for f in g.fetches:
                if f is not None and f.state == "compressed":
                    self.adopter.give_back(f.tensor.uid)
        for f in g.fetches:
            if f is not None:
                f.bufs = []
                if not g.remaining:
                    # A fetch and its group refer to each other: left so, the pair (and the
                    # views below, which keep read buffers and staging memory alive) is freed
                    # only by Python's cyclic collector, whose oldest generation runs rarely in
                    # a process holding a model. A read buffer the working set had dropped then
                    # stayed mapped for hundreds of tokens: host memory the budget no longer
                    # counted (docs/benchmarks.md §22l). Every thread is done with them here.
                    f.group = None
                    f.e_parts = f.sm_parts = f.host = f.exp_host = f.sm_host = None

    def _drop(self, g: _Group) -> None:
        """A prefetched expert that will not be used: cancel what has not started; release it
        once every job that did start has finished (never while a thread writes into it)."""
        g.dropped = True
        self.counters.add_prefetch("dropped")
        for f in g.fetches:
            if f is not None:
                f.cancelled = True
        if not g.remaining:
            if g.errors:
                self.counters.add_prefetch("failed")
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

    def _admit(self, fetches) -> None:
        """Offer a computed expert's tensors to the cache, in the forms the device side made."""
        cache = self.cache
        forms = self.device.forms
        pools = cache.open_pools
        adopter = self.adopter
        with adopter:  # what the pools let go here is given back after the cascade copied it
            for f in fetches:
                if f is None:
                    continue
                fm = forms(f, pools)
                if f.bufs and "compressed" in fm and adopter.enabled:
                    fm["compressed"] = adopter.form(f)  # its read buffers, not a copy
                cache.offer(f.tensor.uid, fm)
                f.out = f.w = None

    def _run(self, layer, experts, tensors, states, compute, predict=None, admit: bool = True) -> None:
        cache = self.cache
        counters = self.counters
        parts = counters.host_parts
        clock = time.perf_counter
        device = self.device
        cstream = None  # the compute stream, asked for at the first group that reaches the device
        W = self.working.window
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
                t0 = time.perf_counter()
                nxt, guess = predict()
                counters.add_time("predict", time.perf_counter() - t0)
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
                    t0 = clock()
                    f, exc = self._wait(self._q)
                    t1 = clock()
                    counters.add_time("wait", t1 - t0)
                    self._report(f, exc, ready)
                    parts["report"] += clock() - t1
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
                    t0 = clock()
                    if cstream is None:
                        cstream = device.compute_stream()
                    device.to_device(g, cstream)
                    device.finish(fl)
                    t1 = clock()
                    parts["to_device"] += t1 - t0
                    compute(e, weights_of(e))
                    t0 = clock()
                    counters.add_time("compute", t0 - t1)
                    if admit:
                        self._admit(fl)
                        counters.add_time("admit", clock() - t0)
                t0 = clock()
                self._release(g)
                parts["release"] += clock() - t0
                fill()
            if not self._pf and not self._pf_pending:
                # nothing prefetched for the next layer (the last sparse layer, or prefetch
                # off): wait for the dropped prefetches still running, so that nothing is held
                # between forward steps
                t0 = time.perf_counter()
                self._drain(ready)
                counters.add_time("wait", time.perf_counter() - t0)
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
                self.reader.check()
                self.decoder.check()
                if self._stager is not None:
                    self._stager.check()

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
        cache = self.cache
        want, sts = [], {}
        for e in guess:
            tens = self.expert_tensors.get((layer, e))
            if tens is None or (layer, e) in self._pf:
                continue
            st = [cache.state_of(t.uid) for t in tens]
            if expert_type(st) == "full":
                continue
            want.append(e)
            sts[e] = st
        if not want:
            return
        tens = {e: self.expert_tensors[(layer, e)] for e in want}
        order, rank = issue_order(want, sts, tens)
        for e in order:
            self._pf_pending.append((layer, e, tens[e], sts[e], rank))

    def _prefetch_fill(self) -> None:
        W = self.working.window
        cache = self.cache
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
            self.counters.add_prefetch("issued")
