"""The serving thread's end of a fetch: copy (or merge, with the Triton kernel) the staged bytes to
the device, the weights in the compute dtype, and offering the tensor's forms to the cache; and
:func:`demote`, the cache's cascade of those forms. A mixin of
:class:`zipmoe.runtime.serve.scheduler.LayerScheduler`."""

from __future__ import annotations

import time

import numpy as np

__all__ = ["DeviceSide", "demote"]


class DeviceSide:
    """Serving-thread steps of :class:`LayerScheduler` (uses its ``rt``, ``device`` and
    ``device_merge``)."""

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
