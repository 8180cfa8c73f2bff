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
  into one index buffer and replays the graphs of the layer's experts in ascending order
  (runs of single-token experts from one graph each): the eager loop's shapes and
  accumulation order, no per-op dispatch. A layer with a miss
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

import math
import time

import numpy as np
import torch

from zipmoe.runtime.engine.expert_math import accumulate, expert_output, expert_rows
from zipmoe.runtime.engine.experts_hook import experts_host_path, routed_indices
from zipmoe.runtime.engine.step import forward as step_forward, static_mask

__all__ = ["GraphedStep", "supported", "BATCHES", "why_not", "replay_plan"]

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

    __slots__ = ("module", "layer", "hidden", "ids", "weights", "out", "graph", "grouped", "prologue")

    def __init__(self, module, hidden, ids, weights, out) -> None:
        self.module = module
        self.layer = module._zipmoe_layer
        self.hidden, self.ids, self.weights, self.out = hidden, ids, weights, out
        self.graph = None
        self.grouped = None
        self.prologue = None  # batch > 1: this layer's gathers of hidden rows and routing weights (one graph)


def _aligned_rows(rows: int, row_bytes: int, align: int = 256) -> int:
    """``rows`` rounded up so that ``rows * row_bytes`` is a multiple of ``align`` bytes."""
    q = align // math.gcd(align, row_bytes)
    return -(-rows // q) * q


def replay_plan(sizes: list, group: int) -> list:
    """The graphs :meth:`_Grouped.run` replays for hit experts of token counts ``sizes``
    (ascending expert order), weight groups of ``group`` ranks: per group, ``("gather", g, c)``
    (its ``c`` experts' weights), then its ranks in order: ``("run", j, r)`` for ``r >= 2``
    consecutive ranks of one token each, ``("one", j, m)`` for a lone rank of ``m`` tokens.
    The same kernels in the same order as one graph per rank, in fewer replays (each replay
    costs the host a launch: at batch 4 most hit experts get one token)."""
    plan = []
    for lo in range(0, len(sizes), group):
        hi = min(lo + group, len(sizes))
        plan.append(("gather", lo // group, hi - lo))
        j = lo
        while j < hi:
            r = 0
            while j + r < hi and sizes[j + r] == 1:
                r += 1
            if r >= 2:
                plan.append(("run", j, r))
                j += r
            else:
                plan.append(("one", j, sizes[j]))
                j += 1
    return plan


class _Grouped:
    """Batch > 1: one small graph per (rank ``j`` among the layer's hit experts, token count ``m``).

    Graph ``(j, m)`` computes the ``j``-th hit expert (ascending ids) over its ``m`` tokens with
    the eager loop's ops (:func:`.expert_math.expert_rows`: ``F.linear`` with its [2I, H]
    weight, ``chunk``, ``act_fn(gate) * up``, ``F.linear`` with the [H, I] weight, times the
    routing weights) and ``index_add_`` into the output (:func:`.expert_math.accumulate`).
    What the eager loop gathers per expert is gathered once per layer, as exact copies: the
    expert's rows of the hidden states (``hidden[token_idx]``) into rank ``j``'s block of one
    static buffer (256-byte aligned, contiguous ``[m, H]``: the shape and layout cuBLAS sees in
    the eager loop), its routing weights (``top_k_weights[token_idx, top_k_pos]``) likewise;
    the weights of :attr:`G` experts at a time from their slots into static buffers by one
    gather graph ``(group, count)``. The host, which learns the routing anyway, writes every hit
    expert's tokens, routing-weight positions and slots into one index buffer (vectorised numpy,
    one host->device copy), then replays the gathers and the experts' graphs in ascending expert
    order: the same ``F.linear`` shapes, the same accumulation order as the eager loop, six
    kernels per expert. Consecutive ranks of one token each within a weight group replay from
    one graph ``run (j, r)`` (:func:`replay_plan`): the same kernels, fewer host launches.
    Shared by every layer whose tensors have the same shapes.
    """

    GROUP = 4  # experts whose weights one gather copies (the static weight buffers hold this many)

    def __init__(self, step, sp: _Sparse) -> None:
        slots = step.slots
        tokens, hidden_size = sp.hidden.shape
        k = sp.ids.shape[1]
        self.b, self.k = tokens, k
        self.J = J = min(tokens * k, step.rt.num_experts)
        dev = sp.hidden.device
        self.arenas = {u: slots.arena_of(sp.layer, u) for u in ("gate_up", "down")}
        # one gather for several experts needs every weight buffer 256-byte aligned in it
        aligned = all(math.prod(a.shape) * a.data.element_size() % 256 == 0 for a in self.arenas.values())
        self.G = min(self.GROUP, J) if aligned else 1
        self.w = {u: torch.empty((self.G, *a.shape), dtype=a.data.dtype, device=dev) for u, a in self.arenas.items()}
        self.rows = _aligned_rows(tokens, hidden_size * sp.hidden.element_size())  # rows per rank's block
        n = J * self.rows
        # the index buffer: gate_up slots [J], down slots [J], tokens [J * rows], flat routing-weight positions
        self.idx = torch.zeros(2 * J + 2 * n, dtype=torch.int64, device=dev)
        self.idx_host = torch.zeros(2 * J + 2 * n, dtype=torch.int64, pin_memory=dev.type == "cuda")
        self.slot = {"gate_up": self.idx[0:J], "down": self.idx[J:2 * J]}
        self.tok, self.lin = self.idx[2 * J:2 * J + n], self.idx[2 * J + n:]
        self.cs = torch.empty((n, hidden_size), dtype=sp.hidden.dtype, device=dev)
        self.cw = torch.empty((n,), dtype=sp.weights.dtype, device=dev)
        self.out = torch.empty_like(sp.hidden)
        self.act_fn = sp.module.act_fn
        # their own memory pool: these graphs are replayed in any order and once per layer, after
        # pieces captured later; in the pieces' pool their temporaries would alias the live
        # tensors of those pieces (measured on the H200: wrong logits from the capture step on)
        self.pool = torch.cuda.graph_pool_handle() if dev.type == "cuda" else None
        self.groups = [(g, min(self.G, J - g * self.G)) for g in range(-(-J // self.G))]
        self.gathers: dict = {}
        self.graphs: dict = {}
        self._gather(0, 1)  # warm-up (lazy library state), then capture
        for m in range(1, tokens + 1):
            self._body(0, m)
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()
        for g, most in self.groups:
            for c in range(1, most + 1):
                self.gathers[(g, c)] = self._graph(self.pool, lambda g=g, c=c: self._gather(g, c))
        for j in range(J):
            for m in range(1, tokens + 1):
                self.graphs[(j, m)] = self._graph(self.pool, lambda j=j, m=m: self._body(j, m))
        # runs of single-token experts inside one weight group, one graph each (fewer replays)
        self.runs: dict = {}
        for g, most in self.groups:
            lo = g * self.G
            for j in range(lo, lo + most - 1):
                for r in range(2, lo + most - j + 1):
                    self.runs[(j, r)] = self._graph(self.pool, lambda j=j, r=r: self._run_body(j, r))

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

    def _gather(self, g: int, c: int) -> None:
        """The weights of ranks ``g * G`` .. ``g * G + c - 1`` from their slots (exact copies)."""
        lo = g * self.G
        for u, arena in self.arenas.items():
            torch.index_select(arena.data, 0, self.slot[u][lo:lo + c], out=self.w[u][:c])

    def _body(self, j: int, m: int) -> None:
        s = j * self.rows
        i = j % self.G
        h = expert_rows(self.cs[s:s + m], self.w["gate_up"][i], self.w["down"][i], self.act_fn, self.cw[s:s + m, None])
        accumulate(self.out, self.tok[s:s + m], h)

    def _run_body(self, j: int, r: int) -> None:
        """Ranks ``j`` .. ``j + r - 1``, one token each: their bodies one after the other."""
        for i in range(j, j + r):
            self._body(i, 1)

    def fill(self, experts: list, index, sizes: list, slots, layer: int) -> None:
        """The layer's routing into the pinned index buffer (host side; :meth:`run` copies it over)."""
        J, n = self.J, self.J * self.rows
        host = self.idx_host.numpy()
        host[:] = 0  # padding: slot 0, token 0 (computed into no output)
        cols = index.shape[1]
        counts = np.asarray(sizes, dtype=np.int64)
        starts = np.cumsum(counts) - counts
        dest = np.repeat(np.arange(len(sizes), dtype=np.int64) * self.rows - starts, counts) + np.arange(cols)
        pos, tok = index[0].numpy(), index[1].numpy()
        host[2 * J + dest] = tok
        host[2 * J + n + dest] = tok * self.k + pos
        r = slots.row[layer]
        host[0:len(experts)] = slots.host["gate_up"][r][experts]
        host[J:J + len(experts)] = slots.host["down"][r][experts]

    def prologue(self, sp: _Sparse) -> None:
        """Layer ``sp``'s rows of the hidden states and routing weights into the rank blocks (exact
        copies, by the index buffer), and the output zeroed."""
        torch.index_select(sp.hidden, 0, self.tok, out=self.cs)
        torch.index_select(sp.weights.reshape(-1), 0, self.lin, out=self.cw)
        self.out.zero_()

    def prologue_graph(self, sp: _Sparse):
        """:meth:`prologue` of one layer as a graph (its tensors are that layer's); run once first
        (lazy library state), as the other graphs are."""
        self.prologue(sp)
        return self._graph(self.pool, lambda: self.prologue(sp))

    def run(self, sp: _Sparse, experts: list, index, sizes: list, slots) -> None:
        """Write the layer's routing into the index buffer and replay its hit experts' graphs."""
        self.fill(experts, index, sizes, slots, sp.layer)
        self.idx.copy_(self.idx_host, non_blocking=True)
        if sp.prologue is not None:
            sp.prologue.replay()
        else:
            self.prologue(sp)
        for op, a, b in replay_plan(sizes, self.G):
            (self.gathers if op == "gather" else self.runs if op == "run" else self.graphs)[(a, b)].replay()
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
        self._pending = None  # a graphed layer's accounting, done while the GPU computes the next piece
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
            self._account()
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
        self._account()
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
            sp.prologue = sp.grouped.prologue_graph(sp)
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
        self._account()  # the previous layer's, while the GPU computes this piece

    def _graphed(self, sp: _Sparse, experts, t0: float) -> None:
        """A sparse block served from graphs: accounted (every routed expert a full-pool hit) by
        :meth:`_account` once the next piece is launched, off the path the GPU waits on."""
        self._pending = (sp.layer, experts, time.perf_counter() - t0)
        self.stats["graphed_layers"] += 1

    def _account(self) -> None:
        """The pending graphed layer's cache uses and counters (before any later layer's lookups:
        the same order of uses as accounting it at once)."""
        if self._pending is not None:
            layer, experts, seconds = self._pending
            self._pending = None
            self.rt.layer_computed(layer, experts, seconds)

    def _sparse_step(self, sp: _Sparse) -> None:
        rt = self.rt
        if sp.graph is not None:
            t0 = time.perf_counter()
            self._routing_to_host(sp)
            self.slots.flush()  # the device maps the graph gathers by (admissions change the host's)
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
        self._account()
        sp.out.copy_(experts_host_path(sp.module, sp.hidden, sp.ids, sp.weights))
        self.stats["host_layers"] += 1
