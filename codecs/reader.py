"""Read .zmoe containers (docs/format.md): :class:`ContainerReader` and the decode helpers.

Opening a file reads the 64-byte header, the index (and the 1.1 chunk table) and config.json
and validates them (magic, version, checksums, file size, every extent and chunk inside the data
region, sizes bounded before anything is allocated, known codecs, and every entry's metadata
against the naming rules: :func:`zipmoe.codecs.metadata.check_metadata`): a truncated,
corrupted, hostile or newer file raises :class:`~zipmoe.errors.ContainerError` naming what is
wrong, so every user of the reader (verify, unpack, the serving runtime) refuses it alike. Tensor data is read with ``pread`` (thread-safe, no file position) and each chunk's
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
from .index_read import index_from_bytes
from .checksum import checksum, container_id, verify_chunk
from .exponent import DecodeContext, get_codec, thread_context
from .format import Chunk, FileEntry, TensorEntry
from .metadata import check_metadata

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
            index = index_from_bytes(raw_index, self.header.index_offset, where, self.header.version_minor,
                                         self._pread)
            self._index_bytes = raw_index
            self.meta: dict = index.meta
            self.entries: list[TensorEntry] = index.entries
            self.file_entries: dict[str, FileEntry] = {f.name: f for f in index.files}
            self.files: list[str] = [f.name for f in index.files]
            self.container_id: str = container_id(raw_index)
            self._table_extent = index.table_extent
            self._config = None
            check_metadata(self.entries, self.config, self.meta, where)
        except BaseException:
            self.close()
            raise
        self._by_expert: dict[tuple, list[TensorEntry]] = defaultdict(list)
        for e in self.entries:
            if e.role == "expert":
                self._by_expert[(e.layer, e.expert)].append(e)

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

    verify_chunk = staticmethod(verify_chunk)

    # ------------------------------------------------------------------------ metadata
    @property
    def config(self) -> dict:
        """The model's config.json ({} when the source had none)."""
        if self._config is None:
            cfg = {}
            if "config.json" in self.file_entries:
                try:
                    cfg = json.loads(self.read_file("config.json"))
                except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
                    raise ContainerError(f"{self.path}: embedded config.json is not valid JSON: {exc}") from None
                if not isinstance(cfg, dict):
                    raise ContainerError(f"{self.path}: embedded config.json is not a JSON object")
            self._config = cfg
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

    def padding_ranges(self) -> list[tuple]:
        """(offset, length) of every byte the index does not describe (must all be zero)."""
        used = [(fmt.HEADER_SIZE, 0)]
        used += [e.extent for e in self.entries if e.extent[1]]
        used += [(f.offset, f.length) for f in self.file_entries.values()]
        if self._table_extent:
            used.append(self._table_extent)
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
