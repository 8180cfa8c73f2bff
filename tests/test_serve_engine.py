"""The server's model seam and engine in-process: a lone row on transformers' forward is generate()'s
computation exactly, a lone request (alone=True) is the decode loop's (chat's) with its cache
kept for the next turn; rows
that are left-padded, joined mid-decode and dropped keep computing what they compute alone (up to
the last bits that padding and other matrix shapes may move); the engine batches, cancels and
honours stop strings."""

from __future__ import annotations

import threading

import pytest
import torch

from test_runtime_fixtures import container


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from zipmoe.runtime.engine.loader import load

    _, path = container(tmp_path_factory, "mixtral")
    torch.set_num_threads(1)
    model, tok = load(path, budget="64M", device="cpu", workers=1, threads=1)
    if tok is None:
        pytest.skip("needs synth checkpoints with a tokenizer")
    yield model, tok
    model.zipmoe.close()


def _prompts(tok):
    from zipmoe.runtime.engine.turn import chat_inputs

    texts = ["Hello there", "What is the capital of France?", "Tell me a story about a dragon and a knight", "x"]
    return [chat_inputs(tok, [{"role": "user", "content": t}], "cpu")["input_ids"][0].tolist() for t in texts]


def _alone(stepper, ids, n):
    batch, logits = stepper.prefill([ids])
    rows = [logits[0]]
    toks = [int(logits[0].argmax())]
    for _ in range(n - 1):
        logits = stepper.step(batch, [toks[-1]])
        rows.append(logits[0])
        toks.append(int(logits[0].argmax()))
    return toks, rows


def _run_until(engine, done: threading.Event, started=None, timeout: float = 60) -> None:
    """Run ``engine`` on a thread, as the server's model thread runs it, until ``done`` is set;
    ``started()`` is called once the thread runs."""
    model_thread = threading.Thread(target=engine.run, daemon=True)
    model_thread.start()
    try:
        if started is not None:
            started()
        assert done.wait(timeout)
    finally:
        engine.stop()
        model_thread.join(30)


def test_lone_row_is_generate(loaded):
    from zipmoe.runtime.server.stepper import TransformersStepper

    model, tok = loaded
    stepper = TransformersStepper(model)
    for ids in _prompts(tok)[:2]:
        with torch.no_grad():
            want = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                  max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
        got, _ = _alone(stepper, ids, 8)
        assert got[: len(want)] == want and len(want) >= 1  # generate() stops at an end-of-sequence token


def test_padded_joined_and_dropped_rows_compute_what_they_compute_alone(loaded):
    from zipmoe.runtime.server.stepper import TransformersStepper

    model, tok = loaded
    stepper = TransformersStepper(model)
    prompts = _prompts(tok)
    alone = [_alone(stepper, p, 6) for p in prompts]
    # rows 0 and 1 start together (left-padded); 2 and 3 join after two steps; 1 leaves after four
    batch, logits = stepper.prefill(prompts[:2])
    toks = {0: [int(logits[0].argmax())], 1: [int(logits[1].argmax())]}
    seen = {0: [logits[0]], 1: [logits[1]]}
    order = [0, 1]
    for step in range(5):
        if step == 2:
            new, lg = stepper.prefill(prompts[2:], running=batch)
            for j, r in enumerate((2, 3)):
                toks[r] = [alone[r][0][0]]
                seen[r] = [lg[j]]
            batch = stepper.join(batch, new)
            order += [2, 3]
        if step == 4:
            keep = [i for i, r in enumerate(order) if r != 1]
            batch = stepper.select(batch, keep)
            order = [order[i] for i in keep]
        # feed each row the token it produces alone, so the rows stay comparable
        feed = [alone[r][0][len(toks[r]) - 1] for r in order]
        logits = stepper.step(batch, feed)
        for i, r in enumerate(order):
            toks[r].append(int(logits[i].argmax()))
            seen[r].append(logits[i])
    for r in order + [1]:
        for k, got in enumerate(seen[r]):
            want = alone[r][1][k]
            assert torch.allclose(got, want, atol=0.05, rtol=0.0), (r, k, (got - want).abs().max())
    assert batch.mask.shape[0] == 3


def _loop_alone(loop, ids, n, reuse=False):
    logits = loop.prefill(torch.tensor([ids]), reuse=reuse)
    rows, toks = [logits[0]], [int(logits[0].argmax())]
    for _ in range(n - 1):
        logits = loop.step([toks[-1]])
        rows.append(logits[0])
        toks.append(int(logits[0].argmax()))
    return toks, rows


def test_a_lone_request_decodes_on_the_loop_as_chat_does(loaded):
    """alone=True: the stepper's DecodeLoop (a static cache of the same length as chat's):
    torch.equal logits to a DecodeLoop of its own, a conversation's next turn reuses the cache
    as chat's next turn does, and a prompt that does not extend it starts from an empty cache."""
    from zipmoe.runtime.server.stepper import LoopBatch, TransformersStepper
    from zipmoe.runtime.engine.loop import DecodeLoop

    model, tok = loaded
    stepper = TransformersStepper(model, context=64)
    ref = DecodeLoop(model, context=64)
    a = _prompts(tok)[0]
    batch, logits = stepper.prefill([a], alone=True)
    assert isinstance(batch, LoopBatch) and stepper.reused == 0
    want_toks, want = _loop_alone(ref, a, 5)
    got, toks = [logits[0]], [int(logits[0].argmax())]
    for _ in range(4):
        logits = stepper.step(batch, [toks[-1]])
        got.append(logits[0])
        toks.append(int(logits[0].argmax()))
    assert toks == want_toks and all(torch.equal(x, y) for x, y in zip(got, want))
    # the next turn: the whole first prompt, its answer, then more
    nxt = a + want_toks + a[-3:]
    batch, logits = stepper.prefill([nxt], alone=True)
    assert stepper.reused == ref.length and stepper.reused > len(a)
    assert torch.equal(logits, ref.prefill(torch.tensor([nxt]), reuse=True))
    # not an extension: from an empty cache, as a fresh chat
    other = _prompts(tok)[1]
    batch, logits = stepper.prefill([other], alone=True)
    assert stepper.reused == 0 and torch.equal(logits, DecodeLoop(model, context=64).prefill(torch.tensor([other])))
    # too long for the loop's cache (or not alone): transformers' forward, as before
    assert not stepper.fits_loop(65) and stepper.fits_loop(64)
    assert not isinstance(stepper.prefill([other])[0], LoopBatch)


def test_a_lone_row_joined_by_a_newcomer_goes_on_computing_what_it_computes_alone(loaded):
    from zipmoe.runtime.server.stepper import SlotBatch, TransformersStepper

    model, tok = loaded
    stepper = TransformersStepper(model, context=64)
    prompts = _prompts(tok)
    alone = [_alone(TransformersStepper(model), p, 6) for p in prompts[:2]]
    batch, logits = stepper.prefill([prompts[0]], alone=True)
    seen = {0: [logits[0]], 1: []}
    order = [0]
    for step in range(5):
        if step == 2:  # a second request: the lone row moves from the loop into the row batch
            assert stepper.can_join
            new, lg = stepper.prefill([prompts[1]], running=batch)
            seen[1].append(lg[0])
            batch = stepper.join(batch, new)
            order = [0, 1]
        feed = [alone[r][0][len(seen[r]) - 1] for r in order]
        logits = stepper.step(batch, feed)
        for i, r in enumerate(order):
            seen[r].append(logits[i])
    assert isinstance(batch, SlotBatch) and batch.rows == 2
    for r in (0, 1):
        for k, got in enumerate(seen[r]):
            want = alone[r][1][k]
            assert torch.allclose(got, want, atol=0.05, rtol=0.0), (r, k, (got - want).abs().max())


def test_engine_batches_cancels_and_stops(loaded):
    from zipmoe.runtime.server.batcher import Engine, Request, SamplingParams
    from zipmoe.runtime.server.stepper import TransformersStepper, context_length

    model, tok = loaded
    engine = Engine(max_batch=2)
    engine.attach(TransformersStepper(model), tok, context=context_length(model), eos_ids=[])
    done = threading.Event()
    finished = []

    def sink_for(req_box):
        def sink(kind, payload):
            if kind != "delta":
                finished.append(req_box[0])
                if len(finished) == 4:
                    done.set()
        return sink

    reqs = []
    for i, ids in enumerate(_prompts(tok)):
        box = []
        r = Request(ids, SamplingParams(max_tokens=6 if i != 3 else 400, temperature=0.0), sink_for(box))
        box.append(r)
        reqs.append(r)
    lone, _ = _alone(TransformersStepper(model), reqs[0].prompt_ids, 6)
    for r in reqs:
        engine.submit(r)
    _run_until(engine, done, started=reqs[3].cancel)
    assert [r.finish_reason for r in reqs[:3]] == ["length"] * 3 and reqs[3].finish_reason == "cancelled"
    assert all(len(r.token_ids) == 6 for r in reqs[:3]) and len(reqs[3].token_ids) < 400
    assert reqs[0].token_ids == lone  # the first two started together: padded, still the same tokens here
    assert engine.running == 0 and engine.waiting == 0


def test_the_lone_path_keeps_no_graph_and_computes_chats_logits(loaded):
    """The server's model thread runs with autograd on: the lone request's logits (the stepper
    over its DecodeLoop) carry no graph, nor do a batch's, and they are torch.equal to the
    logits of chat's turn (the DecodeLoop.generate call chat_turn makes), its tokens chat's."""
    from zipmoe.runtime.engine.loop import DecodeLoop
    from zipmoe.runtime.engine.turn import chat_turn
    from zipmoe.runtime.server.stepper import LoopBatch, TransformersStepper

    model, tok = loaded
    assert torch.is_grad_enabled()
    stepper = TransformersStepper(model, context=64)
    ids = _prompts(tok)[1]
    batch, logits = stepper.prefill([ids], alone=True)
    assert isinstance(batch, LoopBatch)
    got, toks = [logits], [int(logits[0].argmax())]
    for _ in range(5):
        logits = stepper.step(batch, [toks[-1]])
        got.append(logits)
        toks.append(int(logits[0].argmax()))
    _, batch_logits = stepper.prefill(_prompts(tok)[:2])
    for x in got + [batch_logits]:
        assert x.grad_fn is None and not x.requires_grad

    chat_loop = DecodeLoop(model, context=64)
    kept = []
    generate = chat_loop.generate

    def keeping(*args, **kw):  # chat's own call, with its logits kept
        kept.append(generate(*args, **dict(kw, keep_logits=True)))
        return kept[-1]

    chat_loop.generate = keeping
    inputs = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones((1, len(ids)), dtype=torch.long)}
    turn = chat_turn(model, tok, inputs, max_new_tokens=6, greedy=True, loop=chat_loop, reuse=True)
    want = kept[0].logits
    assert turn.token_ids == toks[: len(turn.token_ids)] and len(want) == len(turn.token_ids) >= 1
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(x.grad_fn is None and not x.requires_grad for x in want)


def test_a_lone_sampled_request_is_chats_seeded_turn(loaded):
    """The server samples as chat does (one Sampler: the generation config's processors, its
    top-k included): a lone seeded request at a temperature and top-p answers the tokens of
    `zipmoe chat --seed S --temperature T --top-p P`'s turn."""
    from zipmoe.runtime.engine.loop import DecodeLoop
    from zipmoe.runtime.engine.sampling import eos_ids
    from zipmoe.runtime.engine.turn import chat_turn
    from zipmoe.runtime.server.batcher import Engine, Request, SamplingParams
    from zipmoe.runtime.server.stepper import TransformersStepper, context_length

    model, tok = loaded
    ids = _prompts(tok)[2]
    for seed in (3, 4):
        engine = Engine(max_batch=2)
        stepper = TransformersStepper(model, context=128)
        assert stepper.fits_loop(len(ids) + 8)
        engine.attach(stepper, tok, context=context_length(model),
                      eos_ids=eos_ids(model.generation_config, model.config, tok))
        done = threading.Event()
        req = Request(ids, SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=seed),
                      lambda kind, payload: done.set() if kind != "delta" else None)
        engine.submit(req)
        _run_until(engine, done)
        inputs = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones((1, len(ids)), dtype=torch.long)}
        want = chat_turn(model, tok, inputs, max_new_tokens=8, temperature=0.8, top_p=0.9, seed=seed,
                         loop=DecodeLoop(model, context=128))
        assert want.stats["stop"] in ("eos", "max_new_tokens")
        assert req.error is None and req.cached_tokens == 0 and req.token_ids == want.token_ids, seed


def test_text_comes_a_few_tokens_at_a_time_and_whole_at_the_end(tmp_path_factory):
    """Incremental detokenization: the deltas join to the answer decoded in one go (byte-level
    tokens that split a character never show half of it), every decode before the end reads a
    few tokens whatever the answer's length, and a stop string that spans tokens cuts the text
    exactly where it starts, none of it streamed."""
    from transformers import AutoTokenizer

    from zipmoe.runtime.server.batcher import Engine, Request, SamplingParams

    src, _ = container(tmp_path_factory, "mixtral")
    tok = AutoTokenizer.from_pretrained(src)
    ids = tok.encode("héllo 世界 🐉 naïve  two  spaces, " * 12, add_special_tokens=False)
    whole = tok.decode(ids, skip_special_tokens=True)
    assert "\ufffd" in tok.decode(ids[1:2]) and len(ids) > 300  # a character split across tokens

    class Counting:
        def __init__(self):
            self.lengths = []

        def decode(self, x, **kw):
            self.lengths.append(len(x))
            return tok.decode(x, **kw)

    for stop in ([], ["🐉 naï"]):
        engine = Engine(context=10_000)
        engine.tokenizer = counting = Counting()
        events = []
        r = Request([1, 2, 3], SamplingParams(max_tokens=len(ids), stop=stop), lambda k, p: events.append((k, p)))
        for i, t in enumerate(ids):
            engine._accept(r, t, 3 + i + 1)
            if r.done:
                break
        deltas = [p for k, p in events if k == "delta"]
        assert events[-1] == ("done", None) and all("\ufffd" not in d for d in deltas)
        assert max(counting.lengths[:-1]) <= 8  # each token: a few tokens decoded
        if not stop:
            assert r.finish_reason == "length" and counting.lengths[-1] == len(ids)
            assert "".join(deltas) == r.text == whole
        else:
            assert r.finish_reason == "stop" and len(r.token_ids) < 30
            assert "".join(deltas) == r.text == whole[: whole.find(stop[0])]


def test_each_joining_prompt_gets_its_first_token_after_its_own_prefill(loaded):
    """Prompts that join the row batch together are prefilled one after another on the decode
    loop; each one's first token is sent as soon as its own prefill ends, not after the last
    one's (TTFT of the first of four clients is one prefill, not four). The tokens are those of
    the prompts decoded in one batch either way."""
    from zipmoe.runtime.server.batcher import Engine, Request, SamplingParams
    from zipmoe.runtime.server.stepper import TransformersStepper, context_length

    model, tok = loaded
    stepper = TransformersStepper(model, context=256, max_batch=4)
    assert stepper.slots is not None
    events = []  # ("prefill", i) as each prompt's prefill ends, ("first", i) as each first token goes out
    loop_prefill = stepper.loop.prefill
    count = iter(range(100))

    def prefill(*a, **kw):
        out = loop_prefill(*a, **kw)
        events.append(("prefill", next(count)))
        return out

    stepper.loop.prefill = prefill
    engine = Engine(max_batch=4)
    engine.attach(stepper, tok, context=context_length(model), eos_ids=[])
    done = threading.Event()
    reqs = []
    for i, ids in enumerate(_prompts(tok)[:3]):
        def sink(kind, payload, i=i):
            if kind == "delta" and ("first", i) not in events:
                events.append(("first", i))
            elif kind != "delta" and sum(r.done for r in reqs) == 3:
                done.set()
        reqs.append(Request(ids, SamplingParams(max_tokens=3, temperature=0.0, every_token=True), sink))
    for r in reqs:
        engine.submit(r)  # all three wait before the model thread starts: they join together
    _run_until(engine, done)
    assert [e for e in events if e[0] == "prefill"] == [("prefill", 0), ("prefill", 1), ("prefill", 2)]
    assert events.index(("first", 0)) < events.index(("prefill", 1))
    assert events.index(("first", 1)) < events.index(("prefill", 2))
    assert all(r.finish_reason == "length" and len(r.token_ids) == 3 for r in reqs)
