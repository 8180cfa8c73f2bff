"""The server's model seam and engine in-process: a lone row is generate()'s computation exactly; rows
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
    from zipmoe.runtime.serve.loader import load

    _, path = container(tmp_path_factory, "mixtral")
    torch.set_num_threads(1)
    model, tok = load(path, budget="64M", device="cpu", workers=1, threads=1)
    if tok is None:
        pytest.skip("needs synth checkpoints with a tokenizer")
    yield model, tok
    model.zipmoe.close()


def _prompts(tok):
    from zipmoe.runtime.serve.generate import chat_inputs

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


def test_lone_row_is_generate(loaded):
    from zipmoe.runtime.api.stepper import TransformersStepper

    model, tok = loaded
    stepper = TransformersStepper(model)
    for ids in _prompts(tok)[:2]:
        with torch.no_grad():
            want = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                  max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
        got, _ = _alone(stepper, ids, 8)
        assert got[: len(want)] == want and len(want) >= 1  # generate() stops at an end-of-sequence token


def test_padded_joined_and_dropped_rows_compute_what_they_compute_alone(loaded):
    from zipmoe.runtime.api.stepper import TransformersStepper

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
            new, lg = stepper.prefill(prompts[2:])
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


def test_engine_batches_cancels_and_stops(loaded):
    from zipmoe.runtime.api.batcher import Engine, Request, SamplingParams
    from zipmoe.runtime.api.stepper import TransformersStepper, context_length

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
    engine.start()
    try:
        reqs[3].cancel()
        assert done.wait(60)
    finally:
        engine.stop(timeout=30)
    assert [r.finish_reason for r in reqs[:3]] == ["length"] * 3 and reqs[3].finish_reason == "cancelled"
    assert all(len(r.token_ids) == 6 for r in reqs[:3]) and len(reqs[3].token_ids) < 400
    assert reqs[0].token_ids == lone  # the first two started together: padded, still the same tokens here
    assert engine.running == 0 and engine.waiting == 0
