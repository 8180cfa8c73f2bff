"""What an entry's role, layer, expert, projection and fused index must be (docs/format.md 6.1).

The index's ``role/layer/expert/proj/fused_index`` fields are not trusted as written: they must
be what the naming rules (:func:`zipmoe.codecs.naming.classify`) derive from the entry's name
and source shape. :func:`derive` is the one place that turns a source tensor's name into the
entries the writer stores (``writer.plan_items`` uses it), and :func:`check_metadata` is what a
reader runs when it opens a file (``ContainerReader`` calls it, so ``verify``, ``unpack`` and the
serving runtime all refuse a file whose metadata disagrees, with the same one line).
"""

from __future__ import annotations

from typing import NamedTuple

from zipmoe.errors import ContainerError

from .naming import _FUSED, classify, num_experts

__all__ = ["Derived", "derive", "check_metadata"]


class Derived(NamedTuple):
    """What one source tensor becomes: ``fused`` is the expert count E of a fused tensor
    (stored as E entries, ``expert == fused_index``), None otherwise."""

    role: str
    layer: int | None
    expert: int | None
    proj: str | None
    fused: int | None


def derive(name: str, source_shape: tuple, config: dict | None) -> Derived:
    """The metadata the naming rules give ``name`` with ``source_shape`` (see the module doc)."""
    r = classify(name, tuple(source_shape), config)
    if r.role == "expert" and r.fused and len(source_shape) >= 1 and source_shape[0] > 0:
        return Derived("expert", r.layer, None, r.proj, int(source_shape[0]))
    if r.role == "expert" and r.expert is not None:
        return Derived("expert", r.layer, r.expert, r.proj, None)
    return Derived("dense", r.layer, None, None, None)


def _slot(name: str, proj: str | None, fused: bool) -> tuple:
    """``(proj, suffix)``: what an expert entry is within its expert (a weight or a bias of which
    projection), so that two names meaning the same thing collide."""
    parts = name.split(".")
    k = parts.index("experts")
    if fused:
        seg = parts[k + 1]
        for prefix, _ in _FUSED:
            if seg.startswith(prefix):
                return (proj, seg[len(prefix):] + "." + ".".join(parts[k + 2:]))
        return (proj, seg)  # pragma: no cover - classify only calls fused what matches a prefix
    raw = parts[k + 2] if k + 2 < len(parts) else ""
    return (proj if proj is not None else raw, ".".join(parts[k + 3:]))


def _fmt(v) -> str:
    return "none" if v is None else repr(v) if isinstance(v, str) else str(v)


def check_metadata(entries: list, config: dict | None, meta: dict | None, where: str = "file") -> None:
    """Raise :class:`ContainerError` (one line, naming the entry) unless every entry's metadata
    is what :func:`derive` gives its name, no expert slot is filled twice, and every layer with
    experts has every expert (docs/format.md 6.1)."""

    def bad(msg: str) -> None:
        raise ContainerError(f"{where} has wrong metadata: {msg}")

    groups: dict[str, list] = {}
    for e in entries:
        groups.setdefault(e.name, []).append(e)
    slots: dict[tuple, str] = {}
    layers: dict = {}
    for name, es in groups.items():
        src = tuple(es[0].source_shape)
        d = derive(name, src, config)
        if d.fused is not None:
            if len(es) != d.fused:
                bad(f"fused tensor {name} has {len(es)} entries, its source shape {list(src)} says {d.fused}")
            if sorted((e.fused_index if e.fused_index is not None else -1) for e in es) != list(range(d.fused)):
                bad(f"fused tensor {name}: the index does not hold experts 0..{d.fused - 1} exactly once")
        elif len(es) != 1:
            bad(f"tensor {name} appears {len(es)} times in the index")
        fused = d.fused is not None
        for e in es:
            want_expert = e.fused_index if fused else d.expert
            want_fused = e.fused_index if fused else None
            want_shape = src[1:] if fused else src
            if ((e.role, e.layer, e.expert, e.proj, e.fused_index, tuple(e.shape), tuple(e.source_shape))
                    != (d.role, d.layer, want_expert, d.proj, want_fused, want_shape, src)):
                label = f"{name} (expert {e.fused_index})" if fused and e.fused_index is not None else name
                if tuple(e.source_shape) != src:
                    bad(f"tensor {label}: source_shape {list(e.source_shape)} differs from {list(src)} of its other entries")
                for field, have, want in (("role", e.role, d.role), ("layer", e.layer, d.layer),
                                          ("expert", e.expert, want_expert), ("proj", e.proj, d.proj),
                                          ("fused_index", e.fused_index, want_fused),
                                          ("shape", list(e.shape), list(want_shape))):
                    if have != want:
                        bad(f"tensor {label}: index says {field} {_fmt(have)}, its name and shape say {_fmt(want)}")
            if d.role == "expert":
                slot = _slot(name, d.proj, fused)
                key = (e.layer, e.expert) + slot
                if key in slots:
                    label = f"{name} (expert {e.fused_index})" if fused else name
                    bad(f"tensors {slots[key]} and {label} are both layer {e.layer} expert {e.expert} "
                        f"{slot[0]}{' ' + slot[1] if slot[1] else ''}")
                slots[key] = f"{name} (expert {e.fused_index})" if fused else name
                layers.setdefault(e.layer, {}).setdefault(e.expert, set()).add(slot)
    if not layers:
        return
    n = num_experts(config)
    said = "config.json says"
    if n is None:
        m = (meta or {}).get("model")
        v = m.get("num_experts") if isinstance(m, dict) else None
        n, said = (v, "the index's meta says") if type(v) is int and v > 0 else (None, "")
    if n is None:
        n = 1 + max(x for ex in layers.values() for x in ex)
        said = "other layers have"
    want = set(range(n))
    for layer in sorted(layers, key=lambda x: -1 if x is None else x):
        ex = layers[layer]
        missing, extra = want - set(ex), set(ex) - want
        if missing:
            bad(f"layer {layer} has no expert {min(missing)} ({said} {n} experts per layer)")
        if extra:
            bad(f"layer {layer} has expert {min(extra)} ({said} {n} experts per layer)")
        ref = ex[0]
        for x in sorted(ex):
            if ex[x] != ref:
                diff = sorted((ex[x] ^ ref), key=str)[0]
                part = f"{diff[0]}{' ' + diff[1] if diff[1] else ''}"
                bad(f"layer {layer} expert {x} and expert 0 differ: only one of them has {part}")
