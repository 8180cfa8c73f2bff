"""The .zmoe v1 layout: constants, the fixed header, the index schema and the chunk table.

Everything here mirrors docs/format.md; section numbers refer to it. The writer builds
:class:`TensorEntry`/:class:`Chunk` objects and serialises them with :func:`index_to_bytes`
(and, for 1.1 files, :func:`chunk_table_bytes`); the reader parses and validates with
:func:`parse_header` and :func:`index_from_bytes`. Chunks are validated as arrays (one pass of
numpy over the whole table, whatever the version) and a tensor's :class:`Chunk` objects are
built only when something asks for ``entry.chunks``: an index of DeepSeek-V3's size (about
700,000 chunks) opens in a fraction of a second.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

import numpy as np

from zipmoe.errors import ContainerError

from .checksum import checksum, to_hex

MAGIC = b"ZMOE\r\n\x1a\n"
VERSION_MAJOR = 1
VERSION_MINOR = 1
FORMAT_VERSION = f"{VERSION_MAJOR}.{VERSION_MINOR}"
HEADER_SIZE = 64
ALIGNMENT = 4096
DATA_START = 4096
DEFAULT_SHARD_SIZE = 1 << 20
#: Limits checked before anything is allocated from a number in the file (section 4.1).
MAX_INDEX_BYTES = 1 << 30
MAX_FILE_BYTES = 1 << 30
MAX_DEPTH = 64
#: Largest decoded/stored ratio each codec can reach (zstd: a 4-byte RLE block per 128 KiB).
MAX_RATIO = {"raw": 1, "zstd": 65536, "zstd-fast": 65536, "lz4": 256, "lz4hc": 256}
RATIO_SLACK = 64
#: One record of the 1.1 chunk table (section 5.5).
CHUNK_RECORD = np.dtype([("offset", "<u8"), ("length", "<u8"), ("raw_offset", "<u8"), ("raw_length", "<u8"),
                         ("checksum", "<u8"), ("kind", "u1"), ("codec", "u1"), ("pad", "V6")])
assert CHUNK_RECORD.itemsize == 48

# magic, major, minor, header_size, alignment, index_offset, index_length, index_checksum, reserved
_HEADER = struct.Struct("<8sHHIQQQQQ")
assert _HEADER.size == 56
KINDS = ("exp", "sm", "data")
KNOWN_CODECS = ("raw", "zstd", "zstd-fast", "lz4", "lz4hc")

# safetensors dtype string -> bytes per element
DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8, "C64": 8,
}

def align_up(n: int, a: int = ALIGNMENT) -> int:
    return (n + a - 1) // a * a


# --------------------------------------------------------------------------- header (section 3)


@dataclass(frozen=True)
class Header:
    version_major: int
    version_minor: int
    index_offset: int
    index_length: int
    index_checksum: int
    header_size: int = HEADER_SIZE
    alignment: int = ALIGNMENT


def pack_header(index_offset: int, index_length: int, index_checksum: int, minor: int = VERSION_MINOR) -> bytes:
    body = _HEADER.pack(MAGIC, VERSION_MAJOR, minor, HEADER_SIZE, ALIGNMENT,
                        index_offset, index_length, index_checksum, 0)
    return body + struct.pack("<Q", checksum(body))


def parse_header(raw: bytes, file_size: int, where: str = "file") -> Header:
    """Checks 1-5 of docs/format.md section 4; raises ContainerError naming the problem."""
    if len(raw) < HEADER_SIZE or file_size < HEADER_SIZE:
        raise ContainerError(f"{where} is truncated: {file_size} bytes, shorter than the 64-byte .zmoe header")
    if raw[:8] != MAGIC:
        if raw[:8] == b"\0" * 8:
            raise ContainerError(f"{where} is not a complete .zmoe file (no header: an interrupted pack?)")
        raise ContainerError(f"{where} is not a .zmoe file (wrong magic bytes)")
    major, minor = struct.unpack_from("<HH", raw, 8)
    if major > VERSION_MAJOR:
        raise ContainerError(
            f"{where} was written by a newer zipmoe (format version {major}.{minor}); "
            f"this zipmoe reads {VERSION_MAJOR}.x: upgrade zipmoe")
    if major == 0:
        raise ContainerError(f"{where} has an invalid format version {major}.{minor}")
    (_, _, _, hsize, align, ioff, ilen, icheck, reserved) = _HEADER.unpack_from(raw, 0)
    (hcheck,) = struct.unpack_from("<Q", raw, 56)
    if checksum(raw[:56]) != hcheck:
        raise ContainerError(f"{where} is corrupted: header checksum mismatch")
    if hsize < HEADER_SIZE or align != ALIGNMENT or reserved != 0:
        raise ContainerError(f"{where} is corrupted: bad header fields (size {hsize}, alignment {align})")
    if ioff + ilen != file_size:
        if ioff + ilen > file_size:
            raise ContainerError(
                f"{where} is truncated: {file_size} bytes, the header says {ioff + ilen}")
        raise ContainerError(
            f"{where} has {file_size - ioff - ilen} unexpected bytes after the index (file size {file_size}, expected {ioff + ilen})")
    if ilen > MAX_INDEX_BYTES:
        raise ContainerError(f"{where} is corrupted or too large: its index claims {ilen} bytes, more than the "
                             f"{MAX_INDEX_BYTES >> 20} MiB a .zmoe index may have")
    if ioff < DATA_START or ilen == 0:
        raise ContainerError(f"{where} is corrupted: index at {ioff} (+{ilen}) is not after the data region")
    return Header(major, minor, ioff, ilen, icheck, hsize, align)


# --------------------------------------------------------------------------- index (section 5)

KIND_IDS = {k: i for i, k in enumerate(KINDS)}


@dataclass
class Chunk:
    """One stored chunk (docs/format.md 5.3). ``checksum`` is the XXH3-64 as an int."""

    kind: str
    offset: int
    length: int
    raw_offset: int
    raw_length: int
    codec: str
    checksum: int

    def to_json(self) -> dict:
        return {"kind": self.kind, "offset": self.offset, "length": self.length,
                "raw_offset": self.raw_offset, "raw_length": self.raw_length,
                "codec": self.codec, "checksum": to_hex(self.checksum)}


class ChunkTable:
    """Every chunk of a file as one array of :data:`CHUNK_RECORD` records (docs/format.md 5.5),
    with the codec names the records' codec numbers refer to."""

    __slots__ = ("records", "codecs")

    def __init__(self, records: np.ndarray, codecs: list):
        self.records = records
        self.codecs = list(codecs)

    def chunks(self, first: int, count: int) -> list:
        rec = self.records[first:first + count]
        kinds, codecs = KINDS, self.codecs
        return [Chunk(kinds[k], o, n, ro, rn, codecs[c], ck) for o, n, ro, rn, ck, k, c in zip(
            rec["offset"].tolist(), rec["length"].tolist(), rec["raw_offset"].tolist(),
            rec["raw_length"].tolist(), rec["checksum"].tolist(), rec["kind"].tolist(), rec["codec"].tolist())]


class TensorEntry:
    """One stored tensor, or one expert slice of a fused tensor (docs/format.md 5.2).

    ``chunks`` is a list of :class:`Chunk`; an entry read from a file builds it from the chunk
    table the first time it is asked for.
    """

    __slots__ = ("name", "dtype", "shape", "role", "layer", "expert", "proj", "fused_index", "source_shape",
                 "extent", "nbytes", "source_index", "_chunks", "_table", "_first", "_count")

    def __init__(self, name: str, dtype: str, shape: tuple, role: str, layer: int | None, expert: int | None,
                 proj: str | None, fused_index: int | None, source_shape: tuple, extent: tuple, chunks: list | None,
                 nbytes: int, source_index: int = 0):
        self.name, self.dtype, self.shape, self.role = name, dtype, shape, role
        self.layer, self.expert, self.proj, self.fused_index = layer, expert, proj, fused_index
        self.source_shape, self.extent, self.nbytes, self.source_index = source_shape, extent, nbytes, source_index
        self._chunks = chunks
        self._table: ChunkTable | None = None
        self._first = self._count = 0

    @property
    def chunks(self) -> list:
        if self._chunks is None:
            self._chunks = self._table.chunks(self._first, self._count) if self._table is not None else []
        return self._chunks

    @chunks.setter
    def chunks(self, value: list) -> None:
        self._chunks, self._table = value, None

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def chunks_of(self, kind: str) -> list:
        return [c for c in self.chunks if c.kind == kind]

    def to_json(self) -> dict:
        """The 1.0 index object (chunks inline)."""
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape),
             "nbytes": self.nbytes, "role": self.role, "layer": self.layer,
             "expert": self.expert, "proj": self.proj, "fused_index": self.fused_index,
             "source_shape": list(self.source_shape), "source_index": self.source_index,
             "extent": [self.extent[0], self.extent[1]], "chunks": [c.to_json() for c in self.chunks]}

    def __repr__(self) -> str:
        return (f"TensorEntry({self.name!r}, {self.dtype}, {list(self.shape)}, {self.role}, layer={self.layer}, "
                f"expert={self.expert}, proj={self.proj!r}, fused_index={self.fused_index}, extent={self.extent})")


@dataclass
class FileEntry:
    """An embedded file (docs/format.md 5.4): one chunk of its own."""

    name: str
    offset: int
    length: int
    raw_length: int
    codec: str
    checksum: int

    def to_json(self) -> dict:
        return {"name": self.name, "offset": self.offset, "length": self.length,
                "raw_length": self.raw_length, "codec": self.codec, "checksum": to_hex(self.checksum)}


@dataclass
class Index:
    meta: dict
    entries: list
    files: list = field(default_factory=list)
    table_extent: tuple | None = None  # (offset, length) of the 1.1 chunk table


def chunk_table_bytes(entries: list) -> bytes:
    """The 1.1 chunk table of ``entries`` (docs/format.md 5.5), records in entry order."""
    chunks = [c for e in entries for c in e.chunks]
    rec = np.zeros(len(chunks), CHUNK_RECORD)
    if chunks:
        codec_ids = {c: i for i, c in enumerate(KNOWN_CODECS)}
        rec["offset"] = [c.offset for c in chunks]
        rec["length"] = [c.length for c in chunks]
        rec["raw_offset"] = [c.raw_offset for c in chunks]
        rec["raw_length"] = [c.raw_length for c in chunks]
        rec["checksum"] = np.array([c.checksum for c in chunks], np.uint64)
        rec["kind"] = [KIND_IDS[c.kind] for c in chunks]
        rec["codec"] = [codec_ids[c.codec] for c in chunks]
    return rec.tobytes()


def index_to_bytes(index: Index, chunk_table: dict | None = None) -> bytes:
    """The index JSON. Without ``chunk_table`` a 1.0 index (chunks inline); with it (the table's
    ``offset``, ``count`` and ``checksum``) a 1.1 index whose entries point into the table."""
    if chunk_table is None:
        version, tensors, extra = "1.0", [e.to_json() for e in index.entries], {}
    else:
        es = index.entries
        version = FORMAT_VERSION
        tensors = {"name": [e.name for e in es], "dtype": [e.dtype for e in es],
                   "shape": [list(e.shape) for e in es], "nbytes": [e.nbytes for e in es],
                   "role": [e.role for e in es], "layer": [e.layer for e in es], "expert": [e.expert for e in es],
                   "proj": [e.proj for e in es], "fused_index": [e.fused_index for e in es],
                   "source_shape": [list(e.source_shape) for e in es], "source_index": [e.source_index for e in es],
                   "extent_offset": [e.extent[0] for e in es], "extent_length": [e.extent[1] for e in es],
                   "chunk_count": [len(e.chunks) for e in es]}
        pos = sum(tensors["chunk_count"])
        if pos != chunk_table["count"]:
            raise ValueError(f"chunk table has {chunk_table['count']} records, the entries {pos}")
        extra = {"chunk_table": {"offset": chunk_table["offset"], "count": pos, "record_size": CHUNK_RECORD.itemsize,
                                 "codecs": list(KNOWN_CODECS), "checksum": to_hex(chunk_table["checksum"])}}
    doc = {"format": "zmoe", "format_version": version, "meta": index.meta, "tensors": tensors,
           "files": [f.to_json() for f in index.files], **extra}
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
