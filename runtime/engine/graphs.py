"""A decode step replayed from CUDA graphs, with logits ``torch.equal`` to the eager step.

The eager step is :func:`zipmoe.runtime.engine.step.forward`, the decode loop's one forward:
``[batch, 1]`` new ids at ``[batch, 1]`` position ids over a transformers ``StaticCache``, the
mask in its static ``[batch, context]`` form, ``logits_to_keep=1``. :class:`GraphedStep`
captures that very call (same function, same arguments) and replays it:

* piecewise: the forward is captured in pieces that break at every sparse block's experts call
  (the runtime's interceptor, ``Runtime.intercepted``, active only while capturing):
  embeddings, norms, attention with the static cache, the router and the shared expert replay
  from one graph per piece; the static cache's own device counter (``cumulative_length``)
  places the new key/values, so the same graphs serve every position;
* the sparse block at batch 1 is a graph too: the router's ``top_k`` ids are sorted on the
  device (ascending, the eager loop's order), the experts' slots are read from the
  device-side expert->slot map (:mod:`.slots`), their weights gathered into static buffers
  (``index_select``, an exact copy), and each expert computes with :mod:`.expert_math`, the
  functions the host path computes with. The host learns the routing with one small
  device->host copy per layer, issued before that graph: when every routed expert sits in a
  slot, the host goes on to the next piece while the GPU computes; otherwise the layer runs the
  host path (:func:`.experts_hook.experts_host_path`: the runtime fetches the misses) and its
  output replaces the graph's;
* at batch > 1 the number of tokens each expert gets depends on the routing, and so do the
  eager loop's ``F.linear`` shapes: one graph per (rank among the layer's hit experts, token
  count) is captured (:class:`_Grouped`), and the host, once it has the routing (the same
  small copy, waited for), writes the tokens, top-k positions and slots of every hit expert
  into one index buffer and replays the graphs of the layer's experts in ascending order:
  the eager loop's shapes and accumulation order, no per-op dispatch. A layer with a miss
  runs the host path. On unless ``EngineSettings.batched_sparse`` is False (then batch > 1
  sparse blocks run on the host path).

A layer served from graphs is accounted as if it ran on the host path: the same cache uses and
hit counts (``Runtime.layer_computed``).

The first call runs the eager step (warm-up); the second captures (and computes its step
while capturing: each piece is replayed as soon as it is captured); later calls replay.
Anything else falls back to the eager step (:func:`supported`): the CPU, a batch outside
:data:`BATCHES`, a model that is not a fused-family zipmoe model with device slots, or an
activation trace being recorded.
"""

from __future__ import annotations

import time

import torch

from zipmoe.runtime.engine.expert_math import accumulate, expert_output
from zipmoe.runtime.engine.experts_hook import experts_host_path, routed_indices
from zipmoe.runtime.engine.step import forward as step_forward, static_mask

__all__ = ["GraphedStep", "supported", "BATCHES", "why_not"]

BATCHES = (1, 2, 3, 4, 8, 16)


def _experts_modules(model) -> list:
    return [m for m in model.modules() if hasattr(m, "_zipmoe_layer") and hasattr(m, "gate_up_proj")]


def why_not(model, batch: int) -> str | None:
    """Why :class:`GraphedStep` cannot serve ``model`` at ``batch`` (None when it can)."""
    rt = getattr(model, "zipmoe", None)
    if rt is None:
        return "not a zipmoe model"
    if rt.device.type != "cuda" or not torch.cuda.is_available():
        return "CUDA graphs need a CUDA device"
    if rt.family.kind != "fused" or getattr(model.config, "is_encoder_decoder", False):
        return f"{rt.family.name} is not served through the fused experts hook"
    if rt.slots is None:
        return "the full pool has no device slots (budget leaves it empty)"
    if batch not in BATCHES:
        return f"batch {batch} is not one of {BATCHES}"
    if rt._trace is not None:
        return "an activation trace is being recorded"
    if not _experts_modules(model):
        return "no experts modules"
    return None


def supported(model, batch: int) -> bool:
    return why_not(model, batch) is None


class _Sparse:
    """One experts call of the captured forward: its static tensors and its graph (batch 1)."""

    __slots__ = ("module", "layer", "hidden", "ids", "weights", "out", "graph", "grouped")

    def __init__(self, module, hidden, ids, weights, out) -> None:
        self.module = module
        self.layer = module._zipmoe_layer
        self.hidden, self.ids, self.weights, self.out = hidden, ids, weights, out
        self.graph = None
        self.grouped = None


class _Grouped:
    """Batch > 1: one small graph per (rank ``j`` among the layer's hit experts, token count ``m``).

    Graph ``(j, m)`` computes the ``j``-th hit expert (ascending ids) over ``m`` tokens with the
    eager loop's ops: ``hidden[token_idx]``, ``F.linear`` with its [2I, H] weight (gathered from
    its slot into a static buffer), ``chunk``, ``act_fn(gate) * up``, ``F.linear`` with the
    [H, I] weight, times ``top_k_weights[token_idx, top_k_pos, None]``, ``index_add_`` into the
    output. The host, which learns the routing anyway, writes every hit expert's
    ``(top_k_pos, token_idx)`` (in ``torch.where``'s order, :func:`.experts_hook.routed_indices`)
    and its slots into one index buffer (one host->device copy), then replays the graphs of
    the layer's hit experts in ascending order: the same ``F.linear`` shapes, the same
    accumulation order as the eager loop. Shared by every layer whose tensors have the same
    shapes (the layer's hidden states and routing weights are copied into its static inputs).
    """

    def __init__(self, step, sp: _Sparse) -> None:
        slots = step.slots
        tokens = sp.hidden.shape[0]
        k = sp.ids.shape[1]
        self.b = tokens
        self.J = min(tokens * k, step.rt.num_experts)
        dev = sp.hidden.device
        self.hid = torch.empty_like(sp.hidden)
        self.wts = torch.empty_like(sp.weights)
        self.out = torch.empty_like(sp.hidden)
        width = 2 * tokens + 2
        self.idx = torch.zeros((self.J, width), dtype=torch.int64, device=dev)
        self.idx_host = torch.zeros((self.J, width), dtype=torch.int64, pin_memory=dev.type == "cuda")
        self.arenas = {u: slots.arena_of(sp.layer, u) for u in ("gate_up", "down")}
        self.w = {u: torch.empty((1, *a.shape), dtype=a.data.dtype, device=dev) for u, a in self.arenas.items()}
        self.act_fn = sp.module.act_fn
        # their own memory pool: these graphs are replayed in any order and once per layer, after
        # pieces captured later; in the pieces' pool their temporaries would alias the live
        # tensors of those pieces (measured on the H200: wrong logits from the capture step on)
        self.pool = torch.cuda.graph_pool_handle() if dev.type == "cuda" else None
        self.graphs: dict = {}
        for m in range(1, tokens + 1):  # warm-up (lazy library state), then capture
            self._body(0, m)
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()
        for j in range(self.J):
            for m in range(1, tokens + 1):
                self.graphs[(j, m)] = self._graph(self.pool, lambda j=j, m=m: self._body(j, m))

    @staticmethod
    def _graph(pool, fn):
        g = torch.cuda.CUDAGraph()
        g.capture_begin(pool=pool, capture_error_mode="thread_local")
        fn()
        g.capture_end()
        return g

    @staticmethod
    def key(sp: _Sparse, slots) -> tuple:
        return (tuple(sp.hidden.shape), sp.hidden.dtype, tuple(sp.weights.shape), sp.weights.dtype,
                slots.key_of[(sp.layer, "gate_up")], slots.key_of[(sp.layer, "down")], type(sp.module.act_fn))

    def _body(self, j: int, m: int) -> None:
        b = self.b
        row = self.idx[j]
        top_k_pos, token_idx = row[0:m], row[b:b + m]
        gate_up, down = self.w["gate_up"], self.w["down"]
        torch.index_select(self.arenas["gate_up"].data, 0, row[2 * b:2 * b + 1], out=gate_up)
        torch.index_select(self.arenas["down"].data, 0, row[2 * b + 1:2 * b + 2], out=down)
        h = expert_output(self.hid, token_idx, top_k_pos, gate_up[0], down[0], self.act_fn, self.wts)
        accumulate(self.out, token_idx, h)

    def run(self, sp: _Sparse, experts: list, index, sizes: list, slots) -> None:
        """Write the layer's routing into the index buffer and replay its hit experts' graphs."""
        b = self.b
        host = self.idx_host.numpy()
        pos = index[0].numpy()
        tok = index[1].numpy()
        r = slots.row[sp.layer]
        gu, dn = slots.host["gate_up"][r], slots.host["down"][r]
        off = 0
        for j, (e, m) in enumerate(zip(experts, sizes)):
            host[j, 0:m] = pos[off:off + m]
            host[j, b:b + m] = tok[off:off + m]
            host[j, 2 * b] = gu[e]
            host[j, 2 * b + 1] = dn[e]
            off += m
        self.idx.copy_(self.idx_host, non_blocking=True)
        self.hid.copy_(sp.hidden)
        self.wts.copy_(sp.weights)
        self.out.zero_()
        for j, m in enumerate(sizes):
            self.graphs[(j, m)].replay()
        sp.out.copy_(self.out)


class GraphedStep:
    """``step(input_ids [batch, 1], position_ids [batch, 1], attention_mask) -> [batch, vocab]``
    logits from CUDA graphs, ``torch.equal`` to :func:`zipmoe.runtime.engine.step.forward`.

    ``attention_mask``: None (no padding) or the ``[batch, seen]`` mask of every position so far,
    the new one included (made ``[batch, context]`` by :func:`~zipmoe.runtime.engine.step.static_mask`),
    or already ``[batch, context]``. ``cache``: the transformers StaticCache the prefill filled
    (the graphs hold its tensors). ``graph_sparse=False`` runs every sparse block on the host
    path (for comparisons); ``batched_sparse`` graphs the sparse blocks at batch > 1
    (:class:`_Grouped`; None: the runtime's ``EngineSettings.batched_sparse``). ``attention``:
    the attention kernels the eager step and the capture run with (engine/step.py; None: the
    runtime's ``EngineSettings.attention``).
    """

    def __init__(self, model, cache, batch: int, graph_sparse: bool = True, batched_sparse: bool | None = None,
                 attention: str | None = None) -> None:
        reason = why_not(model, batch)
        if reason is not None:
            raise ValueError(f"GraphedStep cannot serve this model: {reason}")
        self.model = model
        self.cache = cache
        self.batch = int(batch)
        self.rt = model.zipmoe
        self.slots = self.rt.slots
        if batched_sparse is None:
            batched_sparse = self.rt.settings.batched_sparse
        self.attention = self.rt.settings.attention if attention is None else attention
        self.graph_sparse = graph_sparse and self.batch == 1
        self.graph_grouped = graph_sparse and self.batch > 1 and bool(batched_sparse)
        self._grouped: dict = {}
        self.modules = _experts_modules(model)
        self.calls = 0
        self.pieces: list = []
        self.sparse: list[_Sparse] = []
        self.stream = torch.cuda.Stream(device=self.rt.device)
        self.pool = None
        self.s_ids = self.s_pos = self.s_mask = self.s_logits = None
        self.ctx = max(int(layer.max_cache_len) for layer in cache.layers)  # the cache's length (a sliding layer holds less)
        # batch 1's sparse graphs: static weight buffers shared by every layer of one kind
        self._w: dict = {}
        self._ids_host = None
        self._event = torch.cuda.Event()
        self.stats = {"graphed_layers": 0, "host_layers": 0}

    # ------------------------------------------------------------------ public
    def __call__(self, input_ids, position_ids, attention_mask=None):
        if input_ids.shape != (self.batch, 1):
            raise ValueError(f"GraphedStep takes input ids of shape [{self.batch}, 1], got {list(input_ids.shape)}")
        pos = position_ids.reshape(self.batch, 1)
        if attention_mask is None or attention_mask.shape[-1] != self.ctx:
            attention_mask = static_mask(attention_mask, pos, self.ctx)
        with torch.no_grad():
            self.calls += 1
            if self.calls == 1:  # warm-up: the eager step, on the capture stream
                self.stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(self.stream):
                    logits = self._forward(input_ids, pos, attention_mask)
                torch.cuda.current_stream().wait_stream(self.stream)
                return logits
            if not self.pieces:
                return self._capture(input_ids, pos, attention_mask)
            self.s_ids.copy_(input_ids)
            self.s_pos.copy_(pos)
            self.s_mask.copy_(attention_mask)
            for piece, sp in zip(self.pieces, self.sparse):
                piece.replay()
                self._sparse_step(sp)
            self.pieces[-1].replay()
            return self.s_logits.clone()

    def _forward(self, ids, pos, mask):
        """The eager step: the decode loop's own forward."""
        return step_forward(self.model, self.cache, ids, pos, mask, attention=self.attention)

    # ------------------------------------------------------------------ capture
    def _capture(self, input_ids, pos, mask):
        self.s_ids = input_ids.clone()
        self.s_pos = pos.clone()
        self.s_mask = mask.clone()
        self.pool = torch.cuda.graph_pool_handle()
        torch.cuda.synchronize()
        self.stream.wait_stream(torch.cuda.current_stream())
        with self.rt.intercepted(self._break), torch.cuda.stream(self.stream):
            self._cur = self._begin()
            self.s_logits = self._forward(self.s_ids, self.s_pos, self.s_mask)
            self._end_piece()
        torch.cuda.current_stream().wait_stream(self.stream)
        torch.cuda.synchronize()
        return self.s_logits.clone()

    def _begin(self):
        g = torch.cuda.CUDAGraph()
        g.capture_begin(pool=self.pool, capture_error_mode="thread_local")
        return g

    def _end_piece(self):
        g = self._cur
        g.capture_end()
        self.pieces.append(g)
        g.replay()  # the piece's real work: its outputs feed what comes next

    def _break(self, module, hidden, ids, weights):
        """The experts call during capture: end this piece, set up the sparse block, start the next."""
        self._end_piece()
        sp = _Sparse(module, hidden, ids, weights, torch.zeros_like(hidden))
        slotted = all(a.slots > 0 for a in self.slots.arenas.values())  # else a gather could point nowhere
        if self.graph_sparse and slotted:
            g = torch.cuda.CUDAGraph()
            g.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            self._sparse_graph_body(sp)
            g.capture_end()
            sp.graph = g
        elif self.graph_grouped and slotted:
            key = _Grouped.key(sp, self.slots)
            if key not in self._grouped:
                self._grouped[key] = _Grouped(self, sp)
            sp.grouped = self._grouped[key]
        self.sparse.append(sp)
        self._sparse_step(sp)
        self._cur = self._begin()
        return sp.out

    def _buffers(self, layer, k: int):
        bufs = []
        for unit in self.slots.units:
            arena = self.slots.arena_of(layer, unit)
            key = (unit, arena.shape)
            if key not in self._w:
                self._w[key] = torch.empty((k, *arena.shape), dtype=arena.data.dtype, device=arena.data.device)
            bufs.append((unit, arena, self._w[key]))
        return bufs

    def _sparse_graph_body(self, sp: _Sparse) -> None:
        """Batch 1, every routed expert in a slot: :mod:`.expert_math` on gathered weights."""
        mod = sp.module
        slots = self.slots
        row = slots.row[sp.layer]
        sorted_ids, perm = torch.sort(sp.ids[0])  # ascending expert ids, their top-k positions
        w = {}
        for unit, arena, buf in self._buffers(sp.layer, sp.ids.shape[1]):
            idx = slots.maps[unit][row].index_select(0, sorted_ids).clamp_(min=0)  # -1 (a miss): any slot; the host redoes it
            torch.index_select(arena.data, 0, idx, out=buf)
            w[unit] = buf
        gate_up, down = w["gate_up"], w["down"]
        out = sp.out
        out.zero_()
        token_idx = torch.zeros(1, dtype=torch.int64, device=out.device)
        for j in range(gate_up.shape[0]):
            h = expert_output(sp.hidden, token_idx, perm[j:j + 1], gate_up[j], down[j], mod.act_fn, sp.weights)
            accumulate(out, token_idx, h)

    # ------------------------------------------------------------------ one sparse block
    def _routing_to_host(self, sp: _Sparse) -> None:
        """Start the small device->host copy of the layer's routing (into a pinned buffer)."""
        if self._ids_host is None or self._ids_host.shape != sp.ids.shape:
            self._ids_host = torch.empty(sp.ids.shape, dtype=sp.ids.dtype, pin_memory=True)
        self._ids_host.copy_(sp.ids, non_blocking=True)
        self._event.record()

    def _graphed(self, sp: _Sparse, experts, t0: float) -> None:
        """Account a sparse block served from graphs: every routed expert a full-pool hit."""
        self.rt.layer_computed(sp.layer, experts, time.perf_counter() - t0)
        self.stats["graphed_layers"] += 1

    def _sparse_step(self, sp: _Sparse) -> None:
        rt = self.rt
        if sp.graph is not None:
            t0 = time.perf_counter()
            self._routing_to_host(sp)
            sp.graph.replay()  # speculative: every routed expert resident
            self._event.synchronize()
            experts = sorted(set(self._ids_host[0].tolist()))
            if rt.sparse_graphs and all(0 <= e < rt.num_experts for e in experts) and self.slots.all_slotted(sp.layer, experts):
                return self._graphed(sp, experts, t0)
        elif sp.grouped is not None:
            t0 = time.perf_counter()
            self._routing_to_host(sp)
            self._event.synchronize()
            experts, index, sizes = routed_indices(self._ids_host, rt.num_experts)
            if rt.sparse_graphs and len(experts) <= sp.grouped.J and self.slots.all_slotted(sp.layer, experts):
                sp.grouped.run(sp, experts, index, sizes, self.slots)
                return self._graphed(sp, experts, t0)
        # the host path: the runtime's experts computation (fetches misses), its output replaces the graph's
        sp.out.copy_(experts_host_path(sp.module, sp.hidden, sp.ids, sp.weights))
        self.stats["host_layers"] += 1
