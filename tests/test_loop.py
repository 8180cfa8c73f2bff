"""zipmoe's decode loop (runtime/engine/loop.py): logits ``torch.equal`` to transformers.

The reference is the source checkpoint in transformers with eager experts, generating with a
``StaticCache`` of the same length (the same cache implementation: a dynamic cache, or a static
one of another length, changes the attention's bits; a cache that grows is compared with
transformers generating over a ``StaticCache`` of the loop's columns, copied into a larger one
where the loop grew). Every decoder-only family, batch 1 and
4 (left padding), at budgets from every expert resident to the smallest, several decode
steps; multi-turn reuse of the cache against transformers carrying its own cache over the same
way (crop to the common prefix, feed the rest). The same tests run on CUDA with ``-m gpu``.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import zipmoe
from zipmoe.errors import UsageError
from zipmoe.runtime.engine.hf_compat import NO_AUTO_COMPILE, cache_kw, crop
from zipmoe.runtime.engine.loader import requirements
from zipmoe.runtime.engine.kvsize import static_cache_bytes
from zipmoe.runtime.engine.loop import ContextFull, DecodeLoop
from zipmoe.runtime.engine.step import attention_kernels

from test_runtime_fixtures import FAMILIES, container, inputs, reference

DECODERS = [f for f in FAMILIES if f != "switch_transformers"]
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]
CONTEXT = 48
STEPS = 5


def _vocab(src) -> int:
    return json.loads((src / "config.json").read_text())["vocab_size"]


def _ref_generate(ref, batch: dict, steps: int, context: int = CONTEXT, cache=None, **kw):
    from transformers import StaticCache

    cache = cache if cache is not None else StaticCache(config=ref.config, max_cache_len=context)
    args = dict(max_new_tokens=steps, do_sample=False, output_logits=True, return_dict_in_generate=True,
                pad_token_id=0, **NO_AUTO_COMPILE)  # eager transformers: generate would compile on CUDA
    args.update(kw)
    # the same attention kernels as the loop's (EngineSettings.attention, its default): on CUDA
    # PyTorch's own choice may be cuDNN's, which the loop leaves out (its bits change run to run)
    device = batch["input_ids"].device
    with torch.no_grad(), warnings.catch_warnings(), attention_kernels("reproducible", device):
        warnings.simplefilter("ignore")
        return ref.generate(**batch, **{cache_kw(ref): cache}, **args)


def _check(loop_res, ref_out, prompt_len: int, what: str) -> None:
    assert len(loop_res.logits) == len(ref_out.logits), what
    for step, (a, b) in enumerate(zip(ref_out.logits, loop_res.logits)):
        assert torch.equal(a, b), f"{what}: logits differ at step {step}"
    want = ref_out.sequences[:, prompt_len:].tolist()
    assert [row[: len(w)] for row, w in zip(loop_res.tokens, want)] == [w[: len(r)] for r, w in zip(loop_res.tokens, want)]


@pytest.fixture(scope="module")
def refs():
    return {}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", DECODERS)
def test_loop_logits_equal_transformers_static_cache(tmp_path_factory, refs, family, device):
    src, path = container(tmp_path_factory, family)
    if (family, device) not in refs:
        refs[(family, device)] = reference(src, device)
    ref = refs[(family, device)]
    vocab = _vocab(src)
    batches = {1: inputs(vocab, False, device, batch=1, seed=1), 4: inputs(vocab, False, device, batch=4)}
    want = {b: _ref_generate(ref, batch, STEPS) for b, batch in batches.items()}
    req = requirements(path, workers=1, device=device)
    for which, budget in (("resident", req["budget_for"](1.0)), ("half", req["budget_for"](0.5)),
                          ("min", req["min_budget"])):
        model, _ = zipmoe.load(path, budget=budget, device=device, workers=1)
        try:
            for b, batch in batches.items():
                loop = DecodeLoop(model, context=CONTEXT, batch=b)
                assert loop.kv_bytes == static_cache_bytes(model.config, batch=b, context=CONTEXT,
                                                           itemsize=model.dtype.itemsize) > 0
                for attempt in range(2):  # the cache is reused: a second request gives the same bits
                    res = loop.generate(batch["input_ids"], batch["attention_mask"], max_new_tokens=STEPS,
                                        do_sample=False, keep_logits=True, generation_kwargs={"pad_token_id": 0})
                    _check(res, want[b], batch["input_ids"].shape[1], f"{family} batch {b} budget {which} #{attempt}")
                    assert res.stats["prefill_tokens"] == batch["input_ids"].shape[1]
                    assert res.stats["steps"] == STEPS - 1
            assert model.zipmoe.counters.peak_held_bytes <= budget
            if which == "min":
                assert model.zipmoe.counters.hits["none"] > 0
        finally:
            model.zipmoe.close()


def _lcp(a, b) -> int:
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    return i


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v2"])
def test_turns_reuse_the_common_prefix(tmp_path_factory, family):
    """Three turns on one cache: each prefills only the part after the common prefix, and its
    logits equal transformers carrying its own static cache over the same way."""
    from transformers import StaticCache

    src, path = container(tmp_path_factory, family)
    ref = reference(src)
    vocab = _vocab(src)
    req = requirements(path, workers=1)
    model, _ = zipmoe.load(path, budget=req["budget_for"](0.5), workers=1)
    loop = DecodeLoop(model, context=CONTEXT, batch=1)
    ref_cache = StaticCache(config=ref.config, max_cache_len=CONTEXT)
    g = torch.Generator().manual_seed(7)
    conv: list[int] = torch.randint(3, vocab, (8,), generator=g).tolist()
    ref_held: list[int] = []
    try:
        for turn in range(3):
            ids = torch.tensor([conv])
            res = loop.generate(ids, max_new_tokens=4, do_sample=False, keep_logits=True, reuse=True,
                                generation_kwargs={"pad_token_id": 0})
            keep = min(_lcp(ref_held, conv), len(conv) - 1)
            length = int(ref_cache.get_seq_length())
            if length > keep:
                crop(ref_cache, length - keep)
            want = _ref_generate(ref, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, 4, cache=ref_cache)
            _check(res, want, len(conv), f"{family} turn {turn + 1}")
            assert res.stats["prefill_tokens"] == len(conv) - keep
            if turn:
                assert res.stats["prefill_tokens"] < len(conv)
            new = want.sequences[0, len(conv):].tolist()
            ref_held = (conv + new)[: int(ref_cache.get_seq_length())]
            assert loop.tokens[0] == (conv + new)[: loop.length]
            # the next turn: this answer less its last token (as a re-rendered template might) and new user ids
            conv = conv + new[:-1] + torch.randint(3, vocab, (5,), generator=g).tolist()
        # a prompt the cache holds entirely recomputes its last token only
        held = loop.tokens[0][:]
        res = loop.generate(torch.tensor([held]), max_new_tokens=1, do_sample=False, reuse=True)
        assert res.stats["prefill_tokens"] == 1
        loop.reset()
        assert loop.length == 0
        res = loop.generate(torch.tensor([held[:6]]), max_new_tokens=1, reuse=True, do_sample=False)
        assert res.stats["prefill_tokens"] == 6
    finally:
        model.zipmoe.close()


def test_context_limits_and_options(tmp_path_factory):
    src, path = container(tmp_path_factory, "mixtral")
    req = requirements(path, workers=1)
    model, _ = zipmoe.load(path, budget=req["budget_for"](1.0), workers=1)
    try:
        big = DecodeLoop(model, context=10**6)
        limit = model.config.max_position_embeddings
        assert big.clamped and big.context == limit and big.requested_context == 10**6
        loop = DecodeLoop(model, context=12)
        with pytest.raises(ContextFull, match="KV cache holds 12"):
            loop.prefill(torch.arange(3, 16)[None])
        res = loop.generate(torch.arange(3, 11)[None], max_new_tokens=20, do_sample=False,
                            generation_kwargs={"pad_token_id": 0})
        assert res.stop == "context" and loop.length == 12 and len(res.tokens[0]) == 5
        with pytest.raises(ContextFull):
            loop.step([5])
        with pytest.raises(UsageError):
            DecodeLoop(model, context=1)
        with pytest.raises(UsageError, match="rows"):
            loop.prefill(torch.ones((2, 3), dtype=torch.long))
        with pytest.raises(UsageError, match="CUDA graphs"):
            DecodeLoop(model, context=12, graphs=True)
        assert DecodeLoop(model, context=12, graphs="auto").graphed is None

        class Counting(DecodeLoop):
            calls = 0

            def forward(self, input_ids, position_ids, attention_mask=None):
                Counting.calls += 1
                return super().forward(input_ids, position_ids, attention_mask)

        c = Counting(model, context=16)
        c.generate(torch.arange(3, 8)[None], max_new_tokens=4, do_sample=False, generation_kwargs={"pad_token_id": 0})
        assert Counting.calls == 4  # the prefill and three steps, every one through forward()
    finally:
        model.zipmoe.close()


def _grow(cache, columns: int, config):
    """``cache`` copied into a ``StaticCache`` of ``columns`` positions (what the loop does when
    it grows): the same keys and values at the same positions."""
    from transformers import StaticCache

    held = int(cache.get_seq_length())
    big = StaticCache(config=config, max_cache_len=columns)
    for new, old in zip(big.layers, cache.layers):
        new.lazy_initialization(old.keys[:, :, :0], old.values[:, :, :0])
        new.keys[:, :, :held] = old.keys[:, :, :held]
        new.values[:, :, :held] = old.values[:, :, :held]
        new.cumulative_length.fill_(held)
    return big


def _ref_growing(ref, batch: dict, steps: int, chunk: int, context: int):
    """transformers' generate over a ``StaticCache`` of the loop's columns at every step: from
    the smallest doubling of ``chunk`` that holds the prompt, generating until the next token
    would need a column past it, then the cache copied into one twice the size and generate
    called again with the sequence so far (it feeds the positions the cache does not hold)."""
    from types import SimpleNamespace

    from transformers import StaticCache

    from zipmoe.runtime.engine.kvsize import chunked

    ids, mask = batch["input_ids"], batch["attention_mask"]
    cols = chunked(ids.shape[1], chunk, context)
    cache = StaticCache(config=ref.config, max_cache_len=cols)
    logits, seq = [], ids
    while len(logits) < steps:
        k = min(cols - seq.shape[1] + 1, steps - len(logits))  # until the cache holds cols positions
        m = torch.cat([mask, mask.new_ones((mask.shape[0], seq.shape[1] - mask.shape[1]))], dim=-1)
        out = _ref_generate(ref, {"input_ids": seq, "attention_mask": m}, k, cache=cache, min_new_tokens=k)
        logits += list(out.logits)
        seq = out.sequences
        if len(logits) < steps:
            cols = chunked(cols + 1, chunk, context)
            cache = _grow(cache, cols, ref.config)
    return SimpleNamespace(logits=logits, sequences=seq)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v2"])
def test_a_growing_cache_equals_transformers_over_the_same_columns(tmp_path_factory, family, device):
    """``kv="grow"`` (the default): the cache starts at the smallest doubling of ``chunk`` that
    holds the prompt and doubles when a step needs room. Every step's logits are ``torch.equal``
    to transformers' generate over a ``StaticCache`` of the loop's columns at that step (grown by
    the same copy), batch 1 and 4 (left padding); a fresh prefill sizes the cache to its prompt
    again; what it holds is what a StaticCache of its columns allocates. ``kv="fixed"`` beside it
    equals plain generate over a StaticCache of the whole context. On CUDA with the graphs off (a
    graphed loop keeps the whole context)."""
    src, path = container(tmp_path_factory, family)
    ref = reference(src, device)
    vocab = _vocab(src)
    req = requirements(path, workers=1, device=device)
    model, _ = zipmoe.load(path, budget=req["budget_for"](0.5), device=device, workers=1)
    chunk, context, steps = 8, 64, 40  # a 10-token prompt: 16 columns, then 32, then 64
    try:
        for b, batch in {1: inputs(vocab, False, device, batch=1, seed=1), 4: inputs(vocab, False, device, batch=4)}.items():
            loop = DecodeLoop(model, context=context, batch=b, chunk=chunk, graphs="off")
            assert loop.growing and loop.columns == chunk
            columns = []
            res = loop.generate(batch["input_ids"], batch["attention_mask"], max_new_tokens=steps, min_new_tokens=steps,
                                do_sample=False, keep_logits=True, generation_kwargs={"pad_token_id": 0},
                                on_token=lambda _ids: columns.append(loop.columns))
            want = _ref_growing(ref, batch, steps, chunk, context)
            _check(res, want, batch["input_ids"].shape[1], f"{family} batch {b}")
            assert sorted(set(columns)) == [16, 32, 64] and loop.growths == 3 and res.stats["kv_columns"] == 64
            assert loop.kv_bytes == static_cache_bytes(model.config, batch=b, context=64, itemsize=model.dtype.itemsize)
            assert loop.kv_bytes_limit == loop.kv_bytes  # grown to the whole context
            loop.prefill(batch["input_ids"], batch["attention_mask"])
            assert loop.columns == 16 and loop.kv_bytes * 4 == loop.kv_bytes_limit
            # kv="fixed": the whole context from the start, plain generate over a StaticCache of it
            fixed = DecodeLoop(model, context=context, batch=b, kv="fixed", graphs="off")
            res = fixed.generate(batch["input_ids"], batch["attention_mask"], max_new_tokens=steps, min_new_tokens=steps,
                                 do_sample=False, keep_logits=True, generation_kwargs={"pad_token_id": 0})
            _check(res, _ref_generate(ref, batch, steps, context=context, min_new_tokens=steps),
                   batch["input_ids"].shape[1], f"{family} batch {b} fixed")
            assert fixed.columns == context and fixed.growths == 0
    finally:
        model.zipmoe.close()


def test_a_growths_peak_counts_both_caches():
    from zipmoe.runtime.engine.kvsize import chunked, growth_peak

    assert [chunked(n, 256, 4096) for n in (1, 256, 257, 3000, 9000)] == [256, 256, 512, 4096, 4096]
    assert growth_peak(4096) == 4096 + 2048 and growth_peak(576) == 576 + 512
    assert growth_peak(256) == growth_peak(200) - 200 + 256 == 256  # never grows: one cache
    assert growth_peak(64, 8) == 64 + 32


def test_fixed_and_growing_caches_say_what_they_hold(tmp_path_factory):
    src, path = container(tmp_path_factory, "mixtral")
    req = requirements(path, workers=1)
    model, _ = zipmoe.load(path, budget=req["budget_for"](1.0), workers=1)
    try:
        fixed = DecodeLoop(model, context=100, kv="fixed")
        assert not fixed.growing and fixed.columns == 100 and fixed.kv_bytes == fixed.kv_bytes_limit
        assert fixed.describe_kv().startswith("KV cache: 100 tokens, ")
        grow = DecodeLoop(model, context=10**6)
        assert grow.growing and grow.columns == 256 and grow.kv_bytes < grow.kv_bytes_limit
        line = grow.describe_kv(10**6)
        assert f"from 256 to {grow.context} tokens (asked for 1000000" in line and "at most" in line
        with pytest.raises(UsageError, match="kv must be"):
            DecodeLoop(model, context=100, kv="elastic")
        # the reuse path grows too, keeping what the cache holds
        loop = DecodeLoop(model, context=64, chunk=8)
        first = loop.generate(torch.arange(3, 9)[None], max_new_tokens=4, min_new_tokens=4, do_sample=False, reuse=True)
        held = loop.tokens[0][:]
        assert loop.columns == 16 and len(held) == 9
        conv = held + first.tokens[0][-1:] + list(range(20, 30))
        res = loop.generate(torch.tensor([conv]), max_new_tokens=2, min_new_tokens=2, do_sample=False, reuse=True)
        assert res.stats["reused_tokens"] == 9 and loop.columns == 32 and loop.tokens[0][:9] == held
    finally:
        model.zipmoe.close()


def test_sampling_matches_generate_with_the_same_seed(tmp_path_factory):
    src, path = container(tmp_path_factory, "olmoe")
    ref = reference(src)
    req = requirements(path, workers=1)
    model, _ = zipmoe.load(path, budget=req["budget_for"](1.0), workers=1)
    batch = inputs(_vocab(src), False, batch=4, seed=3)
    try:
        loop = DecodeLoop(model, context=CONTEXT, batch=4)
        for seed in (0, 1):
            res = loop.generate(batch["input_ids"], batch["attention_mask"], max_new_tokens=6, do_sample=True,
                                temperature=0.7, top_p=0.9, top_k=20, seed=seed, keep_logits=True,
                                generation_kwargs={"pad_token_id": 0})
            torch.manual_seed(seed)
            want = _ref_generate(ref, batch, 6, do_sample=True, temperature=0.7, top_p=0.9, top_k=20)
            _check(res, want, batch["input_ids"].shape[1], f"sampling seed {seed}")
    finally:
        model.zipmoe.close()


def test_interrupt_keeps_the_cache_consistent(tmp_path_factory):
    src, path = container(tmp_path_factory, "qwen3_moe")
    req = requirements(path, workers=1)
    model, _ = zipmoe.load(path, budget=req["min_budget"], workers=1)
    ids = torch.arange(5, 15)[None]
    try:
        loop = DecodeLoop(model, context=CONTEXT)
        want = loop.generate(ids, max_new_tokens=6, do_sample=False, keep_logits=True,
                             generation_kwargs={"pad_token_id": 0})
        seen = []

        def stop_after_two(host):
            seen.append(host)
            if len(seen) == 2:
                raise KeyboardInterrupt

        res = loop.generate(ids, max_new_tokens=6, do_sample=False, on_token=stop_after_two,
                            generation_kwargs={"pad_token_id": 0})
        assert res.interrupted and res.stop == "interrupted" and len(res.tokens[0]) == 2
        assert model.zipmoe._inflight == 0
        again = loop.generate(ids, max_new_tokens=6, do_sample=False, keep_logits=True, reuse=True,
                              generation_kwargs={"pad_token_id": 0})
        assert again.tokens == want.tokens
        assert all(torch.equal(a, b) for a, b in zip(again.logits, want.logits))
    finally:
        model.zipmoe.close()


def test_encoder_decoder_is_refused_with_one_line(tmp_path_factory):
    _, path = container(tmp_path_factory, "switch_transformers")
    req = requirements(path, workers=1)
    model, _ = zipmoe.load(path, budget=req["budget_for"](1.0), workers=1)
    try:
        with pytest.raises(UsageError, match="encoder-decoder"):
            DecodeLoop(model)
    finally:
        model.zipmoe.close()


def test_the_loop_keeps_no_autograd_graph(tmp_path_factory):
    """Called with autograd on (as the server's model thread calls it), the loop's entry points
    run under inference_mode themselves: the logits of prefill, step and generate carry no graph,
    and a loop made under inference_mode (the planner's passes) still resets and prefills
    outside it."""
    src, path = container(tmp_path_factory, "mixtral")
    ref = reference(src)
    req = requirements(path, workers=1)
    model, _ = zipmoe.load(path, budget=req["budget_for"](0.5), workers=1)
    ids = torch.arange(5, 15)[None]
    try:
        assert torch.is_grad_enabled()
        loop = DecodeLoop(model, context=CONTEXT)
        got = [loop.prefill(ids)]
        for _ in range(3):
            got.append(loop.step(got[-1].argmax(-1)))
        res = loop.generate(ids, max_new_tokens=4, do_sample=False, keep_logits=True,
                            generation_kwargs={"pad_token_id": 0})
        for logits in got + res.logits:
            assert logits.grad_fn is None and not logits.requires_grad
        assert all(torch.equal(a, b) for a, b in zip(got, res.logits))  # prefill and step: generate's bits
        _check(res, _ref_generate(ref, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, 4), 10, "grad on")
        with torch.inference_mode():
            made_inside = DecodeLoop(model, context=CONTEXT)
            made_inside.prefill(ids)
        made_inside.reset()
        assert torch.equal(made_inside.prefill(ids), got[0])
    finally:
        model.zipmoe.close()


@pytest.mark.parametrize("family", DECODERS)
def test_kv_size_from_config_bounds_what_the_loop_allocates(tmp_path_factory, family):
    from zipmoe.runtime.engine.kvsize import kv_cache_bytes_upper
    from zipmoe.runtime.engine.memlimit import kv_cache_bytes

    src, path = container(tmp_path_factory, family)
    cfg = json.loads((src / "config.json").read_text())
    req = requirements(path, workers=1)
    model, _ = zipmoe.load(path, budget=req["budget_for"](1.0), workers=1)
    try:
        for b in (1, 4):
            loop = DecodeLoop(model, context=40, batch=b)
            est = kv_cache_bytes_upper(cfg, batch=b, context=40, itemsize=2)
            assert loop.kv_bytes == loop._allocated_bytes() and 0 < loop.kv_bytes <= est
            if not cfg.get("sliding_window"):
                assert loop.kv_bytes == est
                # the load-time memory check sizes the cache with the same arithmetic
                assert kv_cache_bytes(cfg, 2, tokens=40) * b == loop.kv_bytes
    finally:
        model.zipmoe.close()


def test_generate_ids_is_generate_on_the_loop(tmp_path_factory):
    """The planner's served passes call generate_ids as they called model.generate: same
    sequences as transformers with a static cache, the streamer fed the prompt then each token;
    the loop is kept on the runtime (``model.zipmoe.loops``), not on the model."""
    src, path = container(tmp_path_factory, "qwen2_moe")
    ref = reference(src)
    req = requirements(path, workers=1)
    model, _ = zipmoe.load(path, budget=req["budget_for"](0.5), workers=1)
    from zipmoe.runtime.engine.loop import generate_ids

    class Stream:
        def __init__(self):
            self.puts, self.ended = [], False

        def put(self, v):
            self.puts.append(v.tolist())

        def end(self):
            self.ended = True

    batch = inputs(_vocab(src), False, batch=4, seed=5)
    try:
        s = Stream()
        got = generate_ids(model, batch["input_ids"], batch["attention_mask"], max_new_tokens=4, min_new_tokens=4,
                           streamer=s, pad_token_id=0)
        want = _ref_generate(ref, batch, 4, context=model.zipmoe.loops[4].context, min_new_tokens=4)
        assert torch.equal(got, want.sequences)
        assert s.puts[0] == batch["input_ids"].tolist() and len(s.puts) == 5 and s.ended
        first = model.zipmoe.loops[4]
        generate_ids(model, batch["input_ids"], batch["attention_mask"], max_new_tokens=2, pad_token_id=0)
        assert model.zipmoe.loops[4] is first  # the cache is reused
        assert "_zipmoe_loops" not in model.__dict__
    finally:
        model.zipmoe.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
@pytest.mark.parametrize("batch", [1, 4])
def test_graphed_steps_equal_the_reference(tmp_path_factory, family, batch):
    """On CUDA the loop's steps replay the CUDA graphs where runtime/engine/graphs.py supports the
    model (warm-up, capture, then replays: three requests), bits equal to transformers."""
    src, path = container(tmp_path_factory, family)
    ref = reference(src, "cuda")
    req = requirements(path, workers=1, device="cuda")
    ids = torch.randint(3, _vocab(src), (batch, 9), generator=torch.Generator().manual_seed(batch)).cuda()
    want = _ref_generate(ref, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, 6)
    model, _ = zipmoe.load(path, budget=req["budget_for"](1.0), device="cuda", workers=1)
    try:
        loop = DecodeLoop(model, context=CONTEXT, batch=batch, graphs="auto")
        try:
            from zipmoe.runtime.engine import graphs
        except ImportError:
            graphs = None
        if graphs is not None and graphs.supported(model, batch):
            assert loop.graphed is not None
        for attempt in range(3):
            res = loop.generate(ids, max_new_tokens=6, do_sample=False, keep_logits=True,
                                generation_kwargs={"pad_token_id": 0})
            _check(res, want, ids.shape[1], f"{family} batch {batch} graphed={loop.graphed is not None} #{attempt}")
    finally:
        model.zipmoe.close()


def test_the_graphed_step_hook_on_the_cpu(tmp_path_factory):
    """The contract with graphs.GraphedStep, with a stand-in that runs what the graphs capture
    (engine/step.py's forward): every step goes through it, padded or not, with the [batch, 1]
    position ids of the new token and the mask in its static [batch, context] form, and the
    logits stay those of the reference."""
    from zipmoe.runtime.engine.step import forward as step_forward

    src, path = container(tmp_path_factory, "olmoe")
    ref = reference(src)
    req = requirements(path, workers=1)
    model, _ = zipmoe.load(path, budget=req["budget_for"](1.0), workers=1)

    class StandIn:
        def __init__(self, loop):
            self.loop, self.calls = loop, 0

        def __call__(self, input_ids, position_ids, attention_mask):
            b = self.loop.batch
            assert input_ids.shape == (b, 1) and position_ids.shape == (b, 1)
            assert attention_mask.shape == (b, self.loop.cache.layers[0].max_cache_len)
            assert bool((attention_mask.sum(-1) == torch.tensor([len(t) + 1 for t in self.loop.tokens])).all()) or \
                int(attention_mask.sum(-1).max()) <= self.loop.length + 1
            self.calls += 1
            return step_forward(model, self.loop.cache, input_ids, position_ids, attention_mask)

    try:
        for b, padded in ((1, False), (4, False), (4, True)):
            batch = inputs(_vocab(src), False, batch=b, seed=11)
            if not padded:
                batch["attention_mask"] = torch.ones_like(batch["input_ids"])
            want = _ref_generate(ref, batch, 5)
            loop = DecodeLoop(model, context=CONTEXT, batch=b)
            loop.graphed = StandIn(loop)
            res = loop.generate(batch["input_ids"], batch["attention_mask"], max_new_tokens=5, do_sample=False,
                                keep_logits=True, generation_kwargs={"pad_token_id": 0})
            _check(res, want, batch["input_ids"].shape[1], f"batch {b} padded={padded}")
            assert loop.graphed.calls == 4
    finally:
        model.zipmoe.close()
