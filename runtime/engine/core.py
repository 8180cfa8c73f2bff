"""The runtime object behind a loaded model (``model.zipmoe``): budget, pools, pipeline, counters.

Budget accounting (bytes; "weights held by the runtime"):

    budget >= dense + working + sum(pool capacities)

* ``dense``: every non-expert parameter and buffer loaded from the container, as resident
  tensors (tied weights once).
* ``working``: what fetching experts needs at most at once: ``window`` experts in flight, each
  its bf16 compute tensors plus the aligned read buffers of its chunks, plus one decode scratch
  buffer per worker. ``window`` is ``workers + 2`` experts when the budget allows, fewer (down
  to 1) when it does not. Read buffers are reused (``store.ReadBuffers``); idle ones count in
  ``held_bytes`` and are dropped so that idle + in flight stays within the window's share.
* the pools: what is left, split by the plan (``plan["pools"]``) or by the default split.

The smallest budget accepted is ``dense + working(window=1)``; below it :class:`BudgetError`
says that number. ``held_bytes()`` is the live sum (dense + pool bytes in use + in-flight
working bytes) and ``counters.peak_held_bytes`` its maximum: tests check it never exceeds the
budget.

Default split (no plan): when every expert fits as full bf16 tensors, everything goes to the
``full`` pool; otherwise 60% ``full`` and 40% ``compressed`` (a compressed expert costs about
2/3 of a full one and a decompression instead of a read). ``zipmoe plan`` computes better
splits from traces and measured costs.

On CUDA the full pool lives in GPU memory and the other pools in host memory; the budget counts
both, and counts device tensors as torch's caching allocator rounds them (512 bytes, 2 MiB above
10 MiB: :func:`zipmoe.runtime.engine.staging.cuda_block_bytes`). Every copy to the device goes
through the pinned staging ring (``window`` slots of the largest expert's staged bytes, page
rounded, counted whole); the host pools stay pageable (their bytes are copied into the ring by
the decode workers, which pass over them anyway), so pinning them would buy nothing.
:meth:`Runtime.memory` puts the counted figure beside the allocator's own.
"""

from __future__ import annotations

import contextlib
import json
import time
import weakref
from pathlib import Path

import torch

from zipmoe.errors import BudgetError, ModelError, UsageError
from zipmoe.units import format_size

from zipmoe.runtime.engine.cache import POOLS, ExpertCache, aging_period
from zipmoe.runtime.engine.counters import Counters
from zipmoe.runtime.engine.decoder import Decoder
from zipmoe.runtime.engine.device_side import DeviceSide, demote
from zipmoe.runtime.engine.fetcher import Fetcher
from zipmoe.runtime.engine.reader import Reader
from zipmoe.runtime.engine.reads import ExpertStore
from zipmoe.runtime.engine.settings import EngineSettings
from zipmoe.runtime.engine.trace import TraceWriter
from zipmoe.runtime.engine.working import WorkingSet, working_bytes_of

__all__ = ["Runtime", "read_plan", "DEFAULT_SPLIT", "working_bytes_of"]

DEFAULT_SPLIT = {"full": 0.6, "compressed": 0.4, "sm_only": 0.0, "e_only": 0.0}


def read_plan(plan, container_id: str) -> dict:
    """``plan`` is a path or a dict; returns ``{"pools": {...bytes}}`` checked against the container."""
    if isinstance(plan, (str, Path)):
        p = Path(plan)
        if not p.is_file():
            raise UsageError(f"plan file {p} does not exist (make one with `zipmoe plan FILE.zmoe --budget SIZE -o {p}`)")
        try:
            plan = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise UsageError(f"plan file {p} is not valid JSON: {exc}") from None
    if not isinstance(plan, dict) or not isinstance(plan.get("pools"), dict):
        raise UsageError("plan has no \"pools\" object ({\"full\": bytes, \"compressed\": ..., \"sm_only\": ..., \"e_only\": ...})")
    cid = plan.get("container_id")
    if cid != container_id:
        raise ModelError(f"the plan was made for another model (container {cid}, this one is {container_id}); run `zipmoe plan` on this file")
    pools = {}
    for name in POOLS:
        v = plan["pools"].get(name, 0)
        if isinstance(v, dict):  # tolerate {"bytes": n, "slots": k}
            v = v.get("bytes", 0)
        if not isinstance(v, (int, float)) or v < 0:
            raise UsageError(f"plan pool {name!r} must be a byte count, got {v!r}")
        pools[name] = int(v)
    return {"pools": pools, "raw": plan}


def plan_dtype_note(raw: dict, compute_dtype) -> str | None:
    """One line when a plan was made for experts of another dtype than the runtime computes in
    (``zipmoe plan --dtype``): its pool bytes then hold another number of experts than it
    counted on (float32 experts take twice bfloat16's bytes). None when they agree or the plan
    does not say (a hand-written plan)."""
    made = raw.get("dtype") if isinstance(raw, dict) else None
    now = str(compute_dtype).replace("torch.", "")
    if not isinstance(made, str) or made == now:
        return None
    return (f"the plan was made for {made} experts and this model computes in {now}: its pools hold "
            f"another number of experts than it counted on (make it with `zipmoe plan --dtype {now}`, "
            f"or load with --dtype {made})")


def _sizes(expert_tensors: dict, workers: int, cuda: bool = False) -> tuple[int, int, int]:
    """``(expert_working, scratch, staging slot bytes)``.

    ``expert_working``: what one expert in flight holds at most. On the CPU: its tensors'
    :func:`working_bytes_of`. On CUDA (engine/staging.py) the bf16 merge buffers are one device
    buffer per expert, counted as the CUDA allocator rounds it, plus the expert's slot in the
    pinned staging ring. ``scratch``: the workers' decode scratch and, on CUDA, the one device
    buffer the staged bytes land in before the device merge (allocator-rounded) and the ring's
    page rounding."""
    from zipmoe.runtime.engine.staging import PAGE, CopyStream, cuda_block_bytes

    inflight, slot = [0], 0
    for ts in expert_tensors.values():
        w = sum(working_bytes_of(t) for t in ts)
        n = CopyStream.layout(ts)[1]
        slot = max(slot, 2 * n)  # (also on the CPU: a test may force the CUDA paths there)
        if cuda:
            w += cuda_block_bytes(2 * n) - sum(t.full_bytes for t in ts)
        inflight.append(w)
    max_seg = max((s.numel for ts in expert_tensors.values() for t in ts for s in t.segments), default=0)
    scratch = max(1, workers) * 2 * max_seg
    if cuda:
        scratch += cuda_block_bytes(slot) + PAGE
    return max(inflight) + (slot if cuda else 0), scratch, slot


def dry_requirements(expert_tensors: dict, dense_bytes: int, workers: int, cuda: bool = False) -> dict:
    """See :func:`zipmoe.runtime.engine.loader.requirements`."""
    expert_working, scratch, _slot = _sizes(expert_tensors, workers, cuda)
    all_t = [t for ts in expert_tensors.values() for t in ts]
    full = sum(t.compute_bytes for t in all_t)
    window = max(1, workers) + 2
    working = scratch + window * expert_working

    def budget_for(fraction: float) -> int:
        return int(dense_bytes + working + -(-int(full * fraction) // 1))

    return {
        "dense_bytes": dense_bytes, "expert_bytes_full": full,
        "expert_bytes_stored": sum(t.stored_bytes for t in all_t),
        "min_budget": dense_bytes + scratch + expert_working, "working_bytes": working,
        "num_expert_tensors": len(all_t), "budget_for": budget_for,
    }


class Runtime:
    """Serves the expert layers of one model from one container.

    ``settings``: the engine's switches (:class:`~zipmoe.runtime.engine.settings.EngineSettings`;
    ``prefetch`` and ``slots`` resolved for the device). The runtime builds the fetch pipeline
    from them (:class:`~zipmoe.runtime.engine.fetcher.Fetcher` with its reader, decoder and
    device side) and hands each piece what it needs.
    """

    def __init__(self, *, path, container_id: str, meta: dict, family, device, expert_tensors: dict,
                 sparse_layers: list, num_experts: int, top_k: int, num_layers: int, dense_bytes: int,
                 budget: int, plan=None, compute_dtype=torch.bfloat16, settings: EngineSettings | None = None) -> None:
        self.path = str(path)
        self.container_id = container_id
        self.meta = meta
        self.family = family
        self.device = torch.device(device)
        self.settings = (settings or EngineSettings()).resolved(self.device.type)
        st = self.settings
        self.expert_tensors = expert_tensors  # {(layer, expert): [ExpertTensor]}
        self.sparse_layers = list(sparse_layers)
        self.num_experts = num_experts
        self.top_k = top_k
        self.num_layers = num_layers
        self.dense_bytes = int(dense_bytes)
        self.budget = int(budget)
        self.workers = max(1, int(st.workers or 1))
        self.readers = int(st.readers)  # I/O threads: queue depth
        self.compute_dtype = compute_dtype
        self.counters = Counters()
        # prefetch across layers (engine/prefetch.py): the loader sets the predictor once the
        # routers are loaded; pointless when every expert fits whole in the full pool
        self.predictor = None
        self.prefetch = bool(st.prefetch)
        self.memory_limit: dict | None = None  # the loader's memlimit.check figures
        self._trace: TraceWriter | None = None
        self.loops: dict = {}  # batch -> the DecodeLoop the planner's and tools' passes reuse (loop.generate_ids)
        # while a CUDA graph is captured, every experts call goes here instead (intercepted())
        self.intercept = None
        cuda = self.device.type == "cuda"

        all_t = [t for ts in expert_tensors.values() for t in ts]
        self.expert_bytes_full = sum(t.compute_bytes for t in all_t)  # all experts whole, as computed with
        self.expert_bytes_stored = sum(t.stored_bytes for t in all_t)
        # working set: one expert in flight = its bf16 buffers + read buffers; plus the
        # exp (and sm, if not raw) decode scratch of each worker
        self.expert_working, self.scratch_bytes, self.staging_slot_bytes = _sizes(expert_tensors, self.workers, cuda)
        self.min_budget = self.dense_bytes + self.scratch_bytes + self.expert_working
        if self.budget < self.min_budget:
            raise BudgetError(
                f"budget {format_size(self.budget)} is too small: this model needs at least "
                f"{format_size(self.min_budget)} ({self.min_budget} bytes: dense weights {format_size(self.dense_bytes)} "
                f"+ one expert in flight {format_size(self.expert_working + self.scratch_bytes)})"
            )
        left = self.budget - self.dense_bytes - self.scratch_bytes
        want = self.workers + 2
        self.window = max(1, min(want, left // max(1, self.expert_working)))
        pool_bytes = left - self.window * self.expert_working
        if plan is not None:
            self.plan = read_plan(plan, container_id)
            caps = dict(self.plan["pools"])
            total = sum(caps.values())
            if total > pool_bytes:  # a plan for a larger budget: scale down, keep its shape
                caps = {k: int(v * pool_bytes // total) for k, v in caps.items()}
            self.split_source = "plan"
            self.plan_note = plan_dtype_note(self.plan["raw"], compute_dtype)
        else:
            self.plan = None
            self.plan_note = None
            if pool_bytes >= self.expert_bytes_full:
                caps = {"full": pool_bytes, "compressed": 0, "sm_only": 0, "e_only": 0}
            else:
                caps = {k: int(pool_bytes * f) for k, f in DEFAULT_SPLIT.items()}
            self.split_source = "default"
        # the full pool as device slot tensors with an expert->slot map (engine/slots.py): on
        # CUDA by default (what CUDA graphs gather from), anywhere with slots=True
        self.slots = None
        if st.slots and caps.get("full", 0) > 0:
            from zipmoe.runtime.engine.slots import SlotMap

            self.slots = SlotMap(expert_tensors, caps["full"], compute_dtype, self.device, num_experts)
            caps["full"] = self.slots.nbytes  # the arenas' bytes, at most what the split gave
        self.pools = caps
        # whether a sparse block whose experts all sit in the full pool's device slots may run
        # from its CUDA graph (engine/graphs.py); False: every sparse block takes the host path
        # (the planner's passes measure what that path costs, runtime/plan/passes.py), and while
        # a cache other than the slots' own is swapped in (the slots then hold another cache's tensors)
        self.sparse_graphs = True
        # aging: counts halve every ``cache_age`` tokens' worth of expert uses (cache.py)
        self.cache_age = int(st.cache_age)
        self.cache = self._new_cache(caps)
        # on CUDA: the pinned staging ring, one slot per expert in flight (engine/staging.py)
        self.staging = None
        if cuda:
            from zipmoe.runtime.engine.staging import StagingRing

            self.staging = StagingRing(self.window, self.staging_slot_bytes, pin=True)
        self.store = ExpertStore(self.path, self.counters, direct=st.direct_io)
        self.working = WorkingSet(self.store.buffers, window=self.window, expert_working=self.expert_working,
                                  staged=cuda, ring_bytes=self.window * self.staging_slot_bytes if cuda else 0,
                                  on_change=self._note_held)
        self.fetcher = Fetcher(expert_tensors=expert_tensors, cache=self.cache, counters=self.counters,
                               working=self.working, reader=Reader(self.store, self.readers),
                               decoder=Decoder(self.workers, self.counters.add_time),
                               device=self.device_side(self.staging))
        # threads and file descriptors go when the model is garbage collected, if close() was not called
        self._finalizer = weakref.finalize(self, _shutdown, self.fetcher, self.store, self.staging)
        self.counters.note_held(self.held_bytes())

    def _new_cache(self, caps: dict) -> ExpertCache:
        units = len(next(iter(self.expert_tensors.values()), []))
        cache = ExpertCache(caps, demote=demote, age_every=aging_period(self.cache_age, self.top_k, units, len(self.sparse_layers)))
        if self.slots is not None:
            self.slots.attach(cache)
        return cache

    def device_side(self, ring, device_merge: bool | None = None) -> DeviceSide:
        """The fetch pipeline's device side over ``ring`` (None: no staging). ``device_merge``:
        None = the setting (Triton where available, CUDA only)."""
        if device_merge is None:
            device_merge = False
            if ring is not None and self.settings.device_merge is not False:
                try:
                    from zipmoe import kernels

                    device_merge = bool(kernels.triton_available())
                except Exception:  # pragma: no cover - depends on the install
                    device_merge = False
        return DeviceSide(self.device, self.compute_dtype, ring=ring, device_merge=device_merge,
                          slotted=self.slots is not None, counters=self.counters)

    def swap_cache(self, cache: ExpertCache) -> ExpertCache:
        """Serve from ``cache`` from now on (the planner's compressed pass); returns the old one."""
        old, self.cache = self.cache, cache
        self.fetcher.cache = cache
        # the device slots stay hooked to the cache that made them: while another one serves,
        # no sparse block may run from the slots (they would be hits the new cache does not have)
        self.sparse_graphs = self.slots is None or cache is self.slots.cache
        return old

    @property
    def _inflight(self) -> int:
        return self.working.inflight

    def _note_held(self) -> None:
        self.counters.note_held(self.held_bytes())

    # ------------------------------------------------------------------ accounting
    def held_bytes(self) -> int:
        pools = self.cache.used_bytes()
        if self.slots is not None:  # the arenas are allocated whole, used or not
            pools += self.slots.nbytes + self.slots.loose_bytes - self.cache.pools["full"].used
        ring = 0 if self.staging is None else self.staging.nbytes
        return self.dense_bytes + self.scratch_bytes + pools + ring + self.working.inflight + self.store.buffers.idle_bytes

    def memory(self) -> dict:
        """What the budget counts against what is really allocated: ``counted_bytes`` (held now,
        allocator rounding included), ``peak_counted_bytes``; on CUDA the caching allocator's
        ``device_allocated`` / ``device_reserved`` (every tensor of the process on that device,
        the KV cache and activations included) and the pinned staging ring's bytes."""
        out = {"budget": self.budget, "counted_bytes": self.held_bytes(),
               "peak_counted_bytes": self.counters.peak_held_bytes}
        if self.device.type == "cuda":
            out["device_allocated"] = int(torch.cuda.memory_allocated(self.device))
            out["device_reserved"] = int(torch.cuda.memory_reserved(self.device))
        if self.staging is not None:
            out["staging_ring_bytes"] = self.staging.nbytes
            out["staging_pinned"] = self.staging.pinned
        return out

    def describe(self) -> dict:
        return {
            "budget": self.budget,
            "min_budget": self.min_budget,
            "dense_bytes": self.dense_bytes,
            "expert_bytes_full": self.expert_bytes_full,
            "expert_bytes_stored": self.expert_bytes_stored,
            "window": self.window,
            "working_bytes": self.window * self.expert_working + self.scratch_bytes,
            "pools": dict(self.pools),
            "split": self.split_source,
            "plan_note": self.plan_note,
            "workers": self.workers,
            "readers": self.readers,
            "device": str(self.device),
            "compute_dtype": str(self.compute_dtype).replace("torch.", ""),
            "direct_io": self.store.direct,
            "slots": None if self.slots is None else {f"{k[0]} {list(k[1])}": a.slots for k, a in self.slots.arenas.items()},
            "direct_io_fallback": self.store.fallback_reason,
            "cache_age_tokens": self.cache_age,
            "prefetch": self.prefetch and self.predictor is not None,
            "device_merge": self.fetcher.device.device_merge,
            "settings": self.settings.as_dict(),
            "memory_limit": self.memory_limit,
            "staging": None if self.staging is None else {
                "slots": self.staging.slots, "slot_bytes": self.staging.slot_bytes, "bytes": self.staging.nbytes,
                "pinned": self.staging.pinned, "pin_error": self.staging.pin_error},
        }

    # ------------------------------------------------------------------ tracing
    def start_trace(self, path) -> None:
        self.stop_trace()
        self._trace = TraceWriter(path, {
            "container_id": self.container_id, "num_layers": self.num_layers,
            "num_experts": self.num_experts, "top_k": self.top_k, "layers": self.sparse_layers,
        })

    def stop_trace(self) -> None:
        if self._trace is not None:
            self._trace.close()
            self._trace = None

    def begin_step(self, input_shape) -> None:
        """A forward step starts (its input ids' ``[batch, sequence]``: recorded in the trace)."""
        if self._trace is not None:
            self._trace.begin_step(input_shape)

    def end_step(self) -> None:
        if self._trace is not None:
            self._trace.end_step()

    # ------------------------------------------------------------------ serving
    def run_layer(self, layer, experts: list, compute, trace_ids=None, hidden=None) -> None:
        """``hidden``: the layer's expert input (the router's input), for the prefetch predictor."""
        t0 = time.perf_counter()
        if self._trace is not None and trace_ids is not None:
            self._trace.record(layer, trace_ids() if callable(trace_ids) else trace_ids)
        predict = None
        if self.prefetch and self.predictor is not None and hidden is not None:
            predict = lambda: self.predictor.predict(layer, hidden)  # noqa: E731
        if experts:
            self.fetcher.run(layer, experts, compute, predict)
        self.counters.add_layer(layer, time.perf_counter() - t0, experts)

    @contextlib.contextmanager
    def intercepted(self, fn):
        """Within this block every fused experts call is ``fn(module, hidden, top_k_index,
        top_k_weights)`` instead of the host path (engine/graphs.py: the capture of a decode step
        ends a graph piece at each sparse block)."""
        if self.intercept is not None:
            raise RuntimeError("experts calls are already intercepted")
        self.intercept = fn
        try:
            yield
        finally:
            self.intercept = None

    def layer_computed(self, layer, experts: list, seconds: float, trace_ids=None) -> None:
        """A sparse layer computed outside :meth:`run_layer` (a CUDA graph, from resident
        tensors): the same trace, cache uses and counters as if it had run here."""
        if self._trace is not None and trace_ids is not None:
            self._trace.record(layer, trace_ids() if callable(trace_ids) else trace_ids)
        if experts:
            self.fetcher.account_resident(layer, experts)
        self.counters.add_layer(layer, seconds, experts)

    def warm(self) -> int:
        """Fill the full pool with experts in (layer, expert) order while it has room; returns how
        many tensors it placed. The tensors come through the fetch pipeline (no use counted)."""
        from zipmoe.runtime.engine.staging import own_device

        cache = self.cache
        full = cache.pools["full"]
        n = 0
        for key in sorted(self.expert_tensors):
            room = full.capacity - full.used
            take, stop = [], False
            for t in self.expert_tensors[key]:
                if cache.state_of(t.uid) is not None:
                    continue
                if room < t.compute_bytes:
                    stop = True
                    break
                if self.slots is not None and not self.slots.has_free(t.uid):
                    continue  # this kind's slots are full (another kind may still have room)
                take.append(t)
                room -= t.compute_bytes
            if take:
                weights = dict(zip((t.uid for t in self.expert_tensors[key]), self.fetcher.fetch_whole(*key)))
                for t in take:
                    w = weights[t.uid]
                    cache.put(t.uid, "full", t.compute_bytes, w if self.slots is not None else own_device(w))
                    n += 1
            if stop:
                break
        if self.slots is not None:
            self.slots.flush()  # the device maps as the warm start left them
        self.counters.note_held(self.held_bytes())
        return n

    def close(self) -> None:
        """Stop the trace, the I/O and decode threads, and close the file (idempotent)."""
        self.stop_trace()
        self._finalizer()


def _shutdown(fetcher, store, staging=None) -> None:
    fetcher.close()
    store.close()
    if staging is not None:
        staging.close()
