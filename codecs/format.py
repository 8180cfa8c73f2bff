"""The .zmoe v1 layout: constants, the fixed header, and the index schema.

Everything here mirrors docs/format.md; section numbers refer to it. The writer builds
:class:`TensorEntry`/:class:`Chunk` objects and serialises them with :func:`index_to_bytes`;
the reader parses and validates with :func:`parse_header` and :func:`index_from_bytes`.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

from zipmoe.errors import ContainerError, UnknownCodecError

from .checksum import checksum, from_hex, to_hex

MAGIC = b"ZMOE\r\n\x1a\n"
VERSION_MAJOR = 1
VERSION_MINOR = 0
FORMAT_VERSION = f"{VERSION_MAJOR}.{VERSION_MINOR}"
HEADER_SIZE = 64
ALIGNMENT = 4096
DATA_START = 4096
DEFAULT_SHARD_SIZE = 1 << 20

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


def pack_header(index_offset: int, index_length: int, index_checksum: int) -> bytes:
    body = _HEADER.pack(MAGIC, VERSION_MAJOR, VERSION_MINOR, HEADER_SIZE, ALIGNMENT,
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
    if ioff < DATA_START or ilen == 0:
        raise ContainerError(f"{where} is corrupted: index at {ioff} (+{ilen}) is not after the data region")
    return Header(major, minor, ioff, ilen, icheck, hsize, align)


# --------------------------------------------------------------------------- index (section 5)


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


@dataclass
class TensorEntry:
    """One stored tensor, or one expert slice of a fused tensor (docs/format.md 5.2)."""

    name: str
    dtype: str
    shape: tuple
    role: str
    layer: int | None
    expert: int | None
    proj: str | None
    fused_index: int | None
    source_shape: tuple
    extent: tuple
    chunks: list
    nbytes: int
    source_index: int = 0

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def is_bf16(self) -> bool:
        return self.dtype == "BF16"

    def chunks_of(self, kind: str) -> list:
        return [c for c in self.chunks if c.kind == kind]

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape),
                "nbytes": self.nbytes, "role": self.role, "layer": self.layer,
                "expert": self.expert, "proj": self.proj, "fused_index": self.fused_index,
                "source_shape": list(self.source_shape), "source_index": self.source_index,
                "extent": [self.extent[0], self.extent[1]],
                "chunks": [c.to_json() for c in self.chunks]}


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

    def as_chunk(self) -> Chunk:
        return Chunk("data", self.offset, self.length, 0, self.raw_length, self.codec, self.checksum)


@dataclass
class Index:
    meta: dict
    entries: list
    files: list = field(default_factory=list)


def index_to_bytes(index: Index) -> bytes:
    doc = {"format": "zmoe", "format_version": FORMAT_VERSION, "meta": index.meta,
           "tensors": [e.to_json() for e in index.entries],
           "files": [f.to_json() for f in index.files]}
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def is_plain_name(name: str) -> bool:
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name
            and "\\" not in name and "\0" not in name)


class _Bad(Exception):
    pass


def _int(d: dict, key: str, nullable: bool = False) -> int | None:
    v = d.get(key)
    if v is None and nullable:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise _Bad(f"field {key!r} must be a non-negative integer, got {v!r}")
    return v


def _str(d: dict, key: str, nullable: bool = False) -> str | None:
    v = d.get(key)
    if v is None and nullable:
        return None
    if not isinstance(v, str):
        raise _Bad(f"field {key!r} must be a string, got {v!r}")
    return v


def _shape(d: dict, key: str) -> tuple:
    v = d.get(key)
    if not isinstance(v, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in v):
        raise _Bad(f"field {key!r} must be a list of non-negative integers")
    return tuple(v)


def _chunk(d, data_end: int, where: str) -> Chunk:
    if not isinstance(d, dict):
        raise _Bad("a chunk is not an object")
    kind = _str(d, "kind")
    if kind not in KINDS:
        raise _Bad(f"unknown chunk kind {kind!r}")
    codec = _str(d, "codec")
    if codec not in KNOWN_CODECS:
        raise UnknownCodecError(f"{where} uses unknown codec {codec!r}: this zipmoe knows {', '.join(KNOWN_CODECS)}")
    try:
        check = from_hex(_str(d, "checksum"))
    except ValueError as exc:
        raise _Bad(str(exc)) from None
    c = Chunk(kind, _int(d, "offset"), _int(d, "length"), _int(d, "raw_offset"), _int(d, "raw_length"), codec, check)
    if c.offset < DATA_START or c.offset + c.length > data_end:
        raise _Bad(f"chunk at {c.offset} (+{c.length}) lies outside the data region")
    if codec == "raw" and c.length != c.raw_length:
        raise _Bad("raw chunk with length != raw_length")
    return c


def _check_tiling(chunks: list, total: int, what: str) -> None:
    pos = 0
    for c in chunks:
        if c.raw_offset != pos:
            raise _Bad(f"{what} chunks do not tile the stream (gap or overlap at {pos})")
        pos += c.raw_length
    if pos != total:
        raise _Bad(f"{what} chunks cover {pos} bytes, expected {total}")


def _entry(i: int, d, data_end: int) -> TensorEntry:
    if not isinstance(d, dict):
        raise _Bad(f"tensor {i} is not an object")
    name = _str(d, "name")
    where = f"tensor {name}"
    try:
        dtype = _str(d, "dtype")
        if dtype not in DTYPE_SIZES:
            raise _Bad(f"unknown dtype {dtype!r}")
        shape = _shape(d, "shape")
        role = _str(d, "role")
        if role not in ("expert", "dense"):
            raise _Bad(f"unknown role {role!r}")
        ext = d.get("extent")
        if not (isinstance(ext, list) and len(ext) == 2 and all(isinstance(x, int) and x >= 0 for x in ext)):
            raise _Bad("extent must be [offset, length]")
        chunks_raw = d.get("chunks")
        if not isinstance(chunks_raw, list):
            raise _Bad("chunks must be a list")
        chunks = [_chunk(c, data_end, where) for c in chunks_raw]
        e = TensorEntry(name, dtype, shape, role, _int(d, "layer", True), _int(d, "expert", True),
                        _str(d, "proj", True), _int(d, "fused_index", True), _shape(d, "source_shape"),
                        (ext[0], ext[1]), chunks, _int(d, "nbytes"), _int(d, "source_index", True) or 0)
        n = 1
        for s in shape:
            n *= s
        if e.nbytes != n * DTYPE_SIZES[dtype]:
            raise _Bad(f"nbytes {e.nbytes} does not match shape {list(shape)} and dtype {dtype}")
        off, length = e.extent
        if off % ALIGNMENT or off < DATA_START or off + length > data_end:
            raise _Bad(f"extent [{off}, {length}] is unaligned or outside the data region")
        pos = off
        for c in chunks:
            if c.offset != pos:
                raise _Bad("chunks are not contiguous inside the extent")
            pos += c.length
        if pos != off + length:
            raise _Bad("chunks do not fill the extent")
        if dtype == "BF16":
            kinds = [c.kind for c in chunks]
            if e.nbytes == 0:
                if chunks:
                    raise _Bad("empty tensor with chunks")
            else:
                if kinds[-1:] != ["sm"] or kinds.count("sm") != 1 or "data" in kinds:
                    raise _Bad("a BF16 tensor must have E chunks followed by one SM chunk")
                _check_tiling(chunks[:-1], n, "exp")
                _check_tiling(chunks[-1:], n, "sm")
        else:
            if any(c.kind != "data" for c in chunks):
                raise _Bad(f"a {dtype} tensor must have data chunks only")
            _check_tiling(chunks, e.nbytes, "data")
        return e
    except _Bad as exc:
        raise _Bad(f"{where}: {exc}") from None


def index_from_bytes(raw: bytes, data_end: int, where: str = "file") -> Index:
    """Parse and validate the index (docs/format.md section 4, step 7)."""
    try:
        doc = json.loads(raw.decode("utf-8"))
        if not isinstance(doc, dict) or doc.get("format") != "zmoe":
            raise _Bad("not a zmoe index")
        meta = doc.get("meta")
        if not isinstance(meta, dict):
            raise _Bad("meta is missing")
        tensors = doc.get("tensors")
        if not isinstance(tensors, list):
            raise _Bad("tensors is missing")
        entries = [_entry(i, t, data_end) for i, t in enumerate(tensors)]
        files = []
        for f in doc.get("files", []):
            if not isinstance(f, dict):
                raise _Bad("a file entry is not an object")
            name = _str(f, "name")
            if not is_plain_name(name):
                raise _Bad(f"embedded file name {name!r} is not a plain file name")
            c = _chunk(dict(f, kind="data", raw_offset=0), data_end, f"embedded file {name}")
            files.append(FileEntry(name, c.offset, c.length, c.raw_length, c.codec, c.checksum))
        return Index(meta, entries, files)
    except UnknownCodecError as exc:
        raise UnknownCodecError(f"{where}: {exc}") from None
    except (_Bad, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ContainerError(f"{where} has an invalid index: {exc}") from None
