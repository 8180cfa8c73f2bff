"""The serving thread's end of a fetch: where a group's tensors land, their way to the device, the
weights in the compute dtype, and the forms offered to the cache; and :func:`demote`, the cache's
cascade of those forms.

:class:`DeviceSide` is built with what it needs and nothing else: the device, the compute dtype,
the staging ring (None: no staging, the tensors are merged where they are computed, as on the
CPU), whether the device merges (Triton), whether the full pool keeps device slots (then the
pool copies a tensor into its slot and the fetch's buffer may be a view), and the counters.

Staged (CUDA): a group (one expert's fetches) takes one slot of the pinned ring when it is
issued and one device buffer its tensors are views of (:meth:`place`); the decode workers write
the slot; once the group's last fetch has finished, :meth:`stage` queues one copy of the slot
(and one Triton merge) on the copy stream (:class:`zipmoe.runtime.engine.staging.CopyStream`) and
gives the slot back with the copy's event. :meth:`stage` runs on the fetcher's one stager
thread, handed the group by the reader or decode thread that finished its last fetch
(``Fetcher._put_staged``), so the copy starts as soon as the bytes are whole and costs the
serving thread nothing; it also marks the buffer as used by the compute stream (the one the
serving thread last named, :meth:`compute_stream`). Before the expert computes,
:meth:`to_device` makes the compute stream wait for that event (on the device, not the host):
one CUDA call on the serving thread per group.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from zipmoe.runtime.engine.staging import CopyStream, cuda_block_bytes, own_device

__all__ = ["DeviceSide", "demote", "own_parts"]


class DeviceSide:
    def __init__(self, device, compute_dtype, *, ring=None, device_merge: bool = False, slotted: bool = False,
                 counters=None) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.compute_dtype = compute_dtype
        self.slotted = bool(slotted)
        self.counters = counters
        self.device_merge = bool(device_merge) and ring is not None
        self.copies = CopyStream(self.device, ring, self.device_merge) if ring is not None else None
        self._cs = None  # the compute stream, as the serving thread last found it (compute_stream)

    @property
    def staged(self) -> bool:
        return self.copies is not None

    # ------------------------------------------------------------------ issue
    def group_bytes(self, g, fetches: list) -> int:
        """The group's own bytes beside its fetches' (staged: its one device buffer, as the CUDA
        allocator rounds it); sets ``g.n``, the elements of its buffers."""
        if not self.staged:
            return 0
        g.n = self.copies.layout([f.tensor for f in fetches])[1]
        return cuda_block_bytes(2 * g.n) if self.cuda else 2 * g.n

    def place(self, g, fetches: list) -> None:
        """Where the group's tensors are decoded to: staged, views of its slot (the workers
        write ``exp_host`` / ``sm_host`` for a device merge, ``host`` for a host merge; the device
        buffer and its views ``out`` come with the copy, :meth:`stage`); else one tensor each on
        the device (``out``)."""
        if not self.staged:
            for f in fetches:
                f.out = torch.empty(f.tensor.shape, dtype=torch.bfloat16, device=self.device)
            return
        cs = self.copies
        ring = cs.ring
        offs, n = cs.layout([f.tensor for f in fetches])
        g.offs = offs
        waits = ring.waits
        g.slot = ring.acquire()
        if self.counters is not None:
            self.counters.staging_waits += ring.waits - waits
        host = ring.view_np(g.slot, 2 * n)  # numpy views of the slot: no torch call per tensor
        merge = self.device_merge
        for f, o in zip(fetches, offs):
            k = f.tensor.numel
            if merge:
                f.exp_host = host[o : o + k]
                f.sm_host = host[n + o : n + o + k]
            else:
                f.host = host[2 * o : 2 * (o + k)].view(np.uint16)  # the bf16 bits, flat

    def release(self, g) -> None:
        """A group given back: its slot, if never staged (an error, a drop: nothing reads it)."""
        if g.slot is not None:
            self.copies.ring.release(g.slot)
            g.slot = None
        g.dev = g.used_by = None

    # ------------------------------------------------------------------ finished
    def stage(self, g) -> None:
        """Every fetch of ``g`` is decoded into its staging slot: queue the slot's copy (and the
        device merge) on the copy stream, give the slot back with the copy's event."""
        if g.slot is None:
            return
        t0 = time.perf_counter()
        # the group's one device buffer is taken here, with the copy (one switch to the copy
        # stream for both; its bytes were counted when the group was issued): the tensors are
        # views of it
        dev, ev = self.copies.stage_new(g.slot, g.n)
        g.dev = dev
        cs = self._cs
        if cs is not None and ev is not None:
            # the buffer will be read on the compute stream: the allocator must not reuse it before
            # that stream is done with it (marked here, off the serving thread; to_device checks
            # that the stream is still the one the serving thread computes on)
            dev.record_stream(cs)
            g.used_by = cs
        for f, o in zip((f for f in g.fetches if f is not None), g.offs):
            rows, cols = f.tensor.shape
            f.out = dev.as_strided((rows, cols), (cols, 1), o)  # = dev[o : o + numel].view(shape), one call
        ring = self.copies.ring
        ring.release(g.slot, ev)
        g.slot = None
        g.event = ev
        if ev is not None:
            ring.reap()
        if self.counters is not None:
            self.counters.add_time("stage", time.perf_counter() - t0)

    def compute_stream(self):
        """The stream the serving thread computes on (None: not CUDA). Asked once per layer: the
        call costs the serving thread more than the wait it is for."""
        if not (self.cuda and self.staged):
            return None
        s = torch.cuda.current_stream(self.device)
        if self._cs is None or not s == self._cs:  # (a Stream's != None is False)
            self._cs = s
        return self._cs

    def to_device(self, g, stream=None) -> None:
        """Before ``g``'s expert computes: the compute stream (``stream``, from
        :meth:`compute_stream`; None: asked here) waits for its copy (on the device, not the
        host); its buffer is marked as used by that stream for the allocator."""
        if not self.staged:
            return
        if g.slot is not None:  # not staged yet (it is, as soon as its last fetch reports)
            self.stage(g)
        if g.event is not None:
            s = stream if stream is not None else self.compute_stream()
            s.wait_event(g.event)
            if g.used_by is not s:  # (staged before the serving thread named its stream, or another one)
                g.dev.record_stream(s)
            g.event = None

    def finish(self, fetches) -> None:
        """The weights the expert computes with: the merged bf16 tensor, or its conversion
        (exact) when the model computes in float32."""
        dtype = self.compute_dtype
        for f in fetches:
            if f is not None:
                f.w = f.out if f.out.dtype == dtype else f.out.to(dtype)
                if f.w is not f.out:
                    f.out = None

    def forms(self, f, pools=None) -> dict:
        """What the cache may keep of a computed fetch, per pool: ``{pool: (bytes, data)}`` (the
        lower pools' data as a callable, copied only if a pool takes it). ``pools``: only these
        (the cache's ``open_pools``: a pool of no capacity takes nothing); None: all four."""
        t = f.tensor
        forms = {}
        # the full pool's data: with slots the pool copies it into a slot; else the tensor itself,
        # or its own copy when it is a view of a group's buffer (made only if the pool takes it)
        if pools is None or "full" in pools:
            forms["full"] = (t.compute_bytes, f.w if self.slotted else (lambda w=f.w: own_device(w)))
        e_parts, sm_parts = f.e_parts, f.sm_parts
        if e_parts is not None and sm_parts is not None and (pools is None or "compressed" in pools):
            forms["compressed"] = (t.e_bytes + t.sm_bytes, lambda e=e_parts, s=sm_parts: (own_parts(e), own_parts(s)))
        if sm_parts is not None and (pools is None or "sm_only" in pools):
            forms["sm_only"] = (t.sm_bytes, lambda s=sm_parts: own_parts(s))
        if e_parts is not None and (pools is None or "e_only" in pools):
            forms["e_only"] = (t.e_bytes, lambda e=e_parts: own_parts(e))
        return forms


def demote(pool_name: str, data):
    """What an expert tensor evicted from ``pool_name`` keeps, for the cache's cascade: the
    compressed pool's data is ``(E parts, SM parts)`` (:meth:`DeviceSide.forms`), each of which
    is the data of the E-only and SM-only pools, copied to exact-size arrays if the lower pool
    takes it (the compressed pool keeps read buffers whole, engine/adopt.py: half of one must
    not hold the rest). The other pools' data keeps nothing a lower pool holds."""
    if pool_name != "compressed":
        return None
    e_parts, sm_parts = data
    return {"sm_only": (sum(p.nbytes for p in sm_parts), lambda: own_parts(sm_parts)),
            "e_only": (sum(p.nbytes for p in e_parts), lambda: own_parts(e_parts))}


def own_parts(parts: list) -> list:
    """Exact-size copies (read buffers are views into larger aligned buffers)."""
    out = []
    for p in parts:
        if isinstance(p, np.ndarray) and p.base is None and p.flags.owndata:
            out.append(p)
        else:
            out.append(np.array(p, dtype=np.uint8, copy=True))
    return out
