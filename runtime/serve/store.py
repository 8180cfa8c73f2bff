"""The expert store: where expert tensors live in the container and how their bytes are fetched.

Two things:

* :class:`ExpertTensor`, the runtime's unit of caching and scheduling: one *compute tensor* of
  one expert, as the expert's forward uses it. For the fused families an expert has two,
  ``gate_up`` ([2I, H]: the container's ``gate`` entry in the first I rows, ``up`` in the next
  I, exactly as transformers' loader concatenates them; or one entry when the source stored
  ``gate_up_proj`` fused) and ``down`` ([H, I]). For SwitchTransformers ``up`` (``wi``) and
  ``down`` (``wo``). Each is made of :class:`Segment` s, one per container entry, with the byte
  ranges of its E chunks and its SM chunk.
* :class:`ExpertStore`: positional reads of chunk ranges from the container file, with
  ``O_DIRECT`` where the file system allows (the page cache then does not hide the disk),
  into page-aligned buffers (anonymous ``mmap``), reading 4096-aligned ranges and slicing;
  plain ``pread`` where ``O_DIRECT`` is refused (tmpfs, some overlay file systems: ``EINVAL``).
  Only the runtime's single I/O thread calls :meth:`ExpertStore.read`.
* :class:`ReadBuffers`: those aligned buffers, reused. A fresh anonymous mapping costs a page
  fault per 4 KiB the first time the kernel writes into it, and in a VM a fault is expensive:
  on the CPU box, O_DIRECT reads of 1.7 MB ran at 0.7 GiB/s into fresh mappings and at
  1.1 GiB/s into a reused one (docs/benchmarks.md §10). The runtime hands a fetch's buffers back
  once the tensor is whole and admitted; idle buffers count in its held bytes.

:func:`decode_into` turns stored E chunks and the SM chunk of an expert tensor into bf16 (as
uint16) in a caller's buffer, verifying the XXH3-64 of every chunk first (docs/format.md 7):
a corrupted chunk raises :class:`~zipmoe.errors.ChecksumError` naming the tensor, and nothing
is computed with it.
"""

from __future__ import annotations

import errno
import mmap
import os
import time
from dataclasses import dataclass, field

import numpy as np
import xxhash

from zipmoe.errors import ChecksumError, ContainerError, ModelError

__all__ = ["Segment", "ExpertTensor", "ExpertStore", "build_expert_tensors", "decode_into", "u16_view", "ALIGN"]

ALIGN = 4096
_REUSE_SLACK_MIN = 2 * ALIGN  # so that a reused buffer rounded up to pages still fits (see ReadBuffers.get)
_COALESCE_GAP = 64 * 1024  # read across gaps up to this size (alignment padding) in one call


def reuse_slack(n: int) -> int:
    """How much larger than a read a reused buffer may be (counted in the working set)."""
    return max(_REUSE_SLACK_MIN, n // 16)


def _checksum_int(c) -> int:
    v = c.checksum
    return int(v, 16) if isinstance(v, str) else int(v)


def _coalesce(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for off, ln in sorted(r for r in ranges if r[1] > 0):
        if out and off - (out[-1][0] + out[-1][1]) <= _COALESCE_GAP:
            out[-1][1] = max(out[-1][1], off + ln - out[-1][0])
        else:
            out.append([off, ln])
    return [(a, b) for a, b in out]


@dataclass
class Segment:
    """One container entry inside an expert tensor."""

    name: str  # the source tensor's name (+ "[e]" for a slice of a fused tensor)
    dst: int  # element offset of this entry in the expert tensor
    numel: int
    e_chunks: list
    sm_chunk: object
    e_range: tuple[int, int]  # file (offset, length) covering the E chunks
    sm_range: tuple[int, int]


@dataclass
class ExpertTensor:
    uid: int
    layer: int
    expert: int
    name: str  # "gate_up", "down" or "up"
    shape: tuple[int, int]
    segments: list[Segment] = field(default_factory=list)
    compute_itemsize: int = 2  # bytes per value of the tensor the expert computes with (bf16: 2, fp32: 4)

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def full_bytes(self) -> int:
        return 2 * self.numel

    @property
    def compute_bytes(self) -> int:
        """Bytes of the whole tensor as the expert computes with it (what the full pool holds)."""
        return self.compute_itemsize * self.numel

    @property
    def e_bytes(self) -> int:
        return sum(s.e_range[1] for s in self.segments)

    @property
    def sm_bytes(self) -> int:
        return sum(s.sm_range[1] for s in self.segments)

    @property
    def stored_bytes(self) -> int:
        return self.e_bytes + self.sm_bytes

    def ranges(self, need_e: bool, need_sm: bool) -> list[tuple[int, int]]:
        rs = []
        for s in self.segments:
            if need_e:
                rs.append(s.e_range)
            if need_sm:
                rs.append(s.sm_range)
        return _coalesce(rs)

    def staging_bytes(self) -> int:
        """Upper bound of the aligned read buffers one fetch of this tensor needs (a reused
        buffer may be up to :func:`reuse_slack` larger than the read)."""
        return sum(ln + 2 * ALIGN + reuse_slack(ln + 2 * ALIGN) for _, ln in self.ranges(True, True))

    def label(self) -> str:
        return ", ".join(s.name for s in self.segments)


def _span(chunks) -> tuple[int, int]:
    if not chunks:
        return (0, 0)
    start = chunks[0].offset
    end = chunks[-1].offset + chunks[-1].length
    pos = start
    for c in chunks:
        if c.offset != pos:
            raise ContainerError(f"chunks of one stream are not contiguous at offset {c.offset}")
        pos += c.length
    return (start, end - start)


def build_expert_tensors(entries, family, expected_shapes, compute_itemsize: int = 2) -> dict[tuple[int, int], list[ExpertTensor]]:
    """Group the container's expert entries into the family's compute tensors.

    ``expected_shapes[layer] = {unit name: (rows, cols)}`` from the model skeleton; a container
    whose experts do not fill these shapes is refused (ModelError).
    Returns ``{(layer, expert): [ExpertTensor per unit, in family order]}``.
    """
    proj_to_unit = {}
    for unit_name, projs in family.units:
        for i, p in enumerate(projs):
            proj_to_unit[p] = (unit_name, i)
    groups: dict[tuple[int, int], dict[str, list]] = {}
    for e in entries:
        if e.role != "expert":
            continue
        if e.layer is None or e.expert is None and e.fused_index is None:
            raise ModelError(f"expert tensor {e.name} has no layer/expert number in the container index")
        expert = e.expert if e.expert is not None else e.fused_index
        if e.dtype != "BF16":
            raise ModelError(f"expert tensor {e.name} is {e.dtype}; the runtime serves bf16 experts")
        units = groups.setdefault((e.layer, expert), {})
        if e.proj in proj_to_unit:
            unit_name, order = proj_to_unit[e.proj]
            units.setdefault(unit_name, []).append((order, e))
        elif e.proj == "gate_up" and "gate_up" in dict(family.units):
            units.setdefault("gate_up", []).append((0, e))
        else:
            raise ModelError(f"expert tensor {e.name}: projection {e.proj!r} is not one {family.name} uses")
    out: dict[tuple[int, int], list[ExpertTensor]] = {}
    uid = 0
    for (layer, expert) in sorted(groups):
        units = groups[(layer, expert)]
        if layer not in expected_shapes:
            raise ModelError(f"the container has experts for layer {layer}, which the model has no sparse layer for")
        tensors = []
        for unit_name, projs in family.units:
            parts = sorted(units.get(unit_name, []), key=lambda t: t[0])
            want = expected_shapes[layer][unit_name]
            if not parts:
                raise ModelError(f"layer {layer} expert {expert}: no {unit_name} weights in the container")
            t = ExpertTensor(uid, layer, expert, unit_name, tuple(want), compute_itemsize=compute_itemsize)
            uid += 1
            dst = 0
            rows = 0
            for _, e in parts:
                shape = tuple(e.shape)
                if len(shape) != 2 or shape[1] != want[1]:
                    raise ModelError(f"expert tensor {e.name} has shape {list(shape)}; the model expects [*, {want[1]}]")
                e_chunks = [c for c in e.chunks if c.kind == "exp"]
                sm_chunks = [c for c in e.chunks if c.kind == "sm"]
                if len(sm_chunks) != 1:
                    raise ContainerError(f"tensor {e.name}: expected one SM chunk, found {len(sm_chunks)}")
                n = shape[0] * shape[1]
                label = e.name if e.fused_index is None else f"{e.name}[{e.fused_index}]"
                t.segments.append(Segment(label, dst, n, e_chunks, sm_chunks[0], _span(e_chunks), _span(sm_chunks)))
                dst += n
                rows += shape[0]
            if rows != want[0]:
                raise ModelError(
                    f"layer {layer} expert {expert}: {unit_name} has {rows} rows in the container, the model expects {want[0]}"
                )
            tensors.append(t)
        out[(layer, expert)] = tensors
    return out


class ReadBuffers:
    """Page-aligned buffers for O_DIRECT reads, kept for reuse (see the module doc).

    :meth:`get` returns an idle buffer at least as large as asked and at most
    :func:`reuse_slack` larger (the smallest such), else a new one; :meth:`put` takes buffers
    back and drops the largest idle ones beyond ``max_idle`` bytes. A buffer is handed back only
    when no view into it is used any more (the runtime copies what its cache keeps).
    """

    def __init__(self, counters=None) -> None:
        import threading

        self._counters = counters
        self._lock = threading.Lock()
        self._idle: list = []  # mmaps
        self.idle_bytes = 0
        self.reused = 0
        self.made = 0

    def get(self, size: int) -> mmap.mmap:
        limit = size + reuse_slack(size)
        with self._lock:
            best = None
            for i, m in enumerate(self._idle):
                if size <= len(m) <= limit and (best is None or len(m) < len(self._idle[best])):
                    best = i
            if best is not None:
                m = self._idle.pop(best)
                self.idle_bytes -= len(m)
                self.reused += 1
                return m
            self.made += 1
        if self._counters is not None:
            self._counters.add_fresh_buffer()
        # a little room above the size, so that the next read of this tensor (whose compressed
        # size may differ slightly) reuses it; page aligned (anonymous memory always is)
        cap = -(-(size + reuse_slack(size) // 2) // ALIGN) * ALIGN
        return mmap.mmap(-1, cap)

    def put(self, bufs, max_idle: int) -> None:
        with self._lock:
            for m in bufs:
                self._idle.append(m)
                self.idle_bytes += len(m)
            self._trim(max_idle)

    def trim(self, max_idle: int) -> None:
        with self._lock:
            self._trim(max_idle)

    def _trim(self, max_idle: int) -> None:
        if self.idle_bytes <= max_idle:
            return
        self._idle.sort(key=len)
        while self._idle and self.idle_bytes > max(0, max_idle):
            m = self._idle.pop()
            self.idle_bytes -= len(m)  # dropped: freed once no view refers to it


class ExpertStore:
    """Positional reads from the container, O_DIRECT when possible (one I/O thread)."""

    def __init__(self, path, counters=None, direct: bool = True) -> None:
        self.path = str(path)
        self.counters = counters
        self.buffers = ReadBuffers(counters)
        self._fd = os.open(self.path, os.O_RDONLY)
        self._dfd = -1
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self._dfd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
            except OSError:
                self._dfd = -1
        self.direct = self._dfd >= 0

    def close(self) -> None:
        for fd in (self._fd, self._dfd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._fd = self._dfd = -1

    @staticmethod
    def buffer_size(offset: int, length: int) -> int:
        """The aligned buffer a read of ``[offset, offset+length)`` needs (see ``buf``)."""
        return -(-(offset + length) // ALIGN) * ALIGN - (offset - offset % ALIGN)

    def read(self, offset: int, length: int, payload: int | None = None, buf=None, state: str | None = None) -> np.ndarray:
        """Bytes ``[offset, offset+length)`` of the file as a uint8 array (a view into an aligned buffer).

        ``payload``: how many of these bytes are chunk bytes (the rest is padding read across);
        counted as ``bytes_read`` (``bytes_read_disk`` counts what was transferred).
        ``buf``: a page-aligned buffer of at least :meth:`buffer_size` bytes to read into (one
        from :attr:`buffers`, for the caller to hand back once it no longer uses the view);
        without it a fresh one is mapped. ``state``: the cache state of the tensor read for
        (``Counters.reads_by_state``)."""
        t0 = time.perf_counter()
        if length <= 0:
            return np.empty(0, np.uint8)
        if self.direct:
            try:
                arr, disk = self._read_direct(offset, length, buf)
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.EFAULT):
                    raise ContainerError(f"cannot read {self.path}: {exc.strerror}") from None
                os.close(self._dfd)
                self._dfd = -1
                self.direct = False
                arr, disk = self._read_plain(offset, length, buf)
        else:
            arr, disk = self._read_plain(offset, length, buf)
        if self.counters is not None:
            self.counters.add_read(length if payload is None else payload, disk, time.perf_counter() - t0, state)
        return arr

    def _read_direct(self, offset: int, length: int, buf=None):
        start = offset - offset % ALIGN
        end = -(-(offset + length) // ALIGN) * ALIGN
        size = end - start
        if buf is None:
            buf = mmap.mmap(-1, size)  # anonymous memory is page aligned, as O_DIRECT wants
        mv = memoryview(buf)[:size]
        got = 0
        while got < size:
            n = os.preadv(self._dfd, [mv[got:]], start + got)
            if n <= 0:
                break
            got += n
        mv.release()
        if got < offset + length - start:
            raise ContainerError(f"{self.path} is truncated: short read at offset {offset}")
        arr = np.frombuffer(buf, np.uint8, count=size)
        return arr[offset - start : offset - start + length], got

    def _read_plain(self, offset: int, length: int, buf=None):
        if buf is None:
            arr = np.empty(length, np.uint8)
        else:  # a reused buffer spares the page faults here too
            arr = np.frombuffer(buf, np.uint8, count=length)
        mv = memoryview(arr)
        got = 0
        while got < length:
            try:
                n = os.preadv(self._fd, [mv[got:]], offset + got)
            except OSError as exc:
                raise ContainerError(f"cannot read {self.path}: {exc.strerror}") from None
            if n <= 0:
                raise ContainerError(f"{self.path} is truncated: short read at offset {offset + got}")
            got += n
        return arr, length


def slice_of(buffers: list[tuple[int, np.ndarray]], rng: tuple[int, int]) -> np.ndarray:
    """The bytes of file range ``rng`` from buffers read as ``(file_offset, array)``."""
    off, ln = rng
    for boff, arr in buffers:
        if boff <= off and off + ln <= boff + arr.shape[0]:
            return arr[off - boff : off - boff + ln]
    raise AssertionError(f"range {rng} was not read")  # pragma: no cover - scheduler bug


def verify(chunk, stored, label: str, k: int) -> None:
    if xxhash.xxh3_64_intdigest(stored) != _checksum_int(chunk):
        raise ChecksumError(f"tensor {label} chunk {k}: checksum mismatch (the container is corrupted)")


def decode_into(tensor: ExpertTensor, e_parts: list, sm_parts: list, out_u16: np.ndarray, ctx,
                verify_e: bool, verify_sm: bool, timer=None) -> None:
    """Decompress the E chunks and merge with SM into ``out_u16`` (flat uint16, tensor.numel).

    ``e_parts[i]`` / ``sm_parts[i]``: segment i's stored E bytes (its E chunks as stored,
    concatenated) and stored SM bytes. ``verify_*``: check the XXH3-64 of those chunks first
    (every chunk read from the file is verified once, before its first use).
    ``timer(stage, seconds)`` receives the decode and merge times.
    """
    from zipmoe.codecs.exponent import get_codec
    from zipmoe.kernels.cpu import merge_into

    for seg, e, sm in zip(tensor.segments, e_parts, sm_parts):
        t0 = time.perf_counter()
        sm_c = seg.sm_chunk
        if verify_sm:
            verify(sm_c, sm, seg.name, len(seg.e_chunks))
        exp = ctx.scratch("exp", seg.numel)
        _decode_e_chunks(seg, e, exp, ctx, verify_e)
        if sm_c.codec == "raw":
            smv = sm
        else:
            smv = ctx.scratch("sm", seg.numel)
            get_codec(sm_c.codec).decompress_into(sm, smv, ctx)
        t1 = time.perf_counter()
        merge_into(exp, smv, out_u16[seg.dst : seg.dst + seg.numel])
        t2 = time.perf_counter()
        if timer is not None:
            timer("decode", t1 - t0)
            timer("merge", t2 - t1)


def u16_view(t) -> np.ndarray:
    """A contiguous bf16 torch tensor's bits as a flat uint16 array (no copy): what decoders write."""
    import torch

    return t.view(torch.int16).numpy().view(np.uint16).reshape(-1)


def decode_e_chunk(seg, k: int, e, dst: np.ndarray, ctx, verify_e: bool) -> None:
    """Decompress E chunk ``k`` of segment ``seg`` (``e``: the segment's stored E bytes) into
    ``dst`` (its ``raw_length`` bytes), verifying its checksum first when ``verify_e``."""
    from zipmoe.codecs.exponent import get_codec

    c = seg.e_chunks[k]
    base = seg.e_range[0]
    src = e[c.offset - base : c.offset - base + c.length]
    if verify_e:
        verify(c, src, seg.name, k)
    try:
        get_codec(c.codec).decompress_into(src, dst, ctx)
    except ContainerError as exc:
        raise ContainerError(f"tensor {seg.name} chunk {k}: {exc}") from None


def _decode_e_chunks(seg, e, exp, ctx, verify_e: bool) -> None:
    """Decompress one segment's E chunks (``e``: its stored E bytes) into ``exp`` (numel bytes)."""
    for k, c in enumerate(seg.e_chunks):
        decode_e_chunk(seg, k, e, exp[c.raw_offset : c.raw_offset + c.raw_length], ctx, verify_e)


def decode_exp_into(tensor: ExpertTensor, e_parts: list, exp_out: np.ndarray, ctx, verify_e: bool) -> None:
    """Decompress only (for a device merge): all segments' E streams into ``exp_out`` (flat, numel)."""
    for seg, e in zip(tensor.segments, e_parts):
        _decode_e_chunks(seg, e, exp_out[seg.dst : seg.dst + seg.numel], ctx, verify_e)
