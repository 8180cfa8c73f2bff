"""Triton kernels for the bf16 bit-field merge (and split) on CUDA tensors.

Bit layout (normative; docs/format.md)::

    u = ((sm & 0x80) << 8) | (exp << 7) | (sm & 0x7F)        # merge
    exp = (u >> 7) & 0xFF ;  sm = ((u >> 8) & 0x80) | (u & 0x7F)   # split

Design. The merge is purely memory-bound (2 bytes in, 2 bytes out per element), so the kernel
is a flat 1-D grid over blocks of ``BLOCK`` elements. Each program loads its exponent and
sign-mantissa bytes and stores the 16-bit results; Triton turns a contiguous block into
128-bit vector accesses (16 uint8 per load, 8 int16 per store) *provided* the accesses are
not masked element by element. A mask built from an arbitrary ``n`` defeats that (its
constancy is 1), so the launch is in two parts: every full block with ``EVEN=True`` (no mask
at all), then at most one masked tail block. Offsets are computed in int64 so tensors past
2**31 elements are fine.

Output is written as int16 (a bitcast view of a bfloat16 or uint16 tensor), which every
Triton version supports as a pointer type.

``merge_triton``/``split_triton`` do not check the device, so the CPU suite can run them on
CPU tensors under ``TRITON_INTERPRET=1``; ``merge_cuda`` is the checked entry point that
:func:`zipmoe.kernels.merge` uses for CUDA tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["BLOCK", "NUM_WARPS", "merge_cuda", "merge_triton", "split_triton", "torch_merge"]

#: Default elements per program and warps per program. 4096 elements with 8 warps is 16
#: elements (one 16-byte load per input) per thread; benchmarks/gpu_merge.py sweeps others.
BLOCK = 4096
NUM_WARPS = 8


@triton.jit
def _merge_kernel(exp_ptr, sm_ptr, out_ptr, start, n, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = start + pid * BLOCK + tl.arange(0, BLOCK)
    if EVEN:
        e = tl.load(exp_ptr + offs, eviction_policy="evict_first")
        s = tl.load(sm_ptr + offs, eviction_policy="evict_first")
    else:
        mask = offs < n
        e = tl.load(exp_ptr + offs, mask=mask, other=0)
        s = tl.load(sm_ptr + offs, mask=mask, other=0)
    e = e.to(tl.int32)
    s = s.to(tl.int32)
    u = ((s & 0x80) << 8) | (e << 7) | (s & 0x7F)
    u = u.to(tl.int16)  # keeps the low 16 bits (two's complement wrap), i.e. the bit pattern
    if EVEN:
        tl.store(out_ptr + offs, u)
    else:
        tl.store(out_ptr + offs, u, mask=mask)


@triton.jit
def _split_kernel(u_ptr, exp_ptr, sm_ptr, start, n, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = start + pid * BLOCK + tl.arange(0, BLOCK)
    if EVEN:
        u = tl.load(u_ptr + offs)
    else:
        mask = offs < n
        u = tl.load(u_ptr + offs, mask=mask, other=0)
    u = u.to(tl.int32) & 0xFFFF
    e = ((u >> 7) & 0xFF).to(tl.uint8)
    s = (((u >> 8) & 0x80) | (u & 0x7F)).to(tl.uint8)
    if EVEN:
        tl.store(exp_ptr + offs, e)
        tl.store(sm_ptr + offs, s)
    else:
        tl.store(exp_ptr + offs, e, mask=mask)
        tl.store(sm_ptr + offs, s, mask=mask)


def _as_i16(t: torch.Tensor, what: str) -> torch.Tensor:
    if t.dtype not in (torch.bfloat16, torch.int16, torch.uint16):
        raise ValueError(f"{what} must be bfloat16, uint16 or int16, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{what} must be contiguous")
    return t.reshape(-1).view(torch.int16)


def _as_u8(t: torch.Tensor, what: str, n: int) -> torch.Tensor:
    if t.dtype != torch.uint8:
        raise ValueError(f"{what} must be uint8, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{what} must be contiguous")
    if t.numel() != n:
        raise ValueError(f"{what} has {t.numel()} elements, expected {n}")
    return t.reshape(-1)


def _launch(kernel, args, n: int, block: int, num_warps: int) -> None:
    full = n // block
    if full:
        kernel[(full,)](*args, 0, n, BLOCK=block, EVEN=True, num_warps=num_warps)
    if n - full * block:
        kernel[(1,)](*args, full * block, n, BLOCK=block, EVEN=False, num_warps=num_warps)


def merge_triton(exp: torch.Tensor, sm: torch.Tensor, out: torch.Tensor,
                 block: int = BLOCK, num_warps: int = NUM_WARPS) -> torch.Tensor:
    """Merge uint8 ``exp`` and ``sm`` into ``out`` (bf16/uint16/int16, same numel). No device check."""
    o = _as_i16(out, "out")
    n = o.numel()
    e = _as_u8(exp, "exp", n)
    s = _as_u8(sm, "sm", n)
    if n:
        _launch(_merge_kernel, (e, s, o), n, block, num_warps)
    return out


def split_triton(u: torch.Tensor, exp_out: torch.Tensor, sm_out: torch.Tensor,
                 block: int = BLOCK, num_warps: int = NUM_WARPS) -> None:
    """Split bf16/uint16 ``u`` into uint8 ``exp_out`` and ``sm_out``. No device check."""
    x = _as_i16(u, "u")
    n = x.numel()
    e = _as_u8(exp_out, "exp_out", n)
    s = _as_u8(sm_out, "sm_out", n)
    if n:
        _launch(_split_kernel, (x, e, s), n, block, num_warps)


def merge_cuda(exp: torch.Tensor, sm: torch.Tensor, out: torch.Tensor, **kw) -> torch.Tensor:
    """:func:`merge_triton` for tensors that all live on one CUDA device."""
    devs = {exp.device, sm.device, out.device}
    if len(devs) != 1 or out.device.type != "cuda":
        raise ValueError(f"merge_cuda needs exp, sm and out on one CUDA device, got {sorted(map(str, devs))}")
    with torch.cuda.device(out.device):
        return merge_triton(exp, sm, out, **kw)


def torch_merge(exp: torch.Tensor, sm: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The same merge with plain torch ops (a reference and a baseline for the benchmark)."""
    o = _as_i16(out, "out")
    e = exp.reshape(-1).to(torch.int32)
    s = sm.reshape(-1).to(torch.int32)
    u = ((s & 0x80) << 8) | (e << 7) | (s & 0x7F)
    o.copy_(u.to(torch.int16))  # int32 -> int16 keeps the low 16 bits
    return out
