"""Reading a .zmoe index back: every field type-checked, every size bounded before it is used
to allocate, chunks and extents checked against the file (docs/format.md 6 and 8). Everything
wrong is a :class:`~zipmoe.errors.ContainerError` naming the entry; :func:`index_from_bytes` is
what :class:`~zipmoe.codecs.reader.ContainerReader` calls.
"""

from __future__ import annotations

import itertools
import json
import math

import numpy as np

from zipmoe.errors import ContainerError, UnknownCodecError

from .checksum import checksum, from_hex
from .format import (ALIGNMENT, CHUNK_RECORD, ChunkTable, DATA_START, DTYPE_SIZES, FileEntry, Index, KINDS, KIND_IDS, KNOWN_CODECS, MAX_DEPTH, MAX_FILE_BYTES, MAX_INDEX_BYTES, MAX_RATIO, RATIO_SLACK, TensorEntry, VERSION_MINOR)

def is_plain_name(name: str) -> bool:
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name
            and "\\" not in name and "\0" not in name)


class _Bad(Exception):
    pass


class _Corrupt(Exception):
    pass


_BIG = 1 << 62  # no offset, length or size in a valid file comes near this


def _int(d: dict, key: str, nullable: bool = False) -> int | None:
    v = d.get(key)
    if v is None and nullable:
        return None
    if type(v) is not int or v < 0 or v >= _BIG:
        raise _Bad(f"field {key!r} must be a non-negative integer below 2^62, got {_short(v)}")
    return v


def _str(d: dict, key: str, nullable: bool = False) -> str | None:
    v = d.get(key)
    if v is None and nullable:
        return None
    if not isinstance(v, str):
        raise _Bad(f"field {key!r} must be a string, got {_short(v)}")
    return v


def _shape(d: dict, key: str) -> tuple:
    v = d.get(key)
    if type(v) is not list or not all(type(s) is int and 0 <= s < _BIG for s in v):
        raise _Bad(f"field {key!r} must be a list of non-negative integers")
    return tuple(v)


def _depth_ok(obj, limit: int) -> bool:
    """Whether ``obj`` nests at most ``limit`` containers deep (iterative: no recursion)."""
    stack = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, (dict, list)):
            if d > limit:
                return False
            stack.extend((v, d + 1) for v in (o.values() if isinstance(o, dict) else o))
    return True


def _bound_raw(codec: str, length: int, raw_length: int, what: str) -> None:
    if codec == "raw":
        if length != raw_length:
            raise _Bad(f"{what}: raw chunk with length {length} != raw_length {raw_length}")
    elif raw_length > length * MAX_RATIO[codec] + RATIO_SLACK:
        raise _Bad(f"{what}: claims {raw_length} decoded bytes from {length} stored bytes, more than "
                   f"codec {codec} can produce")


def _entry(d) -> tuple:
    """One tensor object -> (TensorEntry without chunks, its raw chunk field)."""
    if type(d) is not dict:
        raise _Bad("a tensor is not an object")
    name = d.get("name")
    if not isinstance(name, str):
        raise _Bad(f"a tensor has no name (field 'name' is {_short(name)})")
    try:
        dtype = d.get("dtype")
        size = DTYPE_SIZES.get(dtype) if isinstance(dtype, str) else None
        if size is None:
            raise _Bad(f"unknown dtype {_short(dtype)}")
        shape = _shape(d, "shape")
        role = d.get("role")
        if role != "expert" and role != "dense":
            raise _Bad(f"unknown role {_short(role)}")
        ext = d.get("extent")
        if not (type(ext) is list and len(ext) == 2 and all(type(x) is int and 0 <= x < _BIG for x in ext)):
            raise _Bad("extent must be [offset, length]")
        nbytes = _int(d, "nbytes")
        n = size * _elements(shape)
        if nbytes != n:
            raise _Bad(f"nbytes {nbytes} does not match shape {_short(list(shape))} and dtype {dtype}")
        e = TensorEntry(name, dtype, shape, role, _int(d, "layer", True), _int(d, "expert", True),
                        _str(d, "proj", True), _int(d, "fused_index", True), _shape(d, "source_shape"),
                        (ext[0], ext[1]), None, nbytes, _int(d, "source_index", True) or 0)
        return e, d
    except _Bad as exc:
        raise _Bad(f"tensor {name}: {exc}") from None


def _inline_chunks(entries: list, docs: list) -> tuple:
    """1.0: the chunks inline in each tensor object -> (records, counts)."""
    codec_ids = {c: i for i, c in enumerate(KNOWN_CODECS)}
    rows, counts = [], []
    for e, d in zip(entries, docs):
        cl = d.get("chunks")
        if type(cl) is not list:
            raise _Bad(f"tensor {e.name}: chunks must be a list")
        for c in cl:
            try:
                if type(c) is not dict:
                    raise _Bad("a chunk is not an object")
                kind = c.get("kind")
                if type(kind) is not str or kind not in KIND_IDS:
                    raise _Bad(f"unknown chunk kind {_short(kind)}")
                codec = _str(c, "codec")
                if codec not in codec_ids:
                    raise UnknownCodecError(
                        f"tensor {e.name} uses unknown codec {_short(codec)}: this zipmoe knows {', '.join(KNOWN_CODECS)}")
                try:
                    check = from_hex(_str(c, "checksum"))
                except ValueError as exc:
                    raise _Bad(str(exc)) from None
                rows.append((_int(c, "offset"), _int(c, "length"), _int(c, "raw_offset"), _int(c, "raw_length"),
                             check, KIND_IDS[kind], codec_ids[codec]))
            except _Bad as exc:
                raise _Bad(f"tensor {e.name}: {exc}") from None
        counts.append(len(cl))
    rec = np.zeros(len(rows), CHUNK_RECORD)
    if rows:
        cols = list(zip(*rows))
        for k, f in enumerate(("offset", "length", "raw_offset", "raw_length")):
            rec[f] = cols[k]
        rec["checksum"] = np.array(cols[4], np.uint64)
        rec["kind"] = cols[5]
        rec["codec"] = cols[6]
    return ChunkTable(rec, KNOWN_CODECS), counts


def _table_chunks(counts: list, tdoc, data_end: int, read) -> ChunkTable:
    """1.1: the binary chunk table; tensor ``i`` has the next ``counts[i]`` records."""
    if type(tdoc) is not dict:
        raise _Bad("chunk_table is missing")
    off, count = _int(tdoc, "offset"), _int(tdoc, "count")
    if tdoc.get("record_size") != CHUNK_RECORD.itemsize:
        raise _Bad(f"chunk_table record_size must be {CHUNK_RECORD.itemsize}")
    codecs = tdoc.get("codecs")
    if type(codecs) is not list or not all(isinstance(c, str) for c in codecs) or len(codecs) > 256:
        raise _Bad("chunk_table codecs must be a list of codec names")
    try:
        check = from_hex(_str(tdoc, "checksum"))
    except ValueError as exc:
        raise _Bad(f"chunk_table: {exc}") from None
    nbytes = count * CHUNK_RECORD.itemsize
    if off % ALIGNMENT or off < DATA_START or off + nbytes > data_end:
        raise _Bad(f"chunk table at {off} ({count} records) is unaligned or outside the data region")
    pos = sum(counts)
    if pos != count:
        raise _Bad(f"the tensors' chunk counts add up to {pos} records, the chunk table has {count}")
    raw = read(off, nbytes) if nbytes else b""
    if checksum(raw) != check:
        raise _Corrupt("chunk table checksum mismatch")
    if nbytes and np.frombuffer(raw, np.uint8).reshape(-1, CHUNK_RECORD.itemsize)[:, 42:].any():
        raise _Bad("chunk table has non-zero reserved bytes")
    return ChunkTable(np.frombuffer(raw, CHUNK_RECORD), codecs)


_NONE = type(None)
_NONNEG = "a non-negative integer below 2^62"
_DIMS = "a list of non-negative integers below 2^62"
#: The element types each 1.1 column may hold, and what the message says it must be.
_COLUMN_TYPES = {
    "name": ({str}, "a string"), "dtype": ({str}, "a dtype name (a string)"), "shape": ({list}, _DIMS),
    "nbytes": ({int}, _NONNEG), "role": ({str}, "'expert' or 'dense'"), "layer": ({int, _NONE}, "null or " + _NONNEG),
    "expert": ({int, _NONE}, "null or " + _NONNEG), "proj": ({str, _NONE}, "null or a string"),
    "fused_index": ({int, _NONE}, "null or " + _NONNEG), "source_shape": ({list}, _DIMS),
    "source_index": ({int}, _NONNEG), "extent_offset": ({int}, _NONNEG), "extent_length": ({int}, _NONNEG),
    "chunk_count": ({int}, _NONNEG),
}
_COLUMNS = tuple(_COLUMN_TYPES)


def _short(v) -> str:
    """``repr(v)``, cut to a length that fits an error line."""
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


def _elements(shape: tuple) -> int:
    """The product of ``shape``, or ``_BIG`` once it reaches that (a long list of huge
    dimensions would otherwise make a number of millions of digits)."""
    if 0 in shape:
        return 0
    if len(shape) <= 16:
        return math.prod(shape)
    n = 1
    for s in shape:
        n *= s
        if n >= _BIG:
            return _BIG
    return n


def _columns(tdoc) -> tuple:
    """1.1: the tensor columns -> (entries without chunks, chunk counts), every field checked
    column by column (no Python work per field per entry beyond building the entry): first the
    element types of every column (so that no value of a wrong type is hashed, compared or
    multiplied), then the values."""
    if type(tdoc) is not dict:
        raise _Bad("tensors must be an object of columns")
    cols = {}
    for k in _COLUMNS:
        v = tdoc.get(k)
        if type(v) is not list:
            raise _Bad(f"tensor column {k!r} is missing")
        cols[k] = v
    n = len(cols["name"])
    for k, v in cols.items():
        if len(v) != n:
            raise _Bad(f"tensor column {k!r} has {len(v)} values, 'name' has {n}")

    def first_bad(col: str, ok, must: str) -> None:
        i = next(i for i, x in enumerate(cols[col]) if not ok(x))
        who = f"tensor {cols['name'][i]}" if col != "name" else f"tensor number {i}"
        raise _Bad(f"{who}: field {col!r} must be {must}, got {_short(cols[col][i])}")

    for k, (types, must) in _COLUMN_TYPES.items():  # "name" first: the other messages name the entry
        if not set(map(type, cols[k])) <= types:
            first_bad(k, lambda x: type(x) in types, must)
    names = cols["name"]
    for k, (types, must) in _COLUMN_TYPES.items():
        if int in types:
            vals = [x for x in cols[k] if x is not None] if _NONE in types else cols[k]
            if vals and (min(vals) < 0 or max(vals) >= _BIG):
                first_bad(k, lambda x: x is None or 0 <= x < _BIG, must)
    if not set(cols["dtype"]) <= set(DTYPE_SIZES):
        first_bad("dtype", lambda x: x in DTYPE_SIZES, f"one of {', '.join(DTYPE_SIZES)}")
    if not set(cols["role"]) <= {"expert", "dense"}:
        first_bad("role", lambda x: x in ("expert", "dense"), "'expert' or 'dense'")
    for k in ("shape", "source_shape"):
        flat = list(itertools.chain.from_iterable(cols[k]))
        if not set(map(type, flat)) <= {int} or (flat and (min(flat) < 0 or max(flat) >= _BIG)):
            first_bad(k, lambda x: all(type(d) is int and 0 <= d < _BIG for d in x), _DIMS)
    shapes = list(map(tuple, cols["shape"]))
    want = [_elements(sh) * DTYPE_SIZES[dt] for sh, dt in zip(shapes, cols["dtype"])]
    if want != cols["nbytes"]:
        i = next(i for i, (a, b) in enumerate(zip(want, cols["nbytes"])) if a != b)
        raise _Bad(f"tensor {names[i]}: nbytes {cols['nbytes'][i]} does not match shape {_short(list(shapes[i]))} "
                   f"and dtype {cols['dtype'][i]}")
    entries = [TensorEntry(*row) for row in zip(
        names, cols["dtype"], shapes, cols["role"], cols["layer"], cols["expert"], cols["proj"], cols["fused_index"],
        map(tuple, cols["source_shape"]), zip(cols["extent_offset"], cols["extent_length"]), itertools.repeat(None),
        cols["nbytes"], cols["source_index"])]
    return entries, cols["chunk_count"]


def _entry_arrays(entries: list) -> dict:
    """Extent offsets and lengths, nbytes and is-BF16 of every entry, as arrays."""
    return {"ext_off": np.array([e.extent[0] for e in entries], np.int64),
            "ext_len": np.array([e.extent[1] for e in entries], np.int64),
            "nbytes": np.array([e.nbytes for e in entries], np.int64),
            "bf16": np.array([e.dtype == "BF16" for e in entries], bool),
            "expert": np.array([e.role == "expert" for e in entries], bool)}


def _check_chunks(entries: list, counts: list, table: ChunkTable, data_end: int, arrays: dict) -> None:
    """Section 6 for every chunk at once: inside the data region, bounded sizes, contiguous and
    filling each extent, the right kinds, raw ranges tiling each stream."""
    rec = table.records
    n, E = rec.shape[0], len(entries)
    cnt = np.asarray(counts, np.int64)
    ent = np.repeat(np.arange(E), cnt)
    starts = np.cumsum(cnt) - cnt
    has = cnt > 0

    def fail(mask: np.ndarray, msg) -> None:
        if mask.any():
            i = int(np.argmax(mask))
            m = msg(i) if callable(msg) else msg
            raise _Bad(f"tensor {entries[int(ent[i])].name}: {m}")

    ext_off, ext_len, nb, bf16 = arrays["ext_off"], arrays["ext_len"], arrays["nbytes"], arrays["bf16"]
    # entries: counts against nbytes
    bad_e = (nb == 0) & has & bf16 | (nb > 0) & ~has | (nb > 0) & bf16 & (cnt < 2) | ~has & (ext_len != 0)
    if bad_e.any():
        i = int(np.argmax(bad_e))
        e = entries[i]
        raise _Bad(f"tensor {e.name}: {int(cnt[i])} chunks (extent length {e.extent[1]}) for {e.nbytes} bytes of {e.dtype}")
    if n == 0:
        return
    for f in ("offset", "length", "raw_offset", "raw_length"):
        fail(rec[f] >= _BIG, f"chunk {f} out of range")
    off = rec["offset"].astype(np.int64)
    ln = rec["length"].astype(np.int64)
    roff = rec["raw_offset"].astype(np.int64)
    rln = rec["raw_length"].astype(np.int64)
    kind = rec["kind"].astype(np.int64)
    codec = rec["codec"].astype(np.int64)
    fail(kind >= len(KINDS), lambda i: f"unknown chunk kind {int(kind[i])}")
    fail(codec >= len(table.codecs), lambda i: f"codec number {int(codec[i])} is not in the chunk table's codecs")
    names = table.codecs
    for k, name in enumerate(names):
        if name not in MAX_RATIO and (codec == k).any():
            i = int(np.argmax(codec == k))
            raise UnknownCodecError(f"tensor {entries[int(ent[i])].name} uses unknown codec {name!r}: "
                                    f"this zipmoe knows {', '.join(KNOWN_CODECS)}")
    fail((off < DATA_START) | (off + ln > data_end), lambda i: f"chunk at {int(off[i])} (+{int(ln[i])}) lies outside the data region")
    ratio = np.array([MAX_RATIO.get(c, 0) for c in names], np.int64)[codec]
    is_raw = np.array([c == "raw" for c in names], bool)[codec]
    fail(is_raw & (ln != rln), "raw chunk with length != raw_length")
    fail(~is_raw & (rln > ln * ratio + RATIO_SLACK),
         lambda i: f"a chunk claims {int(rln[i])} decoded bytes from {int(ln[i])} stored bytes, more than codec "
                   f"{names[int(codec[i])]} can produce")
    is_first = np.zeros(n, bool)
    is_first[starts[has]] = True
    is_last = np.zeros(n, bool)
    is_last[(starts + cnt - 1)[has]] = True
    prev_end = np.empty(n, np.int64)
    prev_end[0] = 0
    prev_end[1:] = off[:-1] + ln[:-1]
    fail(off != np.where(is_first, ext_off[ent], prev_end), "chunks are not contiguous inside the extent")
    fail(is_last & (off + ln != (ext_off + ext_len)[ent]), "chunks do not fill the extent")
    bf = bf16[ent]
    want_kind = np.where(bf, np.where(is_last, KIND_IDS["sm"], KIND_IDS["exp"]), KIND_IDS["data"])
    fail(kind != want_kind, lambda i: "a BF16 tensor must have E chunks followed by one SM chunk" if bf[i]
         else f"a {entries[int(ent[i])].dtype} tensor must have data chunks only")
    new_stream = is_first.copy()
    new_stream[1:] |= kind[1:] != kind[:-1]
    prev_raw_end = np.empty(n, np.int64)
    prev_raw_end[0] = 0
    prev_raw_end[1:] = roff[:-1] + rln[:-1]
    fail(roff != np.where(new_stream, 0, prev_raw_end), "chunks do not tile the stream (gap or overlap)")
    end_stream = is_last.copy()
    end_stream[:-1] |= kind[:-1] != kind[1:]
    total = np.where(bf, nb[ent] // 2, nb[ent])
    fail(end_stream & (roff + rln != total),
         lambda i: f"{KINDS[int(kind[i])]} chunks cover {int(roff[i] + rln[i])} bytes, expected {int(total[i])}")


def _check_layout(entries: list, files: list, table_extent, data_end: int, minor: int, arrays: dict) -> None:
    """Extents inside the data region, aligned where section 6 says, and nothing overlapping."""
    if entries:
        off, ln = arrays["ext_off"], arrays["ext_len"]
        bad = (off < DATA_START) | (off + ln > data_end)
        if bad.any():
            e = entries[int(np.argmax(bad))]
            raise _Bad(f"tensor {e.name}: extent [{e.extent[0]}, {e.extent[1]}] lies outside the data region")
        must = np.ones(len(entries), bool) if minor == 0 else arrays["expert"]
        bad = must & (off % ALIGNMENT != 0)
        if bad.any():
            e = entries[int(np.argmax(bad))]
            raise _Bad(f"tensor {e.name}: extent [{e.extent[0]}, {e.extent[1]}] is not aligned to {ALIGNMENT}")
    others = [(f.offset, f.length, f"embedded file {f.name}") for f in files if f.length]
    if table_extent and table_extent[1]:
        others.append((table_extent[0], table_extent[1], "the chunk table"))
    if entries:
        keep = np.flatnonzero(arrays["ext_len"] > 0)
        starts = np.concatenate([arrays["ext_off"][keep], np.array([r[0] for r in others], np.int64)])
        ends = starts + np.concatenate([arrays["ext_len"][keep], np.array([r[1] for r in others], np.int64)])
    else:
        keep = np.zeros(0, np.int64)
        starts = np.array([r[0] for r in others], np.int64)
        ends = starts + np.array([r[1] for r in others], np.int64)
    if starts.shape[0] < 2:
        return
    order = np.argsort(starts, kind="stable")
    bad = starts[order][1:] < ends[order][:-1]
    if bad.any():
        i = int(np.argmax(bad))

        def what(k: int) -> str:
            k = int(order[k])
            if k < keep.shape[0]:
                return f"tensor {entries[int(keep[k])].name}"
            return others[k - keep.shape[0]][2]

        raise _Bad(f"{what(i + 1)} at {int(starts[order[i + 1]])} overlaps {what(i)}")


def index_from_bytes(raw: bytes, data_end: int, where: str = "file", minor: int = VERSION_MINOR,
                     read=None) -> Index:
    """Parse and validate the index (docs/format.md section 4, step 7, and the limits of 4.1).

    ``minor`` is the header's minor version: 0 reads inline chunks, 1 and later the chunk
    table, which ``read(offset, length)`` fetches from the file.
    """
    try:
        if len(raw) > MAX_INDEX_BYTES:
            raise _Bad(f"{len(raw)} bytes, more than {MAX_INDEX_BYTES}")
        try:
            doc = json.loads(raw.decode("utf-8") if isinstance(raw, (bytes, bytearray, memoryview)) else raw)
        except RecursionError:
            raise _Bad(f"nested deeper than {MAX_DEPTH} levels") from None
        if not isinstance(doc, dict) or doc.get("format") != "zmoe":
            raise _Bad("not a zmoe index")
        meta = doc.get("meta")
        if not isinstance(meta, dict):
            raise _Bad("meta is missing")
        for key, value in doc.items():  # the tensors' own fields are bounded by their schema
            extra = ([v for k, v in value.items() if k not in _COLUMNS] if key == "tensors" and type(value) is dict
                     else [] if key == "tensors" else [value])
            if not all(_depth_ok(v, MAX_DEPTH - 1) for v in extra):
                raise _Bad(f"{key} is nested deeper than {MAX_DEPTH} levels")
        tensors = doc.get("tensors")
        if minor == 0 and not isinstance(tensors, list):
            raise _Bad("tensors is missing")
        table_extent = None
        if minor == 0:
            parsed = [_entry(t) for t in tensors]
            entries = [p[0] for p in parsed]
            table, counts = _inline_chunks(entries, [p[1] for p in parsed])
        else:
            if read is None:
                raise _Bad("no way to read the chunk table")
            entries, counts = _columns(tensors)
            table = _table_chunks(counts, doc.get("chunk_table"), data_end, read)
            table_extent = (doc["chunk_table"]["offset"], table.records.shape[0] * CHUNK_RECORD.itemsize)
        arrays = _entry_arrays(entries)
        _check_chunks(entries, counts, table, data_end, arrays)
        pos = 0
        for e, c in zip(entries, counts):
            e._table, e._first, e._count = table, pos, c
            pos += c
        files = []
        flist = doc.get("files", [])
        if not isinstance(flist, list):
            raise _Bad("files must be a list")
        for f in flist:
            if not isinstance(f, dict):
                raise _Bad("a file entry is not an object")
            name = _str(f, "name")
            if not is_plain_name(name):
                raise _Bad(f"embedded file name {name!r} is not a plain file name")
            try:
                codec = _str(f, "codec")
                if codec not in KNOWN_CODECS:
                    raise UnknownCodecError(f"embedded file {name} uses unknown codec {codec!r}: "
                                            f"this zipmoe knows {', '.join(KNOWN_CODECS)}")
                try:
                    check = from_hex(_str(f, "checksum"))
                except ValueError as exc:
                    raise _Bad(str(exc)) from None
                fe = FileEntry(name, _int(f, "offset"), _int(f, "length"), _int(f, "raw_length"), codec, check)
                if fe.offset < DATA_START or fe.offset + fe.length > data_end:
                    raise _Bad(f"stored at {fe.offset} (+{fe.length}), outside the data region")
                if minor == 0 and fe.offset % ALIGNMENT:
                    raise _Bad(f"offset {fe.offset} is not aligned to {ALIGNMENT}")
                if fe.raw_length > MAX_FILE_BYTES:
                    raise _Bad(f"claims {fe.raw_length} bytes, more than the {MAX_FILE_BYTES >> 20} MiB "
                               f"an embedded file may have")
                _bound_raw(codec, fe.length, fe.raw_length, "its chunk")
            except _Bad as exc:
                raise _Bad(f"embedded file {name}: {exc}") from None
            files.append(fe)
        if len({f.name for f in files}) != len(files):
            raise _Bad("an embedded file name appears twice")
        _check_layout(entries, files, table_extent, data_end, minor, arrays)
        return Index(meta, entries, files, table_extent)
    except UnknownCodecError as exc:
        raise UnknownCodecError(f"{where}: {exc}") from None
    except _Corrupt as exc:
        raise ContainerError(f"{where} is corrupted: {exc}") from None
    except (_Bad, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ContainerError(f"{where} has an invalid index: {exc}") from None
