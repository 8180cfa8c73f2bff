"""The exponent codecs: one small registry of compress / decompress-into-buffer pairs.

Codec ids (docs/format.md section 8): ``raw``, ``zstd`` (the default: tuned optimal-parsing
parameters, see DESIGN.md), ``zstd-fast`` (level 1), ``lz4`` (raw LZ4 block) and ``lz4hc``
(LZ4-HC level 9, same block format).

Compression releases the GIL (python-zstandard and lz4 do), so a thread pool compresses shards
in parallel; each thread keeps its own ``ZstdCompressor`` (they are not thread-safe).

Decompression writes into a caller-provided numpy uint8 buffer. It calls libzstd's
``ZSTD_decompressDCtx`` and lz4's ``LZ4_decompress_safe`` directly through ctypes, from the
symbols the installed ``zstandard`` and ``lz4`` extension modules export: ctypes releases the
GIL for the call, no Python bytes object is allocated for the output, and the zstd context is
reused (one :class:`DecodeContext` per worker thread). Where a symbol is missing it falls back
to the Python APIs (one extra copy); ``DecodeContext(native=False)`` asks for those explicitly
(nothing here reads the environment).
"""

from __future__ import annotations

import ctypes
import glob
import os
import threading
from dataclasses import dataclass
from typing import Callable

import lz4.block
import numpy as np
import zstandard

from zipmoe.errors import ContainerError, UnknownCodecError

# ----------------------------------------------------------------------------- native symbols


def _load(pattern_dir: str, patterns: list[str]):
    for pat in patterns:
        for path in sorted(glob.glob(os.path.join(pattern_dir, pat))):
            try:
                return ctypes.CDLL(path)
            except OSError:
                continue
    return None


def _zstd_lib():
    lib = _load(os.path.dirname(zstandard.__file__), ["_cffi*.so", "backend_c*.so", "*.so"])
    try:
        lib.ZSTD_createDCtx.restype = ctypes.c_void_p
        lib.ZSTD_createDCtx.argtypes = []
        lib.ZSTD_freeDCtx.restype = ctypes.c_size_t
        lib.ZSTD_freeDCtx.argtypes = [ctypes.c_void_p]
        lib.ZSTD_decompressDCtx.restype = ctypes.c_size_t
        lib.ZSTD_decompressDCtx.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                            ctypes.c_void_p, ctypes.c_size_t]
        lib.ZSTD_isError.restype = ctypes.c_uint
        lib.ZSTD_isError.argtypes = [ctypes.c_size_t]
        lib.ZSTD_getErrorName.restype = ctypes.c_char_p
        lib.ZSTD_getErrorName.argtypes = [ctypes.c_size_t]
        return lib
    except (AttributeError, TypeError):
        return None


def _lz4_fn():
    lib = _load(os.path.dirname(lz4.block.__file__), ["_block*.so", "*.so"])
    try:
        fn = lib.LZ4_decompress_safe
    except (AttributeError, TypeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    return fn


_ZSTD = _zstd_lib()
_LZ4_DECOMPRESS = _lz4_fn()


def native_available() -> dict:
    """Which ctypes fast paths this installation has (what ``DecodeContext(native=True)`` uses;
    for benchmarks and tests)."""
    return {"zstd": _ZSTD is not None, "lz4": _LZ4_DECOMPRESS is not None}


# ----------------------------------------------------------------------------- decode context


class DecodeContext:
    """Per-thread decode state: the zstd DCtx and reusable scratch buffers. Not thread-safe.

    ``native``: decode through libzstd's and lz4's own symbols by ctypes where this installation
    has them (the default; :func:`native_available`), else (``False``) through the Python APIs
    of ``zstandard`` and ``lz4``, one extra copy per chunk.
    """

    def __init__(self, native: bool = True) -> None:
        self.native = bool(native)
        self._dctx = _ZSTD.ZSTD_createDCtx() if self.native and _ZSTD is not None else None
        if self.native and _ZSTD is not None and not self._dctx:
            raise MemoryError("ZSTD_createDCtx failed")
        self._py_dctx = None
        self._scratch: dict[str, np.ndarray] = {}

    def scratch(self, name: str, n: int) -> np.ndarray:
        """A reusable uint8 buffer of at least ``n`` bytes (returns a view of exactly ``n``)."""
        buf = self._scratch.get(name)
        if buf is None or buf.shape[0] < n:
            buf = np.empty(max(n, 1), np.uint8)
            self._scratch[name] = buf
        return buf[:n]

    @property
    def py_dctx(self) -> zstandard.ZstdDecompressor:
        if self._py_dctx is None:
            self._py_dctx = zstandard.ZstdDecompressor()
        return self._py_dctx

    def close(self) -> None:
        if self._dctx and _ZSTD is not None:
            _ZSTD.ZSTD_freeDCtx(self._dctx)
        self._dctx = None

    def __del__(self) -> None:  # pragma: no cover - interpreter shutdown order varies
        try:
            self.close()
        except Exception:
            pass


_thread_ctx = threading.local()


def thread_context() -> DecodeContext:
    """The calling thread's own DecodeContext (created on first use)."""
    ctx = getattr(_thread_ctx, "ctx", None)
    if ctx is None:
        ctx = _thread_ctx.ctx = DecodeContext()
    return ctx


def _src_array(src) -> np.ndarray:
    if isinstance(src, np.ndarray):
        return src if src.dtype == np.uint8 and src.flags.c_contiguous else np.ascontiguousarray(src).view(np.uint8).reshape(-1)
    return np.frombuffer(src, dtype=np.uint8)


def _check_dst(dst: np.ndarray) -> None:
    if not (isinstance(dst, np.ndarray) and dst.dtype == np.uint8 and dst.ndim == 1 and dst.flags.c_contiguous and dst.flags.writeable):
        raise ValueError("dst must be a writeable 1-D contiguous uint8 numpy array")


# ----------------------------------------------------------------------------- codecs


@dataclass(frozen=True)
class Codec:
    """A codec id and its two operations (see module docstring)."""

    id: str
    description: str
    _compress: Callable
    _decompress_into: Callable

    def compress(self, data) -> bytes:
        """Compress bytes / memoryview / uint8 array; thread-safe, releases the GIL."""
        return self._compress(data)

    def decompress_into(self, src, dst: np.ndarray, ctx: DecodeContext | None = None) -> None:
        """Decode ``src`` into exactly ``len(dst)`` bytes of ``dst``; ContainerError when malformed."""
        _check_dst(dst)
        self._decompress_into(src, dst, ctx if ctx is not None else thread_context())

    def decompress(self, src, raw_length: int, ctx: DecodeContext | None = None) -> np.ndarray:
        out = np.empty(raw_length, np.uint8)
        self.decompress_into(src, out, ctx)
        return out


def _as_buffer(data):
    if isinstance(data, np.ndarray):
        return memoryview(np.ascontiguousarray(data).view(np.uint8).reshape(-1))
    return data


# raw


def _raw_compress(data) -> bytes:
    return bytes(_as_buffer(data))


def _raw_decompress_into(src, dst, ctx) -> None:
    s = _src_array(src)
    if s.shape[0] != dst.shape[0]:
        raise ContainerError(f"raw chunk holds {s.shape[0]} bytes, expected {dst.shape[0]}")
    dst[:] = s


# zstd

ZSTD_TUNED = dict(window_log=20, chain_log=12, hash_log=12, search_log=1, min_match=7,
                  target_length=16, strategy=zstandard.STRATEGY_BTOPT)

_cctx_local = threading.local()


def _cctx(kind: str) -> zstandard.ZstdCompressor:
    c = getattr(_cctx_local, kind, None)
    if c is None:
        if kind == "zstd":
            params = zstandard.ZstdCompressionParameters(write_content_size=True, **ZSTD_TUNED)
            c = zstandard.ZstdCompressor(compression_params=params)
        else:
            c = zstandard.ZstdCompressor(level=1, write_content_size=True)
        setattr(_cctx_local, kind, c)
    return c


def _zstd_compress_with(kind: str):
    def compress(data) -> bytes:
        return _cctx(kind).compress(_as_buffer(data))
    return compress


def _zstd_decompress_into(src, dst, ctx: DecodeContext) -> None:
    n = dst.shape[0]
    s = _src_array(src)
    if _ZSTD is not None and ctx._dctx:
        r = _ZSTD.ZSTD_decompressDCtx(ctx._dctx, dst.ctypes.data, n, s.ctypes.data, s.shape[0])
        if _ZSTD.ZSTD_isError(r):
            raise ContainerError(f"zstd chunk is malformed: {_ZSTD.ZSTD_getErrorName(r).decode(errors='replace')}")
        if r != n:
            raise ContainerError(f"zstd chunk decodes to {r} bytes, expected {n}")
        return
    try:
        out = ctx.py_dctx.decompress(s, max_output_size=n)
    except zstandard.ZstdError as exc:
        raise ContainerError(f"zstd chunk is malformed: {exc}") from None
    if len(out) != n:
        raise ContainerError(f"zstd chunk decodes to {len(out)} bytes, expected {n}")
    dst[:] = np.frombuffer(out, np.uint8)


# lz4


def _lz4_compress(data) -> bytes:
    return lz4.block.compress(_as_buffer(data), mode="default", store_size=False)


def _lz4hc_compress(data) -> bytes:
    return lz4.block.compress(_as_buffer(data), mode="high_compression", compression=9, store_size=False)


def _lz4_decompress_into(src, dst, ctx) -> None:
    n = dst.shape[0]
    s = _src_array(src)
    if s.shape[0] >= 1 << 31 or n >= 1 << 31:
        raise ContainerError("lz4 chunk larger than 2 GiB")
    if ctx.native and _LZ4_DECOMPRESS is not None:
        r = _LZ4_DECOMPRESS(s.ctypes.data, dst.ctypes.data, s.shape[0], n)
        if r != n:
            raise ContainerError(f"lz4 chunk is malformed (decoder returned {r}, expected {n} bytes)")
        return
    try:
        out = lz4.block.decompress(s.tobytes(), uncompressed_size=n)
    except lz4.block.LZ4BlockError as exc:
        raise ContainerError(f"lz4 chunk is malformed: {exc}") from None
    if len(out) != n:
        raise ContainerError(f"lz4 chunk decodes to {len(out)} bytes, expected {n}")
    dst[:] = np.frombuffer(out, np.uint8)


CODECS: dict[str, Codec] = {
    "raw": Codec("raw", "stored as is", _raw_compress, _raw_decompress_into),
    "zstd": Codec("zstd", "zstd, tuned optimal parsing (btopt, window 2^20): smallest, fast decode",
                  _zstd_compress_with("zstd"), _zstd_decompress_into),
    "zstd-fast": Codec("zstd-fast", "zstd level 1: fast to pack", _zstd_compress_with("zstd-fast"), _zstd_decompress_into),
    "lz4": Codec("lz4", "LZ4 block, default mode", _lz4_compress, _lz4_decompress_into),
    "lz4hc": Codec("lz4hc", "LZ4-HC level 9, LZ4 block", _lz4hc_compress, _lz4_decompress_into),
}

DEFAULT_CODEC = "zstd"
PACK_CODECS = ("zstd", "zstd-fast", "lz4", "lz4hc")


def get_codec(codec_id: str) -> Codec:
    try:
        return CODECS[codec_id]
    except KeyError:
        raise UnknownCodecError(f"unknown codec {codec_id!r}: choose one of {', '.join(CODECS)}") from None


def compress_or_raw(codec: Codec, data) -> tuple[str, bytes]:
    """Compress; store raw instead when compression does not shrink the data."""
    buf = _as_buffer(data)
    if codec.id != "raw":
        out = codec.compress(buf)
        if len(out) < len(buf):
            return codec.id, out
    return "raw", bytes(buf)
