"""Stored chunks of an expert tensor into its bf16 bits, on the CPU decode workers.

:func:`decode_into` turns stored E chunks and the SM chunk of an expert tensor into bf16 (as
uint16) in a caller's buffer, verifying the XXH3-64 (and length) of every chunk first
(docs/format.md 7, :func:`zipmoe.codecs.checksum.verify_chunk`): a corrupted chunk raises
:class:`~zipmoe.errors.ChecksumError` naming the tensor, and nothing is computed with it.
:func:`decode_exp_into` decompresses only (the device merges); the profiler times this same
function, so that the planner's decompression cost is what serving runs.
"""

from __future__ import annotations

import time

import numpy as np

from zipmoe.codecs.checksum import verify_chunk
from zipmoe.errors import ContainerError
from zipmoe.runtime.engine.tensors import ExpertTensor


def decode_into(tensor: ExpertTensor, e_parts: list, sm_parts: list, out_u16: np.ndarray, ctx,
                verify_e: bool, verify_sm: bool, timer=None) -> None:
    """Decompress the E chunks and merge with SM into ``out_u16`` (flat uint16, tensor.numel).

    ``e_parts[i]`` / ``sm_parts[i]``: segment i's stored E bytes (its E chunks as stored,
    concatenated) and stored SM bytes. ``verify_*``: check the XXH3-64 of those chunks first
    (every chunk read from the file is verified once, before its first use).
    ``timer(stage, seconds)`` receives the decode and merge times.
    """
    from zipmoe.kernels.cpu import merge_into

    for seg, e, sm in zip(tensor.segments, e_parts, sm_parts):
        t0 = time.perf_counter()
        exp = ctx.scratch("exp", seg.numel)
        smv = _sm_of(seg, sm, None, ctx, verify_sm)
        _decode_e_chunks(seg, e, exp, ctx, verify_e)
        t1 = time.perf_counter()
        merge_into(exp, smv, out_u16[seg.dst : seg.dst + seg.numel])
        t2 = time.perf_counter()
        if timer is not None:
            timer("decode", t1 - t0)
            timer("merge", t2 - t1)


def _sm_of(seg, sm, dst, ctx, verify_sm: bool):
    """Segment ``seg``'s SM bytes from its stored SM chunk ``sm`` (its checksum verified first
    when ``verify_sm``): the stored bytes themselves when raw, else decompressed. ``dst``: where
    they must end up (copied there when raw), or None for a view or the worker's scratch."""
    from zipmoe.codecs.exponent import get_codec

    sm_c = seg.sm_chunk
    if verify_sm:
        verify_chunk(sm_c, sm, seg.name, len(seg.e_chunks))
    if sm_c.codec == "raw":
        if dst is None:
            return sm
        dst[:] = sm
        return dst
    out = ctx.scratch("sm", seg.numel) if dst is None else dst
    get_codec(sm_c.codec).decompress_into(sm, out, ctx)
    return out


def u16_view(t) -> np.ndarray:
    """A contiguous bf16 torch tensor's bits as a flat uint16 array (no copy): what decoders write.
    A numpy array (a staging slot's bf16 part, already uint16) is returned flat as it is."""
    if isinstance(t, np.ndarray):
        return t.reshape(-1)
    import torch

    return t.view(torch.int16).numpy().view(np.uint16).reshape(-1)


def decode_e_chunk(seg, k: int, e, dst: np.ndarray, ctx, verify_e: bool) -> None:
    """Decompress E chunk ``k`` of segment ``seg`` (``e``: the segment's stored E bytes) into
    ``dst`` (its ``raw_length`` bytes), verifying its checksum first when ``verify_e``."""
    from zipmoe.codecs.exponent import get_codec

    c = seg.e_chunks[k]
    base = seg.e_range[0]
    src = e[c.offset - base : c.offset - base + c.length]
    if verify_e:
        verify_chunk(c, src, seg.name, k)
    try:
        get_codec(c.codec).decompress_into(src, dst, ctx)
    except ContainerError as exc:
        raise ContainerError(f"tensor {seg.name} chunk {k}: {exc}") from None


def _decode_e_chunks(seg, e, exp, ctx, verify_e: bool) -> None:
    """Decompress one segment's E chunks (``e``: its stored E bytes) into ``exp`` (numel bytes)."""
    for k, c in enumerate(seg.e_chunks):
        decode_e_chunk(seg, k, e, exp[c.raw_offset : c.raw_offset + c.raw_length], ctx, verify_e)


def decode_exp_into(tensor: ExpertTensor, e_parts: list, exp_out: np.ndarray, ctx, verify_e: bool) -> None:
    """Decompress only (for a device merge): all segments' E streams into ``exp_out`` (flat, numel)."""
    for seg, e in zip(tensor.segments, e_parts):
        _decode_e_chunks(seg, e, exp_out[seg.dst : seg.dst + seg.numel], ctx, verify_e)


def decode_sm_into(tensor: ExpertTensor, sm_parts: list, sm_out: np.ndarray, ctx, verify_sm: bool) -> None:
    """The SM bytes of every segment into ``sm_out`` (flat, numel), for a device merge."""
    for seg, sm in zip(tensor.segments, sm_parts):
        _sm_of(seg, sm, sm_out[seg.dst : seg.dst + seg.numel], ctx, verify_sm)
