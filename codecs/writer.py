"""Write .zmoe containers (docs/format.md): :class:`ContainerWriter` and :func:`pack`.

:class:`ContainerWriter` takes tensors one at a time (``add_tensor``), hands the work on each
shard (split of bf16 values into exponent and sign-mantissa bytes, exponent histogram,
compression, checksum) to a thread pool, and writes finished tensors in the order they were
added. At most ``max_pending_bytes`` of source data are in flight (or one tensor, if larger),
so memory is bounded by the largest tensor, not by the checkpoint.

Dense entries are packed back to back and embedded files
follow each other without padding; the chunks of every entry go to the binary chunk table
before the index (format 1.1, docs/format.md 5.5 and 6). ``version="1.0"`` writes the older
layout (every extent and file aligned, chunks inline in the JSON) that 1.0 readers read.

The file is written under a temporary name in the destination folder; the header (with the
magic) is written last, then fsync and rename. Any exception, Ctrl-C included, removes the
temporary file; a full disk becomes :class:`~zipmoe.errors.OutOfSpaceError`.

:func:`pack` reads a checkpoint with :mod:`zipmoe.codecs.checkpoint`, classifies tensors with
:mod:`zipmoe.codecs.naming`, splits fused expert tensors into one entry per expert and feeds
the writer in (dense, then (layer, expert)) order.
"""

from __future__ import annotations

import collections
import errno
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from zipmoe.machine import pack_workers
from zipmoe.version import __version__
from zipmoe.errors import OutOfSpaceError, UsageError, ZipmoeError
from zipmoe.kernels.cpu import split_into

from . import format as fmt
from .index_read import is_plain_name
from .bitfield import entropy_from_counts, histogram_into
from .checksum import checksum
from .exponent import CODECS, compress_or_raw, get_codec

_SPACE_ERRNOS = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC), errno.EFBIG}
_PROJ_ORDER = {"gate": 0, "up": 1, "gate_up": 2, "down": 3}
_ZEROS = bytes(fmt.ALIGNMENT)
_FILE_CODEC = "zstd-fast"


@dataclass
class _Shard:
    codec: str
    data: bytes
    check: int
    raw_offset: int
    raw_length: int


@dataclass
class _Pending:
    entry: fmt.TensorEntry
    futures: list
    source_nbytes: int
    sm: np.ndarray | None = None
    counts: np.ndarray | None = None


@dataclass
class WriteStats:
    file_bytes: int = 0
    entries: int = 0
    bf16_bytes: int = 0
    bf16_stored_bytes: int = 0
    bound_bytes: float = 0.0
    other_bytes: int = 0
    other_stored_bytes: int = 0
    per_role: dict = field(default_factory=lambda: {r: {"bytes": 0, "stored_bytes": 0, "entries": 0} for r in ("expert", "dense")})


class ContainerWriter:
    """Stream tensors into a new .zmoe file. Use as a context manager (aborts on exceptions).

    ``add_tensor`` takes the tensor's bytes as a 1-D uint8 array (little-endian, as in
    safetensors); the writer keeps a reference until the tensor is written, so do not reuse it.
    ``finish(meta)`` writes files, index and header and renames into place.
    """

    def __init__(self, out_path, codec: str = "zstd", shard_size: int = fmt.DEFAULT_SHARD_SIZE,
                 workers: int | None = None, force: bool = False, max_pending_bytes: int = 256 << 20,
                 version: str = fmt.FORMAT_VERSION):
        self.out_path = Path(out_path)
        if version not in ("1.0", fmt.FORMAT_VERSION):
            raise UsageError(f"format version must be 1.0 or {fmt.FORMAT_VERSION}, got {version}")
        self.version = version
        self._packed = version != "1.0"  # 1.1: dense extents and files back to back
        self._prev_dense = False
        self.codec = get_codec(codec)
        if shard_size < 1 or shard_size >= 1 << 31:
            raise UsageError(f"shard size must be between 1 byte and 2 GiB, got {shard_size}")
        self.shard_size = int(shard_size)
        self.workers = workers or pack_workers()
        if self.workers < 1:
            raise UsageError(f"--workers must be at least 1, got {workers}")
        self.force = force
        self.max_pending_bytes = max_pending_bytes
        self.stats = WriteStats()
        self._entries: list[fmt.TensorEntry] = []
        self._files: list[fmt.FileEntry] = []
        self._pending: collections.deque[_Pending] = collections.deque()
        self._pending_bytes = 0
        self._file_codec = CODECS[_FILE_CODEC]
        self._check_destination()
        from .tempfiles import pack_temp, remove_stale

        self.stale_removed = remove_stale(self.out_path.parent, self.out_path.name)
        self.tmp_path = pack_temp(self.out_path)
        self._fd: int | None = None
        self._pos = 0
        self._done = False
        self._pool: ThreadPoolExecutor | None = None
        try:
            self._fd = os.open(self.tmp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as exc:
            if exc.errno in _SPACE_ERRNOS:
                raise OutOfSpaceError(f"no space left on the device to create {self.out_path}") from None
            raise ZipmoeError(f"cannot create {self.out_path}: {exc.strerror or exc}") from None
        try:
            self._write(_ZEROS)  # header placeholder (zero: no magic until finish) + padding
        except BaseException:
            self.abort()
            raise
        self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="zipmoe-pack")

    # -------------------------------------------------------------------------- destination
    def _check_destination(self) -> None:
        out = self.out_path
        if out.is_dir():
            raise UsageError(f"{out} is a folder: give a file name for the .zmoe output, e.g. {out / 'model.zmoe'}")
        if not out.parent.is_dir():
            raise UsageError(f"{out.parent}: no such folder for the output")
        if (out.exists() or out.is_symlink()) and not self.force:
            raise UsageError(f"{out} already exists: pass --force to overwrite it")

    # -------------------------------------------------------------------------- low-level I/O
    def _write(self, data) -> None:
        """Append ``data`` at the current position (the one place that writes tensor bytes)."""
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            try:
                done += os.write(self._fd, view[done:])
            except OSError as exc:
                if exc.errno in _SPACE_ERRNOS:
                    raise OutOfSpaceError(
                        f"no space left on the device while writing {self.out_path} "
                        f"({self._pos + done} bytes written); the partial file was removed") from None
                raise
        self._pos += len(view)

    def _pad(self) -> None:
        n = fmt.align_up(self._pos) - self._pos
        if n:
            self._write(_ZEROS[:n])

    # -------------------------------------------------------------------------- tensors
    def add_tensor(self, name: str, dtype: str, shape, data: np.ndarray, *, role: str = "dense",
                   layer: int | None = None, expert: int | None = None, proj: str | None = None,
                   fused_index: int | None = None, source_shape=None, source_index: int = 0) -> None:
        """Queue one tensor (or one expert slice of a fused tensor) for writing."""
        if self._done or self._pool is None:
            raise RuntimeError("writer is closed")
        if dtype not in fmt.DTYPE_SIZES:
            raise ZipmoeError(f"tensor {name}: unsupported dtype {dtype}")
        data = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        shape = tuple(int(s) for s in shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * fmt.DTYPE_SIZES[dtype]
        if data.shape[0] != nbytes:
            raise ValueError(f"tensor {name}: {data.shape[0]} bytes for {dtype} {shape}")
        entry = fmt.TensorEntry(name, dtype, shape, role, layer, expert, proj, fused_index,
                                tuple(source_shape) if source_shape is not None else shape,
                                (0, 0), [], nbytes, source_index)
        pend = _Pending(entry, [], nbytes)
        S = self.shard_size
        if dtype == "BF16" and nbytes:
            n = nbytes // 2
            u16 = data.view(np.uint16)
            exp = np.empty(n, np.uint8)
            pend.sm = np.empty(n, np.uint8)
            pend.counts = np.zeros((max(1, (n + S - 1) // S), 256), np.int64)
            for k, a in enumerate(range(0, n, S)):
                b = min(n, a + S)
                pend.futures.append(self._pool.submit(self._bf16_shard, u16[a:b], exp[a:b], pend.sm[a:b], pend.counts[k], a))
        else:
            for a in range(0, nbytes, S):
                b = min(nbytes, a + S)
                pend.futures.append(self._pool.submit(self._data_shard, data[a:b], a))
        self._pending.append(pend)
        self._pending_bytes += nbytes
        while self._pending and (self._pending_bytes > self.max_pending_bytes or len(self._pending) > 4 * self.workers + 8):
            self._flush_one()

    def _bf16_shard(self, u16, exp, sm, counts, raw_offset) -> _Shard:
        split_into(u16, exp, sm)
        histogram_into(exp, counts)
        codec, out = compress_or_raw(self.codec, exp)
        return _Shard(codec, out, checksum(out), raw_offset, exp.shape[0])

    def _data_shard(self, data, raw_offset) -> _Shard:
        codec, out = compress_or_raw(self._file_codec, data)
        return _Shard(codec, out, checksum(out), raw_offset, data.shape[0])

    def _flush_one(self) -> None:
        pend = self._pending.popleft()
        self._pending_bytes -= pend.source_nbytes
        shards: list[_Shard] = [f.result() for f in pend.futures]
        e = pend.entry
        packed = self._packed and e.role == "dense"
        if not (packed and self._prev_dense):
            self._pad()
        self._prev_dense = packed
        start = self._pos
        for s in shards:
            e.chunks.append(fmt.Chunk("exp" if e.dtype == "BF16" else "data", self._pos, len(s.data),
                                      s.raw_offset, s.raw_length, s.codec, s.check))
            self._write(s.data)
        if pend.sm is not None:
            e.chunks.append(fmt.Chunk("sm", self._pos, pend.sm.shape[0], 0, pend.sm.shape[0], "raw", checksum(pend.sm)))
            self._write(pend.sm)
        e.extent = (start, self._pos - start)
        self._entries.append(e)
        st = self.stats
        st.entries += 1
        stored = self._pos - start
        role = st.per_role.setdefault(e.role, {"bytes": 0, "stored_bytes": 0, "entries": 0})
        role["bytes"] += e.nbytes
        role["stored_bytes"] += stored
        role["entries"] += 1
        if e.dtype == "BF16":
            st.bf16_bytes += e.nbytes
            st.bf16_stored_bytes += stored
            if pend.counts is not None:
                n = e.nbytes // 2
                st.bound_bytes += n * (8.0 + entropy_from_counts(pend.counts.sum(axis=0))) / 8.0
        else:
            st.other_bytes += e.nbytes
            st.other_stored_bytes += stored

    def flush(self) -> None:
        while self._pending:
            self._flush_one()

    # -------------------------------------------------------------------------- files, finish
    def add_file(self, name: str, data: bytes) -> None:
        """Embed a small file (config.json, tokenizer files, ...) under a plain file name."""
        if not is_plain_name(name):
            raise ValueError(f"embedded file name must be a plain file name: {name!r}")
        self._files.append(fmt.FileEntry(name, 0, 0, len(data), "", 0))
        self._files[-1]._data = bytes(data)  # written in finish(), after the tensors

    def finish(self, meta: dict) -> WriteStats:
        """Write files, index and header; fsync; rename into place. Returns the statistics."""
        try:
            self.flush()
            for k, f in enumerate(self._files):
                codec, stored = compress_or_raw(self._file_codec, f._data)
                if k == 0 or not self._packed:
                    self._pad()
                f.offset, f.length, f.codec, f.checksum = self._pos, len(stored), codec, checksum(stored)
                self._write(stored)
                del f._data
            self._pad()
            table = None
            if self._packed:
                raw_table = fmt.chunk_table_bytes(self._entries)
                table = {"offset": self._pos, "count": len(raw_table) // fmt.CHUNK_RECORD.itemsize,
                         "checksum": checksum(raw_table)}
                self._write(raw_table)
                self._pad()
            index_offset = self._pos
            full_meta = {"format_version": self.version, "created_by": f"zipmoe {__version__}",
                         "codec": self.codec.id, "shard_size": self.shard_size, "alignment": fmt.ALIGNMENT}
            full_meta.update(meta)
            full_meta.setdefault("totals", {
                "bf16_bytes": self.stats.bf16_bytes, "bf16_stored_bytes": self.stats.bf16_stored_bytes,
                "bound_bytes": int(round(self.stats.bound_bytes)), "other_bytes": self.stats.other_bytes,
                "other_stored_bytes": self.stats.other_stored_bytes})
            raw_index = fmt.index_to_bytes(fmt.Index(full_meta, self._entries, self._files), table)
            self._write(raw_index)
            header = fmt.pack_header(index_offset, len(raw_index), checksum(raw_index),
                                     minor=int(self.version.split(".")[1]))
            self._pwrite_header(header)
            self._fsync()
            os.close(self._fd)
            self._fd = None
            if self.out_path.exists() and not self.force:
                raise UsageError(f"{self.out_path} appeared while packing: pass --force to overwrite it")
            os.replace(self.tmp_path, self.out_path)
            self._done = True
            self._fsync_dir()
            self.stats.file_bytes = self._pos
            return self.stats
        except BaseException:
            self.abort()
            raise
        finally:
            self._shutdown_pool()

    def _pwrite_header(self, header: bytes) -> None:
        try:
            os.pwrite(self._fd, header, 0)
        except OSError as exc:
            if exc.errno in _SPACE_ERRNOS:
                raise OutOfSpaceError(f"no space left on the device while writing {self.out_path}; the partial file was removed") from None
            raise

    def _fsync(self) -> None:
        try:
            os.fsync(self._fd)
        except OSError as exc:
            if exc.errno in _SPACE_ERRNOS:
                raise OutOfSpaceError(f"no space left on the device while writing {self.out_path}; the partial file was removed") from None
            raise

    def _fsync_dir(self) -> None:
        try:
            dfd = os.open(self.out_path.parent, os.O_RDONLY)
        except OSError:  # pragma: no cover - e.g. platforms without directory fds
            return
        try:
            os.fsync(dfd)
        except OSError:  # pragma: no cover
            pass
        finally:
            os.close(dfd)

    def _shutdown_pool(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def abort(self) -> None:
        """Stop, drop pending work and remove the temporary file (idempotent)."""
        self._pending.clear()
        self._shutdown_pool()
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None
        if not self._done:
            try:
                os.unlink(self.tmp_path)
            except FileNotFoundError:
                pass
        self._done = True

    def __enter__(self) -> "ContainerWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None or not self._done:
            self.abort()


# ============================================================================ pack()


@dataclass
class PackSummary:
    """What :func:`pack` did. Sizes in bytes; ``bound_bytes`` is Σ per bf16 entry of
    ``nbytes · (8 + H(exp)) / 16``."""

    out_path: Path
    codec: str
    shard_size: int
    workers: int
    source_bytes: int
    file_bytes: int
    bf16_bytes: int
    bf16_stored_bytes: int
    bound_bytes: float
    other_bytes: int
    other_stored_bytes: int
    seconds: float
    num_tensors: int
    num_entries: int
    num_expert_entries: int
    num_experts: int | None
    fused_tensors: int
    dense_only: bool
    per_role: dict
    stale_removed: list = field(default_factory=list)  # leftovers of interrupted packs removed first

    @property
    def ratio(self) -> float:
        """File bytes / source tensor bytes."""
        return self.file_bytes / self.source_bytes if self.source_bytes else 0.0

    @property
    def bf16_ratio(self) -> float:
        return self.bf16_stored_bytes / self.bf16_bytes if self.bf16_bytes else 0.0

    @property
    def bound_ratio(self) -> float:
        return self.bound_bytes / self.bf16_bytes if self.bf16_bytes else 0.0

    @property
    def throughput(self) -> float:
        """Source bytes per second."""
        return self.source_bytes / self.seconds if self.seconds > 0 else 0.0


@dataclass
class _Item:
    st: object  # SourceTensor
    source_index: int
    role: str
    layer: int | None
    expert: int | None
    proj: str | None
    fused_index: int | None
    start: int
    length: int
    shape: tuple

    def order(self):
        if self.role == "dense":
            return (0, self.source_index, 0, 0, 0, 0)
        return (1, -1 if self.layer is None else self.layer, -1 if self.expert is None else self.expert,
                _PROJ_ORDER.get(self.proj, 9), self.source_index, self.fused_index or 0)


def plan_items(ckpt) -> list[_Item]:
    """One item per entry to write, in file order (dense in source order, then experts), with
    the metadata :func:`zipmoe.codecs.metadata.derive` gives each name (what readers check)."""
    from .metadata import derive

    items: list[_Item] = []
    for i, st in enumerate(ckpt.tensors):
        d = derive(st.name, tuple(st.shape), ckpt.config)
        if d.fused is not None:
            E = d.fused
            per = st.nbytes // E
            for e in range(E):
                items.append(_Item(st, i, "expert", d.layer, e, d.proj, e, e * per, per, tuple(st.shape[1:])))
        else:
            items.append(_Item(st, i, d.role, d.layer, d.expert, d.proj, None, 0, st.nbytes, tuple(st.shape)))
    items.sort(key=_Item.order)
    return items


def _cfg_int(config: dict | None, *keys) -> int | None:
    if not config:
        return None
    for k in keys:
        v = config.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    tc = config.get("text_config")
    return _cfg_int(tc, *keys) if isinstance(tc, dict) else None


def model_meta(ckpt, items: list[_Item], num_experts_fn) -> dict:
    cfg = ckpt.config or {}
    archs = cfg.get("architectures")
    layers = {it.layer for it in items if it.layer is not None}
    experts = {it.expert for it in items if it.role == "expert" and it.expert is not None}
    return {
        "architecture": archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None,
        "model_type": cfg.get("model_type") if isinstance(cfg.get("model_type"), str) else None,
        "family": cfg.get("model_type") if isinstance(cfg.get("model_type"), str) else None,
        "num_layers": _cfg_int(cfg, "num_hidden_layers", "n_layer", "num_layers") or (max(layers) + 1 if layers else None),
        "num_experts": num_experts_fn(cfg) or (max(experts) + 1 if experts else None),
        "top_k": _cfg_int(cfg, "num_experts_per_tok", "num_experts_per_token", "moe_top_k", "top_k", "num_selected_experts"),
    }


def pack(checkpoint_path, out_path, codec: str = "zstd", shard_size: int = fmt.DEFAULT_SHARD_SIZE,
         workers: int | None = None, force: bool = False,
         progress: Callable[[int, int], None] | None = None, version: str = fmt.FORMAT_VERSION) -> PackSummary:
    """Pack a checkpoint folder (or .safetensors file, or hub repo id) into ``out_path`` (.zmoe).

    ``version="1.0"`` writes the older layout (for readers that have not been updated, and for
    the size comparisons of benchmarks/container_size.py).

    ``progress(done_bytes, total_bytes)`` is called after each tensor is queued. Raises
    :class:`~zipmoe.errors.ZipmoeError` subclasses for everything a user can cause.
    """
    from .checkpoint import open_checkpoint
    from .naming import num_experts

    t0 = time.perf_counter()
    get_codec(codec)
    out_path = Path(out_path)
    with open_checkpoint(checkpoint_path) as ckpt:
        src_files = {Path(f).resolve() for f in ckpt.files}
        if out_path.resolve() in src_files or out_path.resolve() in {Path(p).resolve() for p in ckpt.extra_files.values()}:
            raise UsageError(f"{out_path} is part of the source checkpoint: choose another output name")
        items = plan_items(ckpt)
        total = sum(it.length for it in items)
        n_expert_entries = sum(1 for it in items if it.role == "expert")
        fused = len({it.source_index for it in items if it.fused_index is not None})
        layout = "fused" if fused else ("split" if n_expert_entries else "dense")
        meta = {
            "model": model_meta(ckpt, items, num_experts),
            "source": {"name": ckpt.source_name, "num_tensors": len(ckpt.tensors),
                       "total_bytes": ckpt.total_bytes, "files": [Path(f).name for f in ckpt.files],
                       "layout": layout},
        }
        with ContainerWriter(out_path, codec, shard_size, workers, force, version=version) as w:
            done = 0
            for it in items:
                data = ckpt.read(it.st, it.start, it.length)
                w.add_tensor(it.st.name, it.st.dtype, it.shape, data, role=it.role, layer=it.layer,
                             expert=it.expert, proj=it.proj, fused_index=it.fused_index,
                             source_shape=it.st.shape, source_index=it.source_index)
                done += it.length
                if progress is not None:
                    progress(done, total)
            for name, path in sorted(ckpt.extra_files.items()):
                try:
                    w.add_file(name, Path(path).read_bytes())
                except OSError as exc:
                    raise ZipmoeError(f"{path}: cannot read: {exc.strerror or exc}") from None
            st = w.finish(meta)
    return PackSummary(
        out_path=out_path, codec=codec, shard_size=w.shard_size, workers=w.workers,
        source_bytes=ckpt.total_bytes, file_bytes=st.file_bytes, bf16_bytes=st.bf16_bytes,
        bf16_stored_bytes=st.bf16_stored_bytes, bound_bytes=st.bound_bytes, other_bytes=st.other_bytes,
        other_stored_bytes=st.other_stored_bytes, seconds=time.perf_counter() - t0,
        num_tensors=len(ckpt.tensors), num_entries=st.entries, num_expert_entries=n_expert_entries,
        num_experts=meta["model"]["num_experts"] if n_expert_entries else None, fused_tensors=fused,
        dense_only=n_expert_entries == 0, per_role=st.per_role, stale_removed=w.stale_removed)
