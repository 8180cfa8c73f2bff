"""Streaming safetensors shards: the header first (every shape is known up front), then the
tensor bytes appended in order, so no tensor is ever held whole.

Format (https://github.com/huggingface/safetensors): 8-byte little-endian header length N,
N bytes of JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``
padded with spaces to a multiple of 8, then the data; offsets are relative to the data start.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4}

#: Shard size limit: transformers' own default is larger; ~2 GB keeps shards easy to move.
MAX_SHARD_BYTES = 2_000_000_000


@dataclass
class ShardPlan:
    filename: str
    tensors: list = field(default_factory=list)  # (name, dtype, shape, nbytes)

    @property
    def nbytes(self) -> int:
        return sum(t[3] for t in self.tensors)


def plan_shards(tensors: list[tuple[str, str, tuple, int]], max_shard_bytes: int = MAX_SHARD_BYTES) -> list[ShardPlan]:
    """Greedy split in order; a tensor larger than the limit gets a shard of its own."""
    groups: list[list] = [[]]
    size = 0
    for t in tensors:
        if groups[-1] and size + t[3] > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t[3]
    if len(groups) == 1:
        return [ShardPlan("model.safetensors", groups[0])]
    n = len(groups)
    return [ShardPlan(f"model-{i + 1:05d}-of-{n:05d}.safetensors", g) for i, g in enumerate(groups)]


def header_bytes(plan: ShardPlan) -> bytes:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape, nbytes in plan.tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def index_json(plans: list[ShardPlan]) -> str:
    weight_map = {name: p.filename for p in plans for name, *_ in p.tensors}
    total = sum(p.nbytes for p in plans)
    return json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"


class ShardWriter:
    """Write one shard: ``open`` writes the header, ``write`` appends bytes, ``close`` checks the
    byte count against the header (a short file would otherwise look valid)."""

    def __init__(self, path: Path, plan: ShardPlan):
        self.path = Path(path)
        self.plan = plan
        self.expected = plan.nbytes
        self.written = 0
        self.f = open(self.path, "wb")
        self.f.write(header_bytes(plan))

    def write(self, data) -> None:
        mv = memoryview(data).cast("B")
        self.f.write(mv)
        self.written += len(mv)

    def close(self) -> None:
        if self.written != self.expected:
            self.f.close()
            raise RuntimeError(f"{self.path.name}: wrote {self.written} bytes, header says {self.expected}")
        self.f.flush()
        import os

        os.fsync(self.f.fileno())
        self.f.close()
