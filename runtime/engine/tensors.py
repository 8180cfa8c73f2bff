"""Where expert tensors live in the container: the runtime's unit of caching and scheduling.

:class:`ExpertTensor` is one *compute tensor* of one expert, as the expert's forward uses it.
For the fused families an expert has two, ``gate_up`` ([2I, H]: the container's ``gate`` entry
in the first I rows, ``up`` in the next I, exactly as transformers' loader concatenates them; or
one entry when the source stored ``gate_up_proj`` fused) and ``down`` ([H, I]). For
SwitchTransformers ``up`` (``wi``) and ``down`` (``wo``). Each is made of :class:`Segment` s, one
per container entry, with the byte ranges of its E chunks and its SM chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zipmoe.errors import ContainerError, ModelError
from zipmoe.runtime.engine.reads import ALIGN, ExpertStore, _coalesce, reuse_slack


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
    # what the fetch path asks of this tensor on every fetch (byte sizes, file ranges), worked out
    # once: keyed by what it is derived from (the segments' count and the compute itemsize), so a
    # tensor still being built (segments appended) or changed is never answered from a stale entry
    _memo: dict = field(default_factory=dict, repr=False, compare=False)

    def _memo_get(self, key):
        m = self._memo
        if m.get("_key") != (len(self.segments), self.compute_itemsize):
            m.clear()
            m["_key"] = (len(self.segments), self.compute_itemsize)
        return m.get(key)

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
        v = self._memo_get("e")
        if v is None:
            v = self._memo["e"] = sum(s.e_range[1] for s in self.segments)
        return v

    @property
    def sm_bytes(self) -> int:
        v = self._memo_get("sm")
        if v is None:
            v = self._memo["sm"] = sum(s.sm_range[1] for s in self.segments)
        return v

    @property
    def stored_bytes(self) -> int:
        return self.e_bytes + self.sm_bytes

    def kept_bytes(self, state) -> int:
        """What the compressed pool counts for this tensor taken from a fetch in cache state
        ``state`` (None: a miss; ``sm_only`` / ``e_only``: a hit that read the other half): it
        keeps the read buffers (engine/adopt.py), so the aligned ranges the fetch read, and the
        half it already held as its own arrays."""
        key = ("kept", state)
        v = self._memo_get(key)
        if v is None:
            need_e, need_sm = state in (None, "none", "sm_only"), state in (None, "none", "e_only")
            v = sum(ExpertStore.buffer_size(off, ln) for off, ln in self.ranges(need_e, need_sm))
            v = self._memo[key] = v + (0 if need_e else self.e_bytes) + (0 if need_sm else self.sm_bytes)
        return v

    def ranges(self, need_e: bool, need_sm: bool) -> list[tuple[int, int]]:
        """The coalesced file ranges of the E and/or SM chunks (a list shared between calls:
        read it, do not change it)."""
        key = ("ranges", bool(need_e), bool(need_sm))
        v = self._memo_get(key)
        if v is None:
            rs = []
            for s in self.segments:
                if need_e:
                    rs.append(s.e_range)
                if need_sm:
                    rs.append(s.sm_range)
            v = self._memo[key] = _coalesce(rs)
        return v

    def staging_bytes(self) -> int:
        """Upper bound of the aligned read buffers one fetch of this tensor needs (a reused
        buffer may be up to :func:`reuse_slack` larger than the read)."""
        v = self._memo_get("staging")
        if v is None:
            v = self._memo["staging"] = sum(ln + 2 * ALIGN + reuse_slack(ln + 2 * ALIGN)
                                            for _, ln in self.ranges(True, True))
        return v

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
