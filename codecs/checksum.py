"""Chunk checksums: XXH3-64 (seed 0) of the stored bytes, written as 16 lowercase hex digits.

See docs/format.md section 7.
"""

from __future__ import annotations

import xxhash

from zipmoe.errors import ChecksumError


def checksum(data) -> int:
    """XXH3-64 of ``data`` (bytes, bytearray, memoryview or a contiguous numpy array)."""
    return xxhash.xxh3_64_intdigest(data)


def to_hex(value: int) -> str:
    return format(value, "016x")


def from_hex(text: str) -> int:
    if not isinstance(text, str) or len(text) != 16:
        raise ValueError(f"checksum must be 16 hex digits, got {text!r}")
    return int(text, 16)


def container_id(index_bytes: bytes) -> str:
    """Stable identity of a container: XXH3-128 hex digest of its index bytes."""
    return xxhash.xxh3_128_hexdigest(index_bytes)


def verify_chunk(chunk, stored, name: str = "?", k: int | str = "?") -> None:
    """The one check of a chunk's stored bytes before use: their length and their XXH3-64 must
    be the index's (``chunk.length``, ``chunk.checksum``); else raise
    ``ChecksumError("tensor NAME chunk K (KIND): checksum mismatch ...")``."""
    if len(stored) != chunk.length or checksum(stored) != chunk.checksum:
        raise ChecksumError(f"tensor {name} chunk {k} ({chunk.kind}): checksum mismatch (the container is corrupted)")
