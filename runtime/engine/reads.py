"""Reads of chunk ranges from the container file, into reused page-aligned buffers.

* :class:`ExpertStore`: positional reads with ``O_DIRECT`` where the file system allows (the
  page cache then does not hide the disk), into page-aligned buffers (anonymous ``mmap``),
  reading 4096-aligned ranges, cut into pieces that several reader threads read at once
  (queue depth > 1, ``os.preadv`` releases the GIL), and slicing; plain ``pread`` where
  ``O_DIRECT`` is refused (tmpfs, some overlay file systems: ``EINVAL``), counted and shown.
* :class:`ReadBuffers`: those aligned buffers, reused. A fresh anonymous mapping costs a page
  fault per 4 KiB the first time the kernel writes into it, and in a VM a fault is expensive:
  on the CPU box, O_DIRECT reads of 1.7 MB ran at 0.7 GiB/s into fresh mappings and at
  1.1 GiB/s into a reused one (docs/benchmarks.md §10). The runtime hands a fetch's buffers back
  once the tensor is whole and admitted; idle buffers count in its held bytes.
"""

from __future__ import annotations

import errno
import mmap
import os
import time

import numpy as np

from zipmoe.errors import ContainerError

ALIGN = 4096
_REUSE_SLACK_MIN = 2 * ALIGN  # so that a reused buffer rounded up to pages still fits (see ReadBuffers.get)
_COALESCE_GAP = 64 * 1024  # read across gaps up to this size (alignment padding) in one call
READ_PIECE = 1 << 20  # the largest single read: a tensor's range is cut into pieces the readers share


def reuse_slack(n: int) -> int:
    """How much larger than a read a reused buffer may be (counted in the working set)."""
    return max(_REUSE_SLACK_MIN, n // 16)


def fresh_size(size: int) -> int:
    """The length of a new buffer for a read of ``size`` bytes: a little room above it, so that
    the next read of this tensor (whose compressed size may differ slightly) reuses it; page
    aligned (anonymous memory always is). At most ``size + reuse_slack(size)``."""
    return -(-(size + reuse_slack(size) // 2) // ALIGN) * ALIGN


def _coalesce(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for off, ln in sorted(r for r in ranges if r[1] > 0):
        if out and off - (out[-1][0] + out[-1][1]) <= _COALESCE_GAP:
            out[-1][1] = max(out[-1][1], off + ln - out[-1][0])
        else:
            out.append([off, ln])
    return [(a, b) for a, b in out]


class ReadBuffers:
    """Page-aligned buffers for O_DIRECT reads, kept for reuse (see the module doc).

    :meth:`get` returns the smallest idle buffer at least as large as asked and at most
    ``limit`` bytes (default: :func:`reuse_slack` larger than asked), else a new one
    (:func:`fresh_size`); :meth:`put` takes buffers back and drops the largest idle ones beyond
    ``max_idle`` bytes. A buffer is handed back only when no view into it is used any more (the
    runtime copies what its cache keeps).

    The runtime passes as ``limit`` what its working set already counts for the fetch
    (``Reader.prepare``: a tensor's reads of a miss, whatever it reads now), so that a read of
    the SM half alone (an E-only hit) takes the idle buffer a miss of that tensor left instead of
    mapping a fresh one. With host pools on CUDA, whose window leaves idle buffers little room,
    reads of three sizes had nearly every one map a fresh buffer (a page fault per 4 KiB on the
    reader) and unmap another (on the serving thread): docs/runtime.md, "Read buffers".
    """

    def __init__(self, counters=None) -> None:
        import threading

        self._counters = counters
        self._lock = threading.Lock()
        self._idle: list = []  # mmaps
        self.idle_bytes = 0
        self.reused = 0
        self.made = 0

    def get(self, size: int, limit: int | None = None) -> mmap.mmap:
        limit = max(size + reuse_slack(size), 0 if limit is None else int(limit))
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
        return mmap.mmap(-1, fresh_size(size))

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
    """Positional reads from the container, O_DIRECT when possible, from several reader threads.

    A read of ``[offset, offset+length)`` covers the 4096-aligned range around it, cut into
    pieces of at most ``piece`` bytes (:meth:`pieces`), each read by one ``os.preadv`` call
    (:meth:`read_piece`) into its place in one aligned buffer. ``os.preadv`` releases the GIL,
    so reader threads that each take a piece keep several requests in flight (queue depth = the
    number of readers), which one thread reading a tensor in one call could not (it held the
    disk at queue depth 1 and took the GIL back between reads). :meth:`read` does the pieces of
    one range in the calling thread. Thread-safe.

    O_DIRECT refused by the file system (``EINVAL`` on the first read: tmpfs, some overlay file
    systems) falls back to buffered reads for the rest of the run; that is counted
    (``Counters.direct_fallbacks``, ``buffered_reads``) and shown, not silent: a buffered read is
    served by the page cache when the file is there, so figures measured so are not the disk's.
    """

    def __init__(self, path, counters=None, direct: bool = True, piece: int = None) -> None:
        import threading

        self.path = str(path)
        self.counters = counters
        self.buffers = ReadBuffers(counters)
        self.piece = max(ALIGN, (int(piece or READ_PIECE) // ALIGN) * ALIGN)
        self._lock = threading.Lock()
        self._fd = os.open(self.path, os.O_RDONLY)
        self._dfd = -1
        self.fallback_reason: str | None = None
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self._dfd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
            except OSError as exc:
                self._dfd = -1
                self._fell_back(f"open with O_DIRECT: {exc.strerror}")
        elif direct:
            self._fell_back("this system has no O_DIRECT")
        self.direct = self._dfd >= 0

    def _fell_back(self, why: str) -> None:
        self.fallback_reason = why
        if self.counters is not None:
            self.counters.note_direct_fallback()

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

    def pieces(self, offset: int, length: int) -> list[tuple[int, int, int, int]]:
        """The reads that make ``[offset, offset+length)`` whole: ``(file offset, offset in the
        buffer, bytes, bytes needed)`` each (aligned; the last may be short at the end of the
        file, but not shorter than its ``needed``)."""
        start = offset - offset % ALIGN
        end = -(-(offset + length) // ALIGN) * ALIGN
        out = []
        pos = start
        while pos < end:
            n = min(self.piece, end - pos)
            need = max(0, min(pos + n, offset + length) - pos)
            out.append((pos, pos - start, n, need))
            pos += n
        return out

    def read_piece(self, buf, file_off: int, buf_off: int, n: int, need: int) -> tuple[int, bool]:
        """Read ``n`` bytes at ``file_off`` into ``buf[buf_off:]``; returns (bytes read, direct?).
        ContainerError when fewer than ``need`` bytes came (a truncated file) or the read failed."""
        mv = memoryview(buf)[buf_off : buf_off + n]
        try:
            if self.direct:
                try:
                    return self._fill(self._dfd, mv, file_off, need), True
                except OSError as exc:
                    if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.EFAULT):
                        raise ContainerError(f"cannot read {self.path}: {exc.strerror}") from None
                    with self._lock:
                        if self.direct:  # the first thread to meet it switches; the fd stays open for the others
                            self.direct = False
                            self._fell_back(f"O_DIRECT read refused: {exc.strerror}")
            try:
                return self._fill(self._fd, mv, file_off, need), False
            except OSError as exc:
                raise ContainerError(f"cannot read {self.path}: {exc.strerror}") from None
        finally:
            mv.release()

    def _fill(self, fd: int, mv: memoryview, file_off: int, need: int) -> int:
        got = 0
        size = len(mv)
        while got < size:
            k = os.preadv(fd, [mv[got:]], file_off + got)
            if k <= 0:
                break
            got += k
        if got < need:
            raise ContainerError(f"{self.path} is truncated: short read at offset {file_off + got}")
        return got

    def new_buffer(self, offset: int, length: int):
        return mmap.mmap(-1, self.buffer_size(offset, length))  # anonymous memory is page aligned, as O_DIRECT wants

    @staticmethod
    def view(buf, offset: int, length: int) -> np.ndarray:
        """The bytes ``[offset, offset+length)`` in ``buf`` after its pieces were read."""
        lead = offset % ALIGN
        return np.frombuffer(buf, np.uint8, count=lead + length)[lead:]

    def account(self, payload: int, disk: int, seconds: float, state: str | None, direct: bool) -> None:
        if self.counters is not None:
            self.counters.add_read(payload, disk, seconds, state, buffered=not direct)

    def read(self, offset: int, length: int, payload: int | None = None, buf=None, state: str | None = None) -> np.ndarray:
        """Bytes ``[offset, offset+length)`` of the file as a uint8 array (a view into an aligned buffer).

        ``payload``: how many of these bytes are chunk bytes (the rest is padding read across);
        counted as ``bytes_read`` (``bytes_read_disk`` counts what was transferred).
        ``buf``: a page-aligned buffer of at least :meth:`buffer_size` bytes to read into (one
        from :attr:`buffers`, for the caller to hand back once it no longer uses the view);
        without it a fresh one is mapped. ``state``: the cache state of the tensor read for
        (``Counters.reads_by_state``). The pieces are read one after the other here; the
        fetcher hands them to its reader threads instead (engine/reader.py)."""
        if length <= 0:
            return np.empty(0, np.uint8)
        t0 = time.perf_counter()
        if buf is None:
            buf = self.new_buffer(offset, length)
        disk, direct = 0, True
        for file_off, buf_off, n, need in self.pieces(offset, length):
            got, d = self.read_piece(buf, file_off, buf_off, n, need)
            disk += got
            direct = direct and d
        self.account(length if payload is None else payload, disk, time.perf_counter() - t0, state, direct)
        return self.view(buf, offset, length)


def slice_of(buffers: list[tuple[int, np.ndarray]], rng: tuple[int, int]) -> np.ndarray:
    """The bytes of file range ``rng`` from buffers read as ``(file_offset, array)``."""
    off, ln = rng
    for boff, arr in buffers:
        if boff <= off and off + ln <= boff + arr.shape[0]:
            return arr[off - boff : off - boff + ln]
    raise AssertionError(f"range {rng} was not read")  # pragma: no cover - fetcher bug
