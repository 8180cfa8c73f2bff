"""The row batch (runtime/engine/rows.py): rows joining and leaving one static KV cache between
decode steps.

* Bit identity of a batched row: the same script of joins, leaves, growth and shifts run by a
  :class:`RowBatch` over zipmoe's model and by one over transformers' own model
  (``from_pretrained(..., experts_implementation="eager")``, the same rows prefilled by a
  :class:`DecodeLoop` over it) gives ``torch.equal`` logits at every step, and equal keys and
  values at the end. The reference is transformers computing the same rows over the same
  cache layout, not the row decoded alone.
* The layout is right: every row's logits are close to the same row decoded alone (a wrong
  mask, position or move gives errors far beyond the last bits that other shapes may move).
* The cache takes what the rows need: columns in chunks doubling up to the context, slots in
  powers of two.
"""

from __future__ import annotations

import pytest
import torch

from test_runtime_fixtures import container, reference

CONTEXT = 40
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 250, (n,), generator=g).tolist() for n in (5, 14, 3, 9)]


def _script(model, feed=None, chunk=8, graphs="off"):
    """Run the script on ``model``; returns (logits per step, tokens fed per row, the batch).

    ``feed``: the tokens to feed (per row, in order), from an earlier run; None: each row's argmax.
    Rows: 0 and 1 start (1 is longer than the cursor: everything moves right), 2 joins after 3
    steps, 0 leaves after 6 (2 moves down), 3 joins after 8, 1 leaves after 22; the columns grow
    from ``chunk`` and the cursor reaches the context, so every row moves left."""
    from zipmoe.runtime.engine import rows as mod
    from zipmoe.runtime.engine.loop import DecodeLoop

    old = mod.CHUNK
    mod.CHUNK = chunk
    try:
        loop = DecodeLoop(model, context=CONTEXT, graphs="off")
        batch = mod.RowBatch(model, context=CONTEXT, max_rows=4, graphs=graphs)
        prompts = _prompts()
        order, fed, last, out = [], {}, {}, []

        def join(r):
            lg = loop.prefill(torch.tensor([prompts[r]]))
            batch.add(loop.cache, len(prompts[r]), len(prompts[r]))
            order.append(r)
            fed[r] = []
            last[r] = int(lg[0].argmax())
            out.append({r: lg[0]})

        join(0)
        join(1)
        for step in range(30):
            if step == 3:
                join(2)
            for when, gone in ((6, 0), (22, 1)):
                if step == when:
                    batch.keep([i for i, r in enumerate(order) if r != gone])
                    order.remove(gone)
            if step == 8:
                join(3)
            toks = [feed[r][len(fed[r])] if feed else last[r] for r in order]
            logits = batch.step(toks)
            row = {}
            for i, r in enumerate(order):
                fed[r].append(toks[i])
                last[r] = int(logits[i].argmax())
                row[r] = logits[i]
            out.append(row)
        return out, fed, batch
    finally:
        mod.CHUNK = old


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "olmoe"])
def test_batched_rows_are_transformers_over_the_same_layout(tmp_path_factory, family):
    from zipmoe.runtime.engine.loader import load

    src, path = container(tmp_path_factory, family)
    model, _ = load(path, budget="64M", device="cpu", workers=1, threads=1)
    try:
        got, fed, batch = _script(model)
        want, _, ref_batch = _script(reference(src), feed=fed)
    finally:
        model.zipmoe.close()
    assert batch.capacity == ref_batch.capacity == (4, CONTEXT)
    assert batch.steps == 30
    for k, (a, b) in enumerate(zip(got, want)):
        assert a.keys() == b.keys()
        for r in a:
            assert torch.equal(a[r], b[r]), (family, k, r)
    n, c = batch.rows, batch.cursor
    for x, y in zip(batch.keys + batch.values, ref_batch.keys + ref_batch.values):
        assert torch.equal(x[:n, :, :c], y[:n, :, :c])


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("fraction", [1.0, 0.25], ids=["resident", "quarter"])
@pytest.mark.parametrize("family", ["qwen2_moe", "olmoe"])
def test_graphed_rows_on_cuda_are_transformers_over_the_same_layout(tmp_path_factory, family, fraction):
    """On CUDA the row batch replays one GraphedStep per row count (2 and 3 in the script, dropped
    and captured again each time the cache grows); every step's logits are ``torch.equal`` to
    transformers' own model (eager experts, no graphs) running the same script on CUDA. At a
    quarter of the experts the misses take the host path inside the graphed steps."""
    import zipmoe
    from zipmoe.runtime.engine.loader import requirements

    src, path = container(tmp_path_factory, family)
    req = requirements(path, workers=1, device="cuda")
    model, _ = zipmoe.load(path, budget=req["budget_for"](fraction), device="cuda", workers=1, warm=fraction == 1.0)
    try:
        got, fed, batch = _script(model, graphs="auto")
        assert batch._graphed, "no row count was served from graphs"
        assert model.zipmoe.counters.peak_held_bytes <= model.zipmoe.budget
    finally:
        model.zipmoe.close()
    want, _, ref_batch = _script(reference(src, "cuda"), feed=fed)
    assert ref_batch.capacity == batch.capacity
    for k, (a, b) in enumerate(zip(got, want)):
        assert a.keys() == b.keys()
        for r in a:
            assert torch.equal(a[r], b[r]), (family, fraction, k, r)


def test_each_row_computes_what_it_computes_alone(tmp_path_factory):
    """Joins, leaves, a move right, growth and a move left keep every row's logits within the
    last bits of the row decoded alone on the decode loop, token for token."""
    from zipmoe.runtime.engine.loader import load
    from zipmoe.runtime.engine.loop import DecodeLoop

    _, path = container(tmp_path_factory, "mixtral")
    model, _ = load(path, budget="64M", device="cpu", workers=1, threads=1)
    try:
        got, fed, batch = _script(model)
        assert batch.cursor < 14 + 30 and min(batch.starts) == 0  # it moved left at the limit
        prompts = _prompts()
        loop = DecodeLoop(model, context=CONTEXT, graphs="off")
        for r, toks in fed.items():
            alone = [loop.prefill(torch.tensor([prompts[r]]))[0]]
            for t in toks:
                alone.append(loop.step([t])[0])
            mine = [row[r] for row in got if r in row]
            assert len(mine) == len(alone)
            for k, (a, b) in enumerate(zip(mine, alone)):
                assert torch.allclose(a, b, atol=0.05, rtol=0.0), (r, k, (a - b).abs().max())
    finally:
        model.zipmoe.close()


class _Cache:
    """A batch-1 cache of ``n`` positions: what the decode loop hands the row batch."""

    def __init__(self, shapes, n, seed):
        g = torch.Generator().manual_seed(seed)

        class L:
            pass

        self.layers = []
        for heads, kd, vd in shapes:
            layer = L()
            layer.keys = torch.randn((1, heads, n, kd), generator=g).to(torch.bfloat16)
            layer.values = torch.randn((1, heads, n, vd), generator=g).to(torch.bfloat16)
            self.layers.append(layer)


def test_the_cache_grows_with_the_rows_and_moves_are_copies(tmp_path_factory):
    from zipmoe.runtime.engine.loader import load
    from zipmoe.runtime.engine.rows import CHUNK, RowBatch

    _, path = container(tmp_path_factory, "mixtral")
    model, _ = load(path, budget="64M", device="cpu", workers=1, threads=1)
    try:
        context = CHUNK * 4
        batch = RowBatch(model, context=context, max_rows=8, graphs="off")
        assert batch.capacity == (0, 0) and batch.kv_bytes == 0  # nothing until a row comes
        a = _Cache(batch.shapes, 10, 1)
        batch.add(a, 10, 10)
        assert batch.capacity == (1, CHUNK) and batch.lengths() == [10]
        b = _Cache(batch.shapes, CHUNK + 5, 2)  # longer than the cursor: row 0 moves right
        batch.add(b, CHUNK + 5, CHUNK + 5)
        assert batch.capacity == (2, 2 * CHUNK) and batch.lengths() == [10, CHUNK + 5]
        c = _Cache(batch.shapes, 4, 3)
        batch.add(c, 4, 4)
        assert batch.capacity == (4, 2 * CHUNK)
        per = sum(h * (kd + vd) for h, kd, vd in batch.shapes) * 2  # bf16 bytes per position and row
        assert batch.kv_bytes == 4 * 2 * CHUNK * per
        batch.keep([1, 2])  # row 0 leaves: b and c move down

        def held(j, src, n):
            lo = batch.cursor - n
            return all(torch.equal(k[j, :, lo:batch.cursor], s.keys[0]) and torch.equal(v[j, :, lo:batch.cursor], s.values[0])
                       for k, v, s in zip(batch.keys, batch.values, src.layers))

        assert batch.lengths() == [CHUNK + 5, 4] and held(0, b, CHUNK + 5) and held(1, c, 4)
        assert batch.mask[0].sum() == CHUNK + 5 and batch.mask[1].sum() == 4
        assert batch.pos[:2].tolist() == [CHUNK + 5, 4]
        with pytest.raises(Exception, match="does not fit"):
            batch.add(_Cache(batch.shapes, context, 4), context, context)
    finally:
        model.zipmoe.close()
