"""Write safetensors files as a stream, and :func:`unpack` a .zmoe back into a model folder.

:class:`SafetensorsWriter` writes the header first (all names, dtypes and shapes are known from
the container's index), then each tensor's bytes in order, possibly in several parts, so no
more than one tensor (or one expert slice) is in memory. The files it writes are ordinary
safetensors: 8-byte little-endian header length, JSON header padded with spaces to a multiple
of 8, then the data buffer with tensors in header order and no gaps.

:func:`unpack` restores a folder that transformers loads like the source: the same tensor
names, bit-identical bytes (fused tensors reassembled from their per-expert entries), shards of
at most ``max_shard_bytes`` with ``model.safetensors.index.json`` when there is more than one,
and the embedded config/tokenizer/generation files.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from zipmoe.errors import ContainerError, OutOfSpaceError, UsageError, ZipmoeError

from . import format as fmt
from .index_read import is_plain_name
from .reader import ContainerReader

INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 2_000_000_000
_SPACE_ERRNOS = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC), errno.EFBIG}


def _space(exc: OSError, where) -> ZipmoeError:
    if exc.errno in _SPACE_ERRNOS:
        return OutOfSpaceError(f"no space left on the device while writing {where}; the partial output was removed")
    return ZipmoeError(f"cannot write {where}: {exc.strerror or exc}")


class SafetensorsWriter:
    """Stream tensors into one safetensors file, in the order they were declared.

    ``tensors`` is a list of ``(name, dtype, shape)``; call :meth:`write` with each tensor's
    bytes (in one or several parts, in order), then :meth:`close`.
    """

    def __init__(self, path, tensors: list, metadata: dict | None = None):
        self.path = Path(path)
        header: dict = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        pos = 0
        self._plan: list[tuple[str, int]] = []
        for name, dtype, shape in tensors:
            n = int(np.prod(shape, dtype=np.int64)) * fmt.DTYPE_SIZES[dtype]
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + n]}
            self._plan.append((name, n))
            pos += n
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)
        self.data_bytes = pos
        self._k = 0
        self._left = self._plan[0][1] if self._plan else 0
        try:
            self._f = open(self.path, "wb")
            self._f.write(len(raw).to_bytes(8, "little"))
            self._f.write(raw)
        except OSError as exc:
            raise _space(exc, self.path) from None

    def write(self, name: str, data) -> None:
        """Append bytes of tensor ``name`` (must be the current tensor of the declared order)."""
        while self._k < len(self._plan) and self._left == 0 and self._plan[self._k][0] != name:
            self._k += 1
            self._left = self._plan[self._k][1] if self._k < len(self._plan) else 0
        if self._k >= len(self._plan) or self._plan[self._k][0] != name:
            raise ValueError(f"{name} is not the next tensor of {self.path.name}")
        mv = memoryview(data).cast("B")
        if len(mv) > self._left:
            raise ValueError(f"too many bytes for tensor {name}")
        try:
            self._f.write(mv)
        except OSError as exc:
            raise _space(exc, self.path) from None
        self._left -= len(mv)

    def close(self) -> None:
        """Check that every declared byte was written; flush and fsync."""
        try:
            if self._left or any(n for _, n in self._plan[self._k + 1:]):
                raise ValueError(f"{self.path.name}: not every tensor was written")
            self._f.flush()
            os.fsync(self._f.fileno())
        except OSError as exc:
            raise _space(exc, self.path) from None
        finally:
            self._f.close()

    def abort(self) -> None:
        try:
            self._f.close()
        except OSError:
            pass


# ============================================================================ unpack


@dataclass
class SourceTensorPlan:
    """One tensor of the restored checkpoint and the container entries that hold it."""

    name: str
    dtype: str
    shape: tuple
    nbytes: int
    parts: list  # TensorEntry, in fused_index order


def plan_tensors(entries: list) -> list[SourceTensorPlan]:
    """Group entries by source tensor (fused ones reassembled), in source order."""
    groups: dict[str, list] = {}
    for e in entries:
        groups.setdefault(e.name, []).append(e)
    plans = []
    for name, es in groups.items():
        first = es[0]
        if first.fused_index is None:
            if len(es) != 1:
                raise ContainerError(f"tensor {name} appears {len(es)} times in the index")
            plans.append(SourceTensorPlan(name, first.dtype, first.source_shape, first.nbytes, es))
            continue
        es = sorted(es, key=lambda e: e.fused_index)
        E = first.source_shape[0] if first.source_shape else 0
        if [e.fused_index for e in es] != list(range(E)) or any(e.fused_index is None for e in es):
            raise ContainerError(f"fused tensor {name}: the index does not hold experts 0..{E - 1} exactly once")
        plans.append(SourceTensorPlan(name, first.dtype, first.source_shape, sum(e.nbytes for e in es), es))
    plans.sort(key=lambda p: (p.parts[0].source_index, p.name))
    return plans


def shard_plan(plans: list, max_shard_bytes: int) -> list[list]:
    shards: list[list] = [[]]
    size = 0
    for p in plans:
        if shards[-1] and size + p.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(p)
        size += p.nbytes
    return shards


@dataclass
class UnpackSummary:
    out_dir: Path
    tensors: int
    files: list
    shards: int
    bytes: int
    seconds: float


def _dir_nonempty(p: Path) -> bool:
    return p.is_dir() and any(p.iterdir())


def unpack(container_path, out_dir, force: bool = False, workers: int | None = None,
           max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
           progress: Callable[[int, int], None] | None = None) -> UnpackSummary:
    """Restore a model folder from a .zmoe (see the module docstring)."""
    from zipmoe.machine import pack_workers

    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError(f"{out_dir} exists and is not a folder")
    if _dir_nonempty(out_dir) and not force:
        raise UsageError(f"{out_dir} is not empty: pass --force to write into it")
    parent = out_dir.parent if str(out_dir.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"{parent}: no such folder for the output")
    workers = workers or pack_workers()
    with ContainerReader(container_path) as r:
        plans = plan_tensors(r.entries)
        shards = shard_plan(plans, max_shard_bytes)
        total = sum(p.nbytes for p in plans)
        from .tempfiles import remove_stale, unpack_temp

        remove_stale(parent, out_dir.name)  # what an unpack killed outright left behind
        tmp = unpack_temp(out_dir, parent)
        try:
            tmp.mkdir()
        except OSError as exc:
            raise _space(exc, tmp) from None
        written: list[str] = []
        try:
            names = (["model.safetensors"] if len(shards) == 1 else
                     [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
            done = 0
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="zipmoe-unpack") as pool:
                for fname, shard in zip(names, shards):
                    w = SafetensorsWriter(tmp / fname, [(p.name, p.dtype, p.shape) for p in shard], {"format": "pt"})
                    written.append(fname)
                    try:
                        window: deque = deque()
                        parts = [(p.name, e) for p in shard for e in p.parts]
                        it = iter(parts)
                        for name, e in it:
                            window.append((name, pool.submit(r.decode_entry, e)))
                            if len(window) >= 2 * workers:
                                break
                        for nxt in it:
                            name, fut = window.popleft()
                            w.write(name, fut.result())
                            done += len(fut.result())
                            if progress:
                                progress(done, total)
                            window.append((nxt[0], pool.submit(r.decode_entry, nxt[1])))
                        while window:
                            name, fut = window.popleft()
                            w.write(name, fut.result())
                            done += len(fut.result())
                            if progress:
                                progress(done, total)
                        w.close()
                    except BaseException:
                        w.abort()
                        raise
            if len(shards) > 1:
                wm = {p.name: fname for fname, shard in zip(names, shards) for p in shard}
                doc = {"metadata": {"total_size": total}, "weight_map": wm}
                _write_small(tmp / INDEX_NAME, json.dumps(doc, indent=2).encode())
                written.append(INDEX_NAME)
            for name in r.files:
                if name.endswith(".safetensors") or name == INDEX_NAME or not is_plain_name(name):
                    raise ContainerError(f"{container_path}: embedded file name {name!r} would clash with the weights")
                _write_small(tmp / name, r.read_file(name))
                written.append(name)
            _install(tmp, out_dir, written)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return UnpackSummary(out_dir, len(plans), list(r.files), len(shards), total, time.perf_counter() - t0)


def _write_small(path: Path, data: bytes) -> None:
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise _space(exc, path) from None


def _install(tmp: Path, out_dir: Path, written: list[str]) -> None:
    """Move the finished files into ``out_dir`` (renaming the temp folder when possible)."""
    if not out_dir.exists():
        os.rename(tmp, out_dir)
        return
    if not _dir_nonempty(out_dir):
        out_dir.rmdir()
        os.rename(tmp, out_dir)
        return
    # --force into a non-empty folder: drop stale weights that would shadow the new ones.
    for old in list(out_dir.glob("*.safetensors")) + [out_dir / INDEX_NAME]:
        if old.is_file() and old.name not in written:
            old.unlink()
    for name in written:
        os.replace(tmp / name, out_dir / name)
    shutil.rmtree(tmp, ignore_errors=True)
