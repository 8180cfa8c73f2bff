"""One merge entry point that picks the kernel by where the data lives.

``merge(exp, sm, out)``:

- numpy arrays, or CPU torch tensors: the numba loop :func:`zipmoe.kernels.cpu.merge_into` on
  their numpy views (no copy; torch tensors share memory with the views);
- CUDA torch tensors: the Triton kernel :func:`zipmoe.kernels.triton_merge.merge_cuda`
  (where triton is not installed: the same arithmetic in torch ops, with a warning once).

``exp`` and ``sm`` are uint8, ``out`` is uint16 or bfloat16 (int16 is accepted too: same bits)
with the same number of elements; all contiguous (any shape: they are flattened as views).
Mixing devices is an error, not a silent copy.

torch and triton are imported lazily: numpy-only callers (the codecs, ``zipmoe verify``)
never pay for them.
"""

from __future__ import annotations

import functools
import os

import numpy as np

from . import cpu

__all__ = ["merge", "split", "triton_available"]


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


@functools.lru_cache(maxsize=1)
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True


def triton_available() -> bool:
    """True when the Triton merge kernel can run here: triton imports and a CUDA device is
    present (or ``TRITON_INTERPRET=1`` is set, where it runs on CPU tensors, slowly)."""
    if not _triton_importable():
        return False
    if os.environ.get("TRITON_INTERPRET", "") == "1":
        return True
    try:
        import torch
    except Exception:  # pragma: no cover
        return False
    return bool(torch.cuda.is_available())


def _np_u8(x, what: str) -> np.ndarray:
    if _is_torch(x):
        import torch

        if x.dtype != torch.uint8:
            raise ValueError(f"{what} must be uint8, got {x.dtype}")
        x = x.detach()
        if not x.is_contiguous():
            raise ValueError(f"{what} must be contiguous")
        return x.reshape(-1).numpy()
    a = np.asarray(x)
    if a.dtype != np.uint8:
        raise ValueError(f"{what} must be uint8, got {a.dtype}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{what} must be contiguous")
    return a.reshape(-1)


def _np_u16(x, what: str) -> np.ndarray:
    if _is_torch(x):
        import torch

        if x.dtype not in (torch.bfloat16, torch.uint16, torch.int16):
            raise ValueError(f"{what} must be bfloat16 or uint16, got {x.dtype}")
        x = x.detach()
        if not x.is_contiguous():
            raise ValueError(f"{what} must be contiguous")
        return x.reshape(-1).view(torch.int16).numpy().view(np.uint16)
    a = np.asarray(x)
    if a.dtype not in (np.uint16, np.int16) and a.dtype.name != "bfloat16":
        raise ValueError(f"{what} must be uint16 or bfloat16, got {a.dtype}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{what} must be contiguous")
    return a.reshape(-1).view(np.uint16)


def _device_type(x) -> str:
    return x.device.type if _is_torch(x) else "cpu"


def merge(exp, sm, out):
    """Merge exponent bytes and sign-mantissa bytes into ``out`` (in place); returns ``out``."""
    kinds = {_device_type(exp), _device_type(sm), _device_type(out)}
    if kinds == {"cpu"}:
        o = _np_u16(out, "out")
        cpu.merge_into(_np_u8(exp, "exp"), _np_u8(sm, "sm"), o)
        return out
    if kinds == {"cuda"}:
        if _triton_importable():
            from .triton_merge import merge_cuda

            return merge_cuda(exp, sm, out)
        return _torch_merge(exp, sm, out)
    raise ValueError(f"exp, sm and out must be on one device (numpy counts as cpu), got {sorted(kinds)}")


_warned = False


def _torch_merge(exp, sm, out):
    """CUDA without triton: the same merge in torch ops (several passes, int32 temporaries)."""
    global _warned
    import torch

    if not _warned:
        import warnings

        warnings.warn("triton is not installed: merging CUDA tensors with plain torch ops (slower); "
                      "pip install 'zipmoe[triton]'", RuntimeWarning, stacklevel=3)
        _warned = True
    if exp.dtype != torch.uint8 or sm.dtype != torch.uint8:
        raise ValueError("exp and sm must be uint8")
    if out.dtype not in (torch.bfloat16, torch.uint16, torch.int16) or not out.is_contiguous():
        raise ValueError("out must be a contiguous bfloat16 or uint16 tensor")
    if exp.numel() != out.numel() or sm.numel() != out.numel():
        raise ValueError("exp, sm and out must have the same number of elements")
    e = exp.reshape(-1).to(torch.int32)
    s = sm.reshape(-1).to(torch.int32)
    u = ((s & 0x80) << 8) | (e << 7) | (s & 0x7F)
    out.reshape(-1).view(torch.int16).copy_(u.to(torch.int16))
    return out


def split(u, exp_out, sm_out) -> None:
    """Split bf16/uint16 ``u`` into uint8 ``exp_out`` and ``sm_out`` (same devices rule as merge)."""
    kinds = {_device_type(u), _device_type(exp_out), _device_type(sm_out)}
    if kinds == {"cpu"}:
        cpu.split_into(_np_u16(u, "u"), _np_u8(exp_out, "exp_out"), _np_u8(sm_out, "sm_out"))
        return
    if kinds == {"cuda"}:
        import torch

        if _triton_importable():
            from .triton_merge import split_triton

            with torch.cuda.device(u.device):
                split_triton(u, exp_out, sm_out)
            return
        ui = u.reshape(-1).view(torch.int16).to(torch.int32) & 0xFFFF
        exp_out.reshape(-1).copy_(((ui >> 7) & 0xFF).to(torch.uint8))
        sm_out.reshape(-1).copy_((((ui >> 8) & 0x80) | (ui & 0x7F)).to(torch.uint8))
        return
    raise ValueError(f"u, exp_out and sm_out must be on one device, got {sorted(kinds)}")
