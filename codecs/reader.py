"""Read .zmoe containers (docs/format.md): :class:`ContainerReader` and the decode helpers.

Opening a file reads the 64-byte header and the index and validates both (magic, version,
checksums, file size, every extent and chunk inside the data region, known codecs): a
truncated, corrupted or newer file raises :class:`~zipmoe.errors.ContainerError` naming what
is wrong. Tensor data is read with ``pread`` (thread-safe, no file position) and each chunk's
checksum is checked before it is decoded.

Decoding writes into caller-provided buffers; pass one :class:`DecodeContext` per thread
(``ctx=None`` uses the calling thread's own).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import numpy as np

from zipmoe.errors import ChecksumError, ContainerError
from zipmoe.kernels.cpu import merge_into

from . import format as fmt
from .checksum import checksum, container_id, verify_chunk
from .exponent import DecodeContext, get_codec, thread_context
from .format import Chunk, FileEntry, TensorEntry

__all__ = ["ContainerReader", "TensorEntry", "Chunk", "FileEntry", "DecodeContext",
           "decode_exp_into", "decode_chunks_into", "verify_chunk"]


def decode_chunks_into(entry: TensorEntry, chunks: list, stored, base: int, out: np.ndarray,
                       ctx: DecodeContext | None = None, verify: bool = True) -> None:
    """Decode ``chunks`` of ``entry`` (all of one stream) from ``stored`` into ``out``.

    ``stored`` holds file bytes starting at file offset ``base``; each chunk's decoded bytes go
    to ``out[raw_offset : raw_offset + raw_length]``.
    """
    ctx = ctx or thread_context()
    mv = memoryview(stored)
    for c in chunks:
        a = c.offset - base
        if a < 0 or a + c.length > len(mv):
            raise ContainerError(f"tensor {entry.name}: chunk outside the bytes given")
        src = mv[a:a + c.length]
        if verify:
            verify_chunk(c, src, entry.name, next(i for i, x in enumerate(entry.chunks) if x is c))
        get_codec(c.codec).decompress_into(src, out[c.raw_offset:c.raw_offset + c.raw_length], ctx)


def decode_exp_into(entry: TensorEntry, stored_exp, exp_out: np.ndarray, ctx: DecodeContext | None = None,
                    verify: bool = True) -> None:
    """Decode a bf16 entry's E chunks; ``stored_exp`` is their concatenation as stored.

    ``exp_out`` is a uint8 array of ``entry.numel`` bytes (the runtime's preallocated buffer).
    """
    exp_chunks = entry.chunks_of("exp")
    if not exp_chunks:
        return
    decode_chunks_into(entry, exp_chunks, stored_exp, exp_chunks[0].offset, exp_out, ctx, verify)


_NP_DTYPES = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8,
              "I16": np.int16, "I32": np.int32, "I64": np.int64, "U8": np.uint8, "U16": np.uint16,
              "U32": np.uint32, "U64": np.uint64, "BOOL": np.bool_}


class ContainerReader:
    """An opened .zmoe file. Thread-safe reads; decode with one DecodeContext per thread."""

    def __init__(self, path):
        self.path = Path(path)
        where = str(self.path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise ContainerError(f"{where}: no such file") from None
        except IsADirectoryError:
            raise ContainerError(f"{where} is a folder, not a .zmoe file") from None
        except OSError as exc:
            raise ContainerError(f"{where}: cannot open: {exc.strerror or exc}") from None
        try:
            self.file_size = os.fstat(self._fd).st_size
            head = os.pread(self._fd, fmt.HEADER_SIZE, 0)
            self.header = fmt.parse_header(head, self.file_size, where)
            raw_index = self._pread(self.header.index_offset, self.header.index_length)
            if checksum(raw_index) != self.header.index_checksum:
                raise ContainerError(f"{where} is corrupted: index checksum mismatch")
            index = fmt.index_from_bytes(raw_index, self.header.index_offset, where)
        except BaseException:
            self.close()
            raise
        self._index_bytes = raw_index
        self.meta: dict = index.meta
        self.entries: list[TensorEntry] = index.entries
        self.file_entries: dict[str, FileEntry] = {f.name: f for f in index.files}
        self.files: list[str] = [f.name for f in index.files]
        self.container_id: str = container_id(raw_index)
        self._by_expert: dict[tuple, list[TensorEntry]] = defaultdict(list)
        for e in self.entries:
            if e.role == "expert":
                self._by_expert[(e.layer, e.expert)].append(e)
        self._config = None

    # ------------------------------------------------------------------------ raw access
    def _pread(self, offset: int, length: int) -> bytes:
        parts, done = [], 0
        while done < length:
            b = os.pread(self._fd, length - done, offset + done)
            if not b:
                raise ContainerError(f"{self.path} is truncated (end of file at {offset + done})")
            parts.append(b)
            done += len(b)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def read_range(self, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset`` (pread)."""
        if self._fd is None:
            raise ContainerError(f"{self.path} is closed")
        return self._pread(offset, length) if length else b""

    def read_into(self, offset: int, out: np.ndarray) -> np.ndarray:
        """pread ``len(out)`` bytes at ``offset`` into a 1-D uint8 array."""
        view, done, n = memoryview(out), 0, out.shape[0]
        while done < n:
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got == 0:
                raise ContainerError(f"{self.path} is truncated (end of file at {offset + done})")
            done += got
        return out

    verify_chunk = staticmethod(verify_chunk)

    # ------------------------------------------------------------------------ metadata
    @property
    def config(self) -> dict:
        """The model's config.json ({} when the source had none)."""
        if self._config is None:
            self._config = json.loads(self.read_file("config.json")) if "config.json" in self.file_entries else {}
        return self._config

    def read_file(self, name: str) -> bytes:
        """An embedded file's bytes (checksum checked)."""
        f = self.file_entries.get(name)
        if f is None:
            raise ContainerError(f"{self.path} has no embedded file {name!r}")
        stored = self.read_range(f.offset, f.length)
        if checksum(stored) != f.checksum:
            raise ChecksumError(f"embedded file {name}: checksum mismatch")
        out = np.empty(f.raw_length, np.uint8)
        get_codec(f.codec).decompress_into(stored, out)
        return out.tobytes()

    def expert_entries(self, layer: int, expert: int) -> list[TensorEntry]:
        return list(self._by_expert.get((layer, expert), []))

    def expert_keys(self) -> list[tuple]:
        return sorted(self._by_expert, key=lambda k: (k[0] if k[0] is not None else -1, k[1] if k[1] is not None else -1))

    def dense_entries(self) -> list[TensorEntry]:
        return [e for e in self.entries if e.role == "dense"]

    # ------------------------------------------------------------------------ decoding
    def decode_entry(self, entry: TensorEntry, out: np.ndarray | None = None,
                     ctx: DecodeContext | None = None, stored=None) -> np.ndarray:
        """Decode one entry into ``out`` (uint8, ``entry.nbytes``; allocated when None).

        Returns the uint8 view of the tensor's bytes, little-endian as in safetensors (bf16
        merged). Every chunk's checksum is checked. ``stored`` may hold the extent's bytes
        already read.
        """
        ctx = ctx or thread_context()
        if out is None:
            out = np.empty(entry.nbytes, np.uint8)
        else:
            out = out.reshape(-1).view(np.uint8)
            if out.shape[0] != entry.nbytes:
                raise ValueError(f"out has {out.shape[0]} bytes, tensor {entry.name} has {entry.nbytes}")
        if entry.nbytes == 0:
            return out
        off, length = entry.extent
        if stored is None:
            stored = self.read_range(off, length)
        if entry.dtype == "BF16":
            n = entry.nbytes // 2
            exp = ctx.scratch("exp", n)
            exp_chunks = entry.chunks[:-1]
            decode_chunks_into(entry, exp_chunks, stored, off, exp, ctx)
            sm_chunk = entry.chunks[-1]
            a = sm_chunk.offset - off
            sm_src = memoryview(stored)[a:a + sm_chunk.length]
            verify_chunk(sm_chunk, sm_src, entry.name, len(entry.chunks) - 1)
            if sm_chunk.codec == "raw":
                sm = np.frombuffer(sm_src, np.uint8)
            else:
                sm = ctx.scratch("sm", n)
                get_codec(sm_chunk.codec).decompress_into(sm_src, sm, ctx)
            merge_into(exp, sm, out.view(np.uint16))
        else:
            decode_chunks_into(entry, entry.chunks, stored, off, out, ctx)
        return out

    def decode_array(self, entry: TensorEntry, ctx: DecodeContext | None = None) -> np.ndarray:
        """Convenience: the entry as a numpy array of its shape (BF16 as uint16)."""
        raw = self.decode_entry(entry, ctx=ctx)
        if entry.dtype not in _NP_DTYPES:
            return raw
        return raw.view(_NP_DTYPES[entry.dtype]).reshape(entry.shape)

    def padding_ranges(self) -> list[tuple]:
        """(offset, length) of every byte the index does not describe (must all be zero)."""
        used = [(fmt.HEADER_SIZE, 0)]
        used += [e.extent for e in self.entries if e.extent[1]]
        used += [(f.offset, f.length) for f in self.file_entries.values()]
        used.sort()
        gaps, pos = [], fmt.HEADER_SIZE
        for off, length in used:
            if off > pos:
                gaps.append((pos, off - pos))
            if off < pos and length:
                raise ContainerError(f"{self.path} is corrupted: overlapping extents at {off}")
            pos = max(pos, off + length)
        if self.header.index_offset > pos:
            gaps.append((pos, self.header.index_offset - pos))
        return gaps

    def check_padding(self) -> None:
        """Raise ContainerError if any padding byte is not zero (a flipped byte outside chunks)."""
        for off, length in self.padding_ranges():
            if any(self.read_range(off, length)):
                raise ContainerError(f"{self.path} is corrupted: non-zero padding bytes at offset {off}")

    # ------------------------------------------------------------------------ lifetime
    def close(self) -> None:
        fd, self._fd = getattr(self, "_fd", None), None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def __enter__(self) -> "ContainerReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # pragma: no cover
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"ContainerReader({str(self.path)!r}, {len(self.entries)} entries)"


# ============================================================================ verify


class VerifyReport:
    """What :func:`verify_container` checked."""

    def __init__(self) -> None:
        self.entries = 0
        self.bytes = 0
        self.files = 0
        self.compared = False
        self.seconds = 0.0


def verify_container(path, against=None, workers: int | None = None,
                     progress=None) -> VerifyReport:
    """Check every checksum, decode every entry, check padding; with ``against`` (a source
    checkpoint path) compare each tensor bit for bit. Raises at the first problem, in file
    order: :class:`ChecksumError` naming tensor and chunk, or :class:`ContainerError`.
    """
    import time
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    from zipmoe.machine import pack_workers

    t0 = time.perf_counter()
    rep = VerifyReport()
    workers = workers or pack_workers()
    ckpt = None
    if against is not None:
        from .checkpoint import open_checkpoint

        ckpt = open_checkpoint(against)
    try:
        with ContainerReader(path) as r:
            r.check_padding()
            for name in r.files:
                data = r.read_file(name)
                if ckpt is not None and name in ckpt.extra_files:
                    if Path(ckpt.extra_files[name]).read_bytes() != data:
                        raise ContainerError(f"embedded file {name} differs from the source")
                rep.files += 1
            if ckpt is not None:
                _check_coverage(r, ckpt)
            total = sum(e.nbytes for e in r.entries)

            def check(e: TensorEntry):
                out = r.decode_entry(e)
                if ckpt is not None:
                    _compare(e, out, ckpt)
                return e.nbytes

            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="zipmoe-verify") as pool:
                window: deque = deque()
                entries = iter(r.entries)
                while True:
                    while len(window) < 2 * workers:
                        e = next(entries, None)
                        if e is None:
                            break
                        window.append(pool.submit(check, e))
                    if not window:
                        break
                    rep.bytes += window.popleft().result()
                    rep.entries += 1
                    if progress:
                        progress(rep.bytes, total)
    finally:
        if ckpt is not None:
            ckpt.close()
    rep.compared = ckpt is not None
    rep.seconds = time.perf_counter() - t0
    return rep


def _label(e: TensorEntry) -> str:
    return f"{e.name} (expert {e.fused_index})" if e.fused_index is not None else e.name


def _check_coverage(r: ContainerReader, ckpt) -> None:
    from .safetensors_out import plan_tensors

    plans = {p.name: p for p in plan_tensors(r.entries)}
    for t in ckpt.tensors:
        p = plans.get(t.name)
        if p is None:
            raise ContainerError(f"tensor {t.name} of the source is missing from the container")
        if p.dtype != t.dtype or tuple(p.shape) != tuple(t.shape):
            raise ContainerError(f"tensor {t.name}: container has {p.dtype} {list(p.shape)}, source has {t.dtype} {list(t.shape)}")
    extra = set(plans) - {t.name for t in ckpt.tensors}
    if extra:
        raise ContainerError(f"tensor {sorted(extra)[0]} of the container is not in the source")


def _compare(e: TensorEntry, out: np.ndarray, ckpt) -> None:
    st = ckpt.tensor(e.name)
    start = e.fused_index * e.nbytes if e.fused_index is not None else 0
    src = ckpt.read(st, start, e.nbytes)
    if not np.array_equal(src, out):
        i = int(np.flatnonzero(src != out)[0])
        raise ContainerError(f"tensor {_label(e)} differs from the source at byte {i}")
