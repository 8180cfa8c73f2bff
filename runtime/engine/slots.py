"""The full pool's device memory as slot tensors, with an expert->slot map on the device.

One :class:`SlotArena` per compute-tensor kind (unit name and shape, e.g. every layer's
``gate_up`` [2I, H]): one device tensor ``[slots, rows, cols]`` in the compute dtype. The
full pool's data for an expert tensor is a view ``arena.data[slot]`` (the eager path computes
with it as with any tensor). :class:`SlotMap` keeps, per unit name, an int64 map
``[sparse layers, experts]`` (slot, or -1 when the tensor is not in a slot) on the device and
its mirror on the host, updated in stream order at every change, so that a CUDA graph can
gather the routed experts' weights (``index_select`` through the map) with no host round
trip; the host mirror tells the host whether a layer's routing hit only slotted experts.

The arenas share the full pool's capacity: each kind gets the same fraction of its tensors
(every tensor when the pool holds all experts). The cache still decides what is resident
(:mod:`.cache`, by bytes); the map follows it through two hooks of the full pool,
``adopt(uid, data) -> data`` (copy into a free slot; with no slot free, the cache's
least-used tensor of the same kind that no running layer pins is dropped first) and
``release(uid, data)`` (the slot is free again). A tensor that finds no slot at all (every
slotted tensor of its kind pinned) stays a plain tensor, outside the map: the graphed path
treats it as a miss.
"""

from __future__ import annotations

import numpy as np
import torch

from zipmoe.runtime.engine.staging import cuda_block_bytes, own_device

__all__ = ["SlotArena", "SlotMap", "slot_counts", "slot_victim", "arena_bytes"]


def slot_counts(expert_tensors: dict, capacity: int, itemsize: int, cuda: bool = False) -> dict[tuple, int]:
    """Slots per kind of expert tensor (``(unit name, shape)``) in a full pool of ``capacity``
    bytes: every tensor when they all fit, else the same fraction of every kind (on CUDA, as the
    caching allocator rounds each arena, a slot less in the largest arena until they fit).
    The planner's replay (runtime/plan/replay.py) counts slots with it too."""
    count: dict[tuple, int] = {}
    size: dict[tuple, int] = {}
    for ts in expert_tensors.values():
        for t in ts:
            key = (t.name, tuple(t.shape))
            count[key] = count.get(key, 0) + 1
            size[key] = t.numel * itemsize
    total = sum(count[k] * size[k] for k in count)

    def taken(k, n):  # what arena k takes with n slots (on CUDA: as the allocator rounds it)
        b = n * size[k]
        return cuda_block_bytes(b) if cuda and b else b

    if sum(taken(k, count[k]) for k in count) <= capacity:
        return dict(count)
    ns = {k: min(count[k], int(capacity * (count[k] * size[k]) / max(1, total)) // size[k]) for k in count}
    while sum(taken(k, ns[k]) for k in ns) > capacity and any(ns.values()):
        k = max((k for k in ns if ns[k]), key=lambda k: ns[k] * size[k])
        ns[k] -= 1
    return ns


def arena_bytes(expert_tensors: dict, counts: dict, itemsize: int, cuda: bool = False) -> int:
    """What arenas with ``counts`` slots per kind take (on CUDA, as the caching allocator rounds
    each): the full pool's bytes once :class:`SlotMap` has sized it."""
    size = {(t.name, tuple(t.shape)): t.numel * itemsize for ts in expert_tensors.values() for t in ts}
    total = 0
    for k, n in counts.items():
        b = int(n) * size[k]
        total += cuda_block_bytes(b) if cuda and b else b
    return total


def slot_victim(cache, owners, uid: int):
    """The tensor to drop for ``uid`` when its kind has no free slot: among ``owners`` (the uids
    in that kind's slots), the least used (the cache's count, then last use) that no running
    layer pins; None when every one is pinned."""
    best = None
    for v in owners:
        if v == uid or v in cache.pinned:
            continue
        p = cache._prio(v)
        if best is None or p < best[0]:
            best = (p, v)
    return None if best is None else best[1]


class SlotArena:
    """``slots`` tensors of one shape and dtype in one device tensor, with a free list."""

    def __init__(self, key: tuple, slots: int, shape: tuple, dtype, device) -> None:
        self.key = key
        self.shape = tuple(shape)
        self.data = torch.empty((int(slots), *self.shape), dtype=dtype, device=device)
        self.free = list(range(int(slots) - 1, -1, -1))  # pop() gives the lowest slot first
        self.owner: dict[int, int] = {}  # slot -> uid

    @property
    def slots(self) -> int:
        return self.data.shape[0]

    @property
    def nbytes(self) -> int:
        """Its bytes as allocated (on CUDA, as the caching allocator rounds them)."""
        n = self.data.numel() * self.data.element_size()
        return cuda_block_bytes(n) if self.data.device.type == "cuda" and n else n


class SlotMap:
    """Arenas for every kind of expert tensor and the device-side expert->slot maps."""

    def __init__(self, expert_tensors: dict, capacity: int, dtype, device, num_experts: int) -> None:
        """``expert_tensors``: ``{(layer, expert): [ExpertTensor]}``; ``capacity``: the full pool's bytes."""
        self.device = torch.device(device)
        self.dtype = dtype
        self.num_experts = int(num_experts)
        self.layers = sorted({layer for layer, _ in expert_tensors})
        self.row = {layer: i for i, layer in enumerate(self.layers)}
        self.meta: dict[int, tuple] = {}  # uid -> (layer, expert, unit name, arena key)
        self.key_of: dict[tuple, tuple] = {}  # (layer, unit name) -> arena key
        itemsize = torch.empty((), dtype=dtype).element_size()
        for (layer, expert), ts in expert_tensors.items():
            for t in ts:
                key = (t.name, tuple(t.shape))
                self.meta[t.uid] = (layer, expert, t.name, key)
                self.key_of[(layer, t.name)] = key
        ns = slot_counts(expert_tensors, capacity, itemsize, cuda=self.device.type == "cuda")
        self.arenas: dict[tuple, SlotArena] = {}
        for key in sorted(ns):
            self.arenas[key] = SlotArena(key, ns[key], key[1], dtype, self.device)
        # the arenas are allocated once, whole: their bytes never change (held_bytes() reads this
        # at every change of the working set)
        self._nbytes = sum(a.nbytes for a in self.arenas.values())
        self.units = sorted({name for name, _ in ns})
        self.host = {u: np.full((len(self.layers), self.num_experts), -1, dtype=np.int64) for u in self.units}
        self.maps = {u: torch.full((len(self.layers), self.num_experts), -1, dtype=torch.int64, device=self.device)
                     for u in self.units}
        self._dirty: set = set()  # units whose device map lags the host map (flush())
        self.slot_of: dict[int, int] = {}  # uid -> slot (slotted tensors only)
        self.loose_bytes = 0  # full-pool tensors that found no slot
        self.cache = None

    # ------------------------------------------------------------------ wiring
    def attach(self, cache) -> None:
        """Become the hooks of ``cache``'s full pool (and use its priorities to pick victims)."""
        self.cache = cache
        pool = cache.pools["full"]
        pool.adopt = self.adopt
        pool.release = self.release

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def capacity_bytes(self) -> int:
        return self.nbytes

    def arena_of(self, layer: int, unit: str) -> SlotArena:
        return self.arenas[self.key_of[(layer, unit)]]

    def has_free(self, uid: int) -> bool:
        return bool(self.arenas[self.meta[uid][3]].free)

    # ------------------------------------------------------------------ the full pool's hooks
    def adopt(self, uid: int, data):
        """Copy ``data`` into a slot of its kind and return the slot's view (``data`` itself if none)."""
        if uid in self.slot_of:
            return data
        layer, expert, unit, key = self.meta[uid]
        arena = self.arenas[key]
        if not arena.free and self.cache is not None:
            victim = self._victim(arena, uid)
            if victim is not None:
                self.cache.drop(victim)  # calls release(victim): its slot is free now
        if not arena.free:
            data = own_device(data)
            self.loose_bytes += data.numel() * data.element_size()
            return data
        slot = arena.free.pop()
        view = arena.data[slot]
        with torch.no_grad():
            view.copy_(data)
        arena.owner[slot] = uid
        self.slot_of[uid] = slot
        self.host[unit][self.row[layer], expert] = slot
        self._dirty.add(unit)  # the device map follows at the next flush()
        return view

    def release(self, uid: int, data) -> None:
        slot = self.slot_of.pop(uid, None)
        if slot is None:
            if data is not None and hasattr(data, "numel"):
                self.loose_bytes = max(0, self.loose_bytes - data.numel() * data.element_size())
            return
        layer, expert, unit, key = self.meta[uid]
        arena = self.arenas[key]
        del arena.owner[slot]
        arena.free.append(slot)
        self.host[unit][self.row[layer], expert] = -1
        self._dirty.add(unit)

    def flush(self) -> None:
        """Bring the device maps up to the host maps: one small copy per map that changed, on the
        current stream (so every graph launched after it sees the slots; a graph reads the
        device maps). Admissions and evictions change only the host maps: a scalar write to a
        device map per admission was two launches per fetched tensor on the serving thread.
        Every reader of the device maps calls this first (the graphed sparse block before its
        replay, :meth:`layer_views`, :meth:`check`)."""
        if not self._dirty:
            return
        for u in self._dirty:
            # a pageable source: CUDA copies it out before returning, so the host map may change at once
            self.maps[u].copy_(torch.from_numpy(self.host[u]), non_blocking=True)
        self._dirty.clear()

    def _victim(self, arena: SlotArena, uid: int):
        return slot_victim(self.cache, arena.owner.values(), uid)

    # ------------------------------------------------------------------ queries
    def all_slotted(self, layer: int, experts) -> bool:
        """Whether every tensor of every expert in ``experts`` of ``layer`` sits in a slot."""
        r = self.row[layer]
        for u in self.units:
            h = self.host[u][r]
            for e in experts:
                if h[e] < 0:
                    return False
        return True

    def layer_views(self, layer: int) -> tuple:
        """``(gate_up [E, 2I, H], down [E, H, I])``: every expert of ``layer`` in expert order.

        A view of the arena when the layer's experts sit in consecutive slots in expert order
        (what a warm start in (layer, expert) order gives), else a gathered copy. Every expert
        must be slotted (RuntimeError otherwise)."""
        self.flush()
        r = self.row[layer]
        out = []
        for unit in ("gate_up", "down"):
            arena = self.arena_of(layer, unit)
            row = self.host[unit][r]
            if (row < 0).any():
                raise RuntimeError(f"layer {layer}: not every expert's {unit} weight is resident")
            s0 = int(row[0])
            if (row == np.arange(s0, s0 + len(row))).all():
                out.append(arena.data[s0:s0 + len(row)])
            else:
                out.append(arena.data.index_select(0, self.maps[unit][r]))
        return tuple(out)

    def check(self) -> None:
        """Consistency of the maps, the arenas and the cache (for tests)."""
        self.flush()
        for uid, slot in self.slot_of.items():
            layer, expert, unit, key = self.meta[uid]
            arena = self.arenas[key]
            assert arena.owner.get(slot) == uid, (uid, slot)
            assert self.host[unit][self.row[layer], expert] == slot
            if self.cache is not None:
                assert self.cache.state_of(uid) == "full", uid
        for key, arena in self.arenas.items():
            assert len(arena.owner) + len(arena.free) == arena.slots
            assert not set(arena.owner) & set(arena.free)
        for u in self.units:
            assert np.array_equal(self.maps[u].cpu().numpy(), self.host[u])
