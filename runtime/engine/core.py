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

import json
import threading
import time
import weakref
from pathlib import Path

import torch

from zipmoe.errors import BudgetError, ModelError, UsageError
from zipmoe.units import format_size

from zipmoe.runtime.engine.cache import DEFAULT_AGE_TOKENS, POOLS, ExpertCache
from zipmoe.runtime.engine.counters import Counters
from zipmoe.runtime.engine.device_side import demote
from zipmoe.runtime.engine.scheduler import LayerScheduler
from zipmoe.runtime.engine.reads import DEFAULT_READERS, ExpertStore
from zipmoe.runtime.engine.trace import TraceWriter

__all__ = ["Runtime", "read_plan", "DEFAULT_SPLIT", "working_bytes_of"]

DEFAULT_SPLIT = {"full": 0.6, "compressed": 0.4, "sm_only": 0.0, "e_only": 0.0}


def working_bytes_of(t) -> int:
    """Working bytes of one expert tensor in flight: its bf16 merge buffer, its read buffers and,
    when the model computes in another dtype (float32), the converted tensor."""
    extra = t.compute_bytes if t.compute_itemsize != 2 else 0
    return t.full_bytes + t.staging_bytes() + extra


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
    """Serves the expert layers of one model from one container."""

    def __init__(self, *, path, container_id: str, meta: dict, family, device, expert_tensors: dict,
                 sparse_layers: list, num_experts: int, top_k: int, num_layers: int, dense_bytes: int,
                 budget: int, plan=None, workers: int = 1, direct_io: bool = True,
                 compute_dtype=torch.bfloat16, slots=None, cache_age: int | None = None, readers: int | None = None,
                 prefetch: bool = True) -> None:
        self.path = str(path)
        self.container_id = container_id
        self.meta = meta
        self.family = family
        self.device = torch.device(device)
        self.expert_tensors = expert_tensors  # {(layer, expert): [ExpertTensor]}
        self.sparse_layers = list(sparse_layers)
        self.num_experts = num_experts
        self.top_k = top_k
        self.num_layers = num_layers
        self.dense_bytes = int(dense_bytes)
        self.budget = int(budget)
        self.workers = max(1, int(workers))
        self.readers = DEFAULT_READERS if readers is None else max(1, int(readers))  # I/O threads: queue depth
        self.compute_dtype = compute_dtype
        self.counters = Counters()
        # prefetch across layers (engine/prefetch.py): the loader sets the predictor once the
        # routers are loaded; pointless when every expert fits whole in the full pool
        self.predictor = None
        self.prefetch = bool(prefetch)
        self.memory_limit: dict | None = None  # the loader's memlimit.check figures
        self._lock = threading.Lock()
        self._inflight = 0
        self._trace: TraceWriter | None = None

        all_t = [t for ts in expert_tensors.values() for t in ts]
        self.expert_bytes_full = sum(t.compute_bytes for t in all_t)  # all experts whole, as computed with
        self.expert_bytes_stored = sum(t.stored_bytes for t in all_t)
        # working set: one expert in flight = its bf16 buffers + read buffers; plus the
        # exp (and sm, if not raw) decode scratch of each worker
        self.expert_working, self.scratch_bytes, self.staging_slot_bytes = _sizes(
            expert_tensors, self.workers, self.device.type == "cuda")
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
        else:
            self.plan = None
            if pool_bytes >= self.expert_bytes_full:
                caps = {"full": pool_bytes, "compressed": 0, "sm_only": 0, "e_only": 0}
            else:
                caps = {k: int(pool_bytes * f) for k, f in DEFAULT_SPLIT.items()}
            self.split_source = "default"
        # the full pool as device slot tensors with an expert->slot map (engine/slots.py): on
        # CUDA by default (what CUDA graphs gather from), anywhere with slots=True
        self.slots = None
        if (self.device.type == "cuda" if slots is None else slots) and caps.get("full", 0) > 0:
            from zipmoe.runtime.engine.slots import SlotMap

            self.slots = SlotMap(expert_tensors, caps["full"], compute_dtype, self.device, num_experts)
            caps["full"] = self.slots.nbytes  # the arenas' bytes, at most what the split gave
        self.pools = caps
        # aging: counts halve every ``cache_age`` tokens' worth of expert uses (cache.py)
        self.cache_age = DEFAULT_AGE_TOKENS if cache_age is None else max(0, int(cache_age))
        per_token = max(1, int(top_k)) * len(next(iter(expert_tensors.values()), [])) * max(1, len(self.sparse_layers))
        self.cache = ExpertCache(caps, demote=demote, age_every=self.cache_age * per_token)
        if self.slots is not None:
            self.slots.attach(self.cache)
        # on CUDA: the pinned staging ring, one slot per expert in flight (engine/staging.py)
        self.staging = None
        if self.device.type == "cuda":
            from zipmoe.runtime.engine.staging import StagingRing

            self.staging = StagingRing(self.window, self.staging_slot_bytes, pin=True)
        self.store = ExpertStore(self.path, self.counters, direct=direct_io)
        self.scheduler = LayerScheduler(self, self.workers)
        # threads and file descriptors go when the model is garbage collected, if close() was not called
        self._finalizer = weakref.finalize(self, _shutdown, self.scheduler.io, self.scheduler.pool, self.store,
                                           self.staging)
        self.counters.note_held(self.held_bytes())

    # ------------------------------------------------------------------ accounting
    def working_bytes(self, t) -> int:
        """A fetch's own working bytes (on CUDA its expert's device buffer and staging slot are
        counted once per expert: the scheduler adds the first, the ring holds the second)."""
        return working_bytes_of(t) - (t.full_bytes if self.device.type == "cuda" else 0)

    def held_bytes(self) -> int:
        pools = self.cache.used_bytes()
        if self.slots is not None:  # the arenas are allocated whole, used or not
            pools += self.slots.nbytes + self.slots.loose_bytes - self.cache.pools["full"].used
        ring = 0 if self.staging is None else self.staging.nbytes
        return self.dense_bytes + self.scratch_bytes + pools + ring + self._inflight + self.store.buffers.idle_bytes

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

    def _idle_room(self) -> int:
        """Read buffers may stay idle in what the window reserves and the experts in flight do not use
        (on CUDA the window's staging slots are the ring's, held whole: not room for them)."""
        ring = 0 if self.staging is None else self.window * self.staging_slot_bytes
        return self.window * self.expert_working - ring - self._inflight

    def hold(self, n: int) -> None:
        with self._lock:
            self._inflight += n
            self.store.buffers.trim(self._idle_room())
        self.counters.note_held(self.held_bytes())

    def recycle(self, bufs: list) -> None:
        """Take back a finished fetch's read buffers (after :meth:`release` of its bytes)."""
        if bufs:
            with self._lock:
                self.store.buffers.put(bufs, self._idle_room())

    def release(self, n: int) -> None:
        with self._lock:
            self._inflight -= n
        self.counters.note_held(self.held_bytes())

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
            "workers": self.workers,
            "readers": self.readers,
            "device": str(self.device),
            "compute_dtype": str(self.compute_dtype).replace("torch.", ""),
            "direct_io": self.store.direct,
            "slots": None if self.slots is None else {f"{k[0]} {list(k[1])}": a.slots for k, a in self.slots.arenas.items()},
            "direct_io_fallback": self.store.fallback_reason,
            "cache_age_tokens": self.cache_age,
            "prefetch": self.prefetch and self.predictor is not None,
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
            self.scheduler.run(layer, experts, compute, predict)
        self.counters.add_layer(layer, time.perf_counter() - t0, len(experts))

    def warm(self) -> int:
        """Fill the full pool with experts in (layer, expert) order while it has room; returns how many."""
        n = 0
        for key in sorted(self.expert_tensors):
            for t in self.expert_tensors[key]:
                if self.cache.state_of(t.uid) is not None:
                    continue
                if self.cache.pools["full"].capacity - self.cache.pools["full"].used < t.compute_bytes:
                    return n
                if self.slots is not None and not self.slots.has_free(t.uid):
                    continue  # this kind's slots are full (another kind may still have room)
                from zipmoe.codecs.exponent import DecodeContext

                from zipmoe.runtime.engine.decode import decode_into, u16_view
                from zipmoe.runtime.engine.reads import slice_of

                bufs = [(off, self.store.read(off, ln)) for off, ln in t.ranges(True, True)]
                e_parts = [slice_of(bufs, s.e_range) for s in t.segments]
                sm_parts = [slice_of(bufs, s.sm_range) for s in t.segments]
                host = torch.empty(t.shape, dtype=torch.bfloat16)
                decode_into(t, e_parts, sm_parts, u16_view(host),
                            DecodeContext(), True, True)
                out = host.to(device=self.device, dtype=self.compute_dtype)
                self.cache.put(t.uid, "full", t.compute_bytes, out)
                n += 1
        self.counters.note_held(self.held_bytes())
        return n

    def close(self) -> None:
        """Stop the trace, the I/O and decode threads, and close the file (idempotent)."""
        self.stop_trace()
        self._finalizer()


def _shutdown(io, pool, store, staging=None) -> None:
    io.shutdown()
    pool.shutdown()
    store.close()
    if staging is not None:
        staging.close()

