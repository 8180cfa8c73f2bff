"""Sizes as people write them: ``24G``, ``24GiB``, ``512M``, ``1.5T``, ``4096``.

K, M, G and T are binary multiples (as ``free -h`` and ``ls -h`` print them); the suffixes
``KB``/``KiB`` and friends mean the same. A plain number is bytes.
"""

from __future__ import annotations

import re

from .errors import UsageError

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}
_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([KMGTP]?)(I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """Parse a size into bytes; raise :class:`UsageError` with the accepted forms."""
    if isinstance(text, int):
        if text < 0:
            raise UsageError(f"size must not be negative: {text}")
        return text
    m = _RE.match(str(text))
    if not m:
        raise UsageError(f"cannot read size {text!r}: use a number with an optional unit, e.g. 24G, 24GiB, 512M, 1.5T or 4096")
    number, unit = m.group(1), m.group(2).upper()
    value = float(number) * _UNITS[unit]
    if unit == "" and "." in number:
        raise UsageError(f"cannot read size {text!r}: a plain byte count must be a whole number")
    return int(round(value))


def format_size(n: float) -> str:
    """Format bytes for people: ``1.50 GiB``, ``512.0 MiB``, ``4096 B``."""
    n = float(n)
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
