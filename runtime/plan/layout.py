"""What the planner needs to know about a container: sizes of experts, dense weights, working set.

Expert tensors are grouped exactly as the runtime groups them (runtime.engine.tensors' ExpertTensor:
``gate_up`` and ``down`` for the fused families, ``up`` and ``down`` for SwitchTransformers),
so that a runtime.plan.simulate Task is one runtime compute tensor.

Budget accounting mirrors runtime.engine.core.Runtime::

    budget = dense + scratch + window * expert_working + pools
    scratch = workers * 2 * largest segment (decode scratch per worker)
    expert_working = max over experts of sum(bf16 bytes + aligned read buffers)
    window = min(workers + 2, what fits), at least 1
    min budget = dense + scratch + expert_working

``decode_layers`` are the sparse layers one decode step runs: all of them for decoder-only
models, the decoder's for SwitchTransformers (its layer numbers follow the encoder's; see
codecs.naming.switch_layer). The planner plans slots for those layers: the runtime's cache
counts uses per layer call, so the encoder's experts (used once per prompt) do not stay cached.

``dense_bytes`` is the size of the container's dense entries in the compute dtype (the runtime
counts its resident parameters, which can differ by tied weights or modules kept in float32;
when a plan's pools do not fit, the runtime scales them down keeping their shape).
"""

from __future__ import annotations

from dataclasses import dataclass

from zipmoe.errors import ModelError

__all__ = ["ContainerLayout", "container_layout", "expert_tensors"]


@dataclass
class ContainerLayout:
    path: str
    container_id: str
    file_size: int
    num_layers: int
    num_experts: int
    top_k: int
    sparse_layers: list[int]
    dense_bytes: int
    dense_matmul_bytes: int  # 2-D dense weights except embeddings (GEMV work per token)
    units: list[tuple[str, tuple[int, int], int, int, int]]  # (name, shape, nbytes, e_bytes, sm_bytes), mean expert
    expert_full_bytes: int  # one expert, all units, bf16
    expert_working: int  # runtime.engine.core: max per expert of bf16 + staging bytes
    max_segment: int  # largest segment numel (decode scratch)
    total_expert_full: int  # all experts, as computed with (compute dtype)
    decode_layers: list[int] | None = None  # sparse layers a decode step runs (seq2seq: the decoder's)
    compute_itemsize: int = 2  # bytes per value the experts compute with (bf16 2, float32 4)
    dtype: str = "bfloat16"
    chunks: list[int] | None = None  # per unit: the mean expert's stored E chunks (None: 1 each)
    device_scratch: int = 0  # on CUDA: the device merge buffer and the ring's page rounding (runtime.engine.core._sizes)

    def __post_init__(self) -> None:
        if self.decode_layers is None:
            self.decode_layers = list(self.sparse_layers)

    @property
    def tensors(self) -> list[tuple[int, int, int]]:
        """runtime.plan.simulate ``tensors``: (nbytes, e_bytes, sm_bytes, chunks) per compute tensor of one
        expert (``chunks``: its stored E chunks, the decode jobs the runtime splits it into)."""
        chunks = self.chunks or [1] * len(self.units)
        return [(nb, eb, sb, c) for (_, _, nb, eb, sb), c in zip(self.units, chunks)]

    @property
    def slot_bytes(self) -> dict[str, int]:
        """Bytes one expert slot costs in each pool (full: as computed with, e.g. float32)."""
        full = sum(u[2] for u in self.units) * self.compute_itemsize // 2
        e = sum(u[3] for u in self.units)
        sm = sum(u[4] for u in self.units)
        return {"full": full, "compressed": e + sm, "sm_only": sm, "e_only": e}

    def scratch_bytes(self, workers: int) -> int:
        return max(1, workers) * 2 * self.max_segment + self.device_scratch

    def min_budget(self, workers: int) -> int:
        return self.dense_bytes + self.scratch_bytes(workers) + self.expert_working

    def window(self, budget: int, workers: int) -> int:
        """Experts the runtime keeps in flight at once under ``budget`` (runtime.engine.core)."""
        left = budget - self.dense_bytes - self.scratch_bytes(workers)
        return max(1, min(workers + 2, left // max(1, self.expert_working)))

    def pool_bytes(self, budget: int, workers: int) -> int:
        """What the runtime leaves for the pools under ``budget`` (0 when below the minimum)."""
        left = budget - self.dense_bytes - self.scratch_bytes(workers)
        if left < self.expert_working:
            return 0
        window = max(1, min(workers + 2, left // max(1, self.expert_working)))
        return max(0, left - window * self.expert_working)


def expert_tensors(reader, family=None, compute_itemsize: int = 2) -> dict:
    """The container's expert tensors grouped as the runtime groups them
    (``{(layer, expert): [ExpertTensor per unit]}``, runtime.engine.tensors), with the shapes the
    entries themselves give (no model skeleton is built); ``compute_itemsize``: bytes per value
    the experts compute with (their full-pool size)."""
    from zipmoe.runtime.engine.families import family_for
    from zipmoe.runtime.engine.tensors import build_expert_tensors

    family = family or family_for(reader.config, reader.meta)
    # expected shapes from the entries themselves: rows of a unit = sum of its projections' rows
    proj_to_unit = {p: u for u, projs in family.units for p in projs}
    rows: dict[tuple[int, int, str], int] = {}
    cols: dict[tuple[int, str], int] = {}
    for e in reader.entries:
        if e.role != "expert" or len(e.shape) != 2:
            continue
        unit = "gate_up" if e.proj == "gate_up" else proj_to_unit.get(e.proj)
        if unit is None:
            continue
        ex = e.expert if e.expert is not None else e.fused_index
        rows[(e.layer, ex, unit)] = rows.get((e.layer, ex, unit), 0) + e.shape[0]
        cols[(e.layer, unit)] = e.shape[1]
    expected: dict[int, dict[str, tuple[int, int]]] = {}
    for (layer, _ex, unit), r in rows.items():
        expected.setdefault(layer, {})[unit] = (r, cols[(layer, unit)])
    return build_expert_tensors(reader.entries, family, expected, compute_itemsize=compute_itemsize)


def container_layout(reader, dtype: str = "bfloat16", device: str = "cpu") -> ContainerLayout:
    """Read sizes from an open ContainerReader (no tensor data is read).

    ``dtype``: what the runtime computes in (``zipmoe.load(dtype=...)``): float32 experts cost
    4 bytes per value in the full pool and in flight. ``device``: on CUDA each tensor in flight
    also has a pinned host staging buffer of its bf16 bytes (runtime.engine.core).
    """
    from zipmoe.runtime.engine.dtypes import ITEMSIZE, compute_dtype
    from zipmoe.runtime.engine.families import family_for

    meta_model = reader.meta.get("model") or {}
    family = family_for(reader.config, reader.meta)
    experts = expert_tensors(reader, family)
    if not experts:
        raise ModelError(f"{reader.path} has no expert tensors: there is nothing to plan")
    sparse_layers = sorted({l for l, _ in experts})
    num_experts = int(meta_model.get("num_experts") or (max(e for _, e in experts) + 1))
    top_k = meta_model.get("top_k")
    if not isinstance(top_k, int) or top_k < 1:  # as runtime.engine.loader: config keys, else top-1 (Switch)
        cfg = reader.config or {}
        top_k = next((cfg[k] for k in ("num_experts_per_tok", "top_k", "moe_topk") if isinstance(cfg.get(k), int)), 1)
    # the mean expert, unit by unit
    n = len(experts)
    names = [u for u, _ in family.units]
    units, chunks = [], []
    for j, name in enumerate(names):
        ts = [ts[j] for ts in experts.values()]
        units.append((name, ts[0].shape, round(sum(t.full_bytes for t in ts) / n),
                      round(sum(t.e_bytes for t in ts) / n), round(sum(t.sm_bytes for t in ts) / n)))
        chunks.append(max(1, round(sum(len(sg.e_chunks) for t in ts for sg in t.segments) / n)))
    dtype_name = compute_dtype(dtype, reader.config or {})
    itemsize = ITEMSIZE[dtype_name]
    cuda = str(device).startswith("cuda")
    # the runtime's own arithmetic (runtime.engine.core._sizes: working_bytes_of, the converted tensor when not
    # bf16; on CUDA the allocator's rounding of each expert's device buffer, its slot in the pinned staging ring
    # and the device merge buffer): the budgets the planner and the profile's passes size must be the runtime's
    from zipmoe.runtime.engine.core import _sizes

    as_computed = expert_tensors(reader, family, compute_itemsize=itemsize) if itemsize != 2 else experts
    working, scratch1, _slot = _sizes(as_computed, 1, cuda=cuda)
    max_seg = max(s.numel for ts in experts.values() for t in ts for s in t.segments)
    device_scratch = scratch1 - 2 * max_seg  # (0 on the CPU: one worker's decode scratch is all)
    decode_layers = sparse_layers
    if family.auto == "seq2seq":  # encoder layers run once per prompt, not per output token
        cfg = reader.config or {}
        n_enc = cfg.get("encoder_layers", cfg.get("num_layers"))
        if isinstance(n_enc, int):
            decode_layers = [l for l in sparse_layers if l >= n_enc] or sparse_layers
    dense = [e for e in reader.entries if e.role == "dense"]
    floating = ("BF16", "F16", "F32", "F64")
    from zipmoe.runtime.engine.staging import cuda_block_bytes

    sizes = [e.numel * itemsize if e.dtype in floating else e.nbytes for e in dense]
    # on CUDA each dense tensor as the caching allocator takes it (runtime.engine.loader)
    dense_bytes = sum(cuda_block_bytes(n) for n in sizes) if cuda else sum(sizes)
    dense_mm = sum(e.nbytes for e in dense if len(e.shape) == 2 and "embed" not in e.name and not e.name.endswith("shared.weight"))
    return ContainerLayout(
        path=str(reader.path), container_id=reader.container_id, file_size=reader.file_size,
        num_layers=int(meta_model.get("num_layers") or (max(sparse_layers) + 1)), num_experts=num_experts,
        top_k=top_k, sparse_layers=sparse_layers, dense_bytes=dense_bytes, dense_matmul_bytes=dense_mm,
        units=units, expert_full_bytes=sum(u[2] for u in units), expert_working=working, max_segment=max_seg,
        total_expert_full=sum(itemsize * t.numel for ts in experts.values() for t in ts),
        decode_layers=list(decode_layers), compute_itemsize=itemsize, dtype=dtype_name, chunks=chunks,
        device_scratch=device_scratch,
    )
