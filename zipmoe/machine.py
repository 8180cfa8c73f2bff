"""What this machine offers the other layers: its cores and its compute device, torch-free.

The one place for these rules (the command line sizes its defaults here without importing torch):

* :func:`cores`: the cores this process may run on (its CPU affinity, not the machine's count);
* :func:`cpu_model`: the CPU's name, as /proc/cpuinfo gives it;
* :func:`pack_workers`: threads for packing, verifying and unpacking (every core);
* :func:`decode_workers`: the serving runtime's decode workers (half the cores, at least 1);
* :func:`torch_threads`: the serving process's torch threads: the cores the decode workers leave;
* :func:`resolve_device`: ``auto``, ``cpu``, ``cuda`` or ``cuda:N`` to a device name, or one line
  (:class:`~zipmoe.errors.UsageError`, :class:`~zipmoe.errors.DeviceError`) saying why not.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

from .errors import DeviceError, UsageError

__all__ = ["cores", "cpu_model", "pack_workers", "decode_workers", "torch_threads", "resolve_device", "gpu_used_bytes"]


def cores() -> int:
    """The cores this process may run on (at least 1)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)  # pragma: no cover - not Linux


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo's ``model name``, ``Hardware`` or ``cpu model`` line;
    else what :mod:`platform` says)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def pack_workers() -> int:
    """Threads for packing, verifying and unpacking a container: every core."""
    return cores()


def decode_workers() -> int:
    """The serving runtime's decode workers: half the cores, at least 1."""
    return max(1, cores() // 2)


def torch_threads(workers: int) -> int:
    """Torch threads for the serving process: the cores the decode workers leave, at least 1."""
    return max(1, cores() - workers)


def resolve_device(device) -> str:
    """``auto`` (or None): ``cuda`` where a CUDA device is available, else ``cpu``; ``cpu``;
    ``cuda`` or ``cuda:N``, which must be available (:class:`DeviceError` otherwise). Anything
    else is a :class:`UsageError`. Accepts a ``torch.device`` too.

    While torch is not imported yet, a machine without an NVIDIA driver answers ``cpu`` for
    ``auto`` without importing it (torch takes seconds to import, the CLI's ``plan`` only needs
    the name).
    """
    name = str(device or "auto").lower()
    if name not in ("auto", "cpu", "cuda") and not (name.startswith("cuda:") and name[5:].isdigit()):
        raise UsageError(f"unknown device {device!r} (use auto, cpu or cuda)")
    if name == "cpu":
        return "cpu"
    if name == "auto" and "torch" not in sys.modules and not os.path.exists("/proc/driver/nvidia/version"):
        return "cpu"
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - a broken CUDA setup is no CUDA
        has_cuda = False
    if name == "auto":
        return "cuda" if has_cuda else "cpu"
    if not has_cuda:
        raise DeviceError(f"--device {name} was asked for, but no CUDA device is available here (use --device cpu)")
    return name


def gpu_used_bytes(torch, index: int = 0) -> int:
    """Device memory in use on CUDA device ``index``, every allocator's (``torch`` passed in: this
    module does not import it). MoE-Infinity allocates outside torch's allocator, so torch's own
    peak would not see its memory."""
    free, total = torch.cuda.mem_get_info(index)
    return int(total - free)
