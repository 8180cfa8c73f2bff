"""The serving thread's end of a fetch: stage a finished expert's bytes to the device (one copy and,
with the Triton kernel, one merge, on the copy stream: :mod:`.staging`), the weights in the
compute dtype, and offering the tensor's forms to the cache; and
:func:`demote`, the cache's cascade of those forms. A mixin of
:class:`zipmoe.runtime.engine.scheduler.LayerScheduler`."""

from __future__ import annotations

import time

import numpy as np

from zipmoe.runtime.engine.staging import own_device

__all__ = ["DeviceSide", "demote"]


class DeviceSide:
    """Serving-thread steps of :class:`LayerScheduler` (uses its ``rt``, ``device``, ``cuda``,
    ``device_merge`` and ``copies``, a :class:`zipmoe.runtime.engine.staging.CopyStream`)."""

    def _stage_group(self, g) -> None:
        """Every fetch of ``g`` is decoded into its staging slot: queue the slot's copy (and the
        device merge) on the copy stream, give the slot back with the copy's event."""
        if g.slot is None:
            return
        t0 = time.perf_counter()
        ring = self.copies.ring
        ev = self.copies.stage(g.slot, g.n, g.dev)
        ring.release(g.slot, ev)
        g.slot = None
        g.event = ev
        self.rt.counters.add_time("stage", time.perf_counter() - t0)

    def _to_device(self, g) -> None:
        """Before ``g``'s expert computes: the compute stream waits for its copy (on the device,
        not the host); its buffer is marked as used by that stream for the allocator."""
        if g.slot is not None:  # not staged yet (it is, as soon as its last fetch reports)
            self._stage_group(g)
        if g.event is not None:
            import torch

            s = torch.cuda.current_stream(self.device)
            s.wait_event(g.event)
            g.dev.record_stream(s)
            g.event = None

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
            forms = {"full": (t.compute_bytes, f.w if self.rt.slots is not None else own_device(f.w))}
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
