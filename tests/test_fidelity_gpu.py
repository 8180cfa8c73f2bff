"""Bit-identity on CUDA at the qwen1.5-moe-a2.7b shape over a long static cache (issue 26).

Two decoder layers of the qwen1.5-moe-a2.7b shape (its hidden size, 16 heads of 128, 60 experts
of 1408, top-4, the shared expert; the vocabulary cut to 8192 to keep the synth short: it plays
no part in the attention or the experts), packed with zstd, teacher-forced through
:class:`DecodeLoop` over chat's 4096-position cache. The reference is transformers computing
the same checkpoint (``experts_implementation="eager"``, bf16) stepped through the same loop
with the same attention kernels (``EngineSettings.attention``'s default, engine/step.py);
every step's logits are compared with ``torch.equal``. Budgets mix full hits, misses and
partial states; graphs on, auto (graphed and host-path layers in one step) and off; prefetch
on and off. Over a 4096-position cache cuDNN's attention kernel, which PyTorch prefers on
Hopper, rounded differently from run to run (docs/benchmarks.md §21, §23): the reference is
also run twice.
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CONTEXT = 4096
STEPS = 96
PRESET = "qwen1.5-moe-a2.7b"


@pytest.fixture(scope="module")
def qwen_shape(tmp_path_factory):
    from zipmoe.codecs.writer import pack
    from zipmoe.runtime import synth
    from zipmoe.runtime.synth.family import Preset
    from zipmoe.runtime.synth.registry import get_family

    fam = get_family("qwen2_moe")
    name = f"{PRESET}-2L-test"
    fam.presets[name] = Preset(name, dict(fam.preset(PRESET).config, num_hidden_layers=2, vocab_size=8192),
                               f"{PRESET}, 2 layers, vocabulary 8192 (tests)")
    d = tmp_path_factory.mktemp("qwen-shape")
    synth.write("qwen2_moe", d / "src", preset=name, layout="fused", force=True, progress=False)
    pack(d / "src", d / "m.zmoe", codec="zstd", force=True)
    return d / "src", d / "m.zmoe"


def _forced(model, prompt, stream, graphs="off"):
    from zipmoe.runtime.engine.loop import DecodeLoop

    loop = DecodeLoop(model, context=CONTEXT, batch=1, graphs=graphs)
    with torch.inference_mode():
        out = [loop.prefill(prompt).float().cpu()]
        for tok in stream:
            out.append(loop.step(torch.tensor([tok])).float().cpu())
    return out, loop


def test_every_budget_and_path_gives_the_references_logits_over_a_long_cache(qwen_shape):
    import zipmoe
    from transformers import AutoModelForCausalLM

    from zipmoe.runtime.engine.loader import requirements

    src, path = qwen_shape
    g = torch.Generator().manual_seed(2026)
    prompt = torch.randint(3, 8192, (1, 16), generator=g)
    stream = torch.randint(3, 8192, (STEPS,), generator=g).tolist()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16, experts_implementation="eager")
    ref = ref.to("cuda").eval()
    want, _ = _forced(ref, prompt, stream)
    again, _ = _forced(ref, prompt, stream)
    differ = [i for i, (a, b) in enumerate(zip(want, again)) if not torch.equal(a, b)]
    assert not differ, f"the reference differs from itself at steps {differ[:8]}"
    del ref
    torch.cuda.empty_cache()

    req = requirements(path, workers=2, device="cuda")
    for fraction, graphs, prefetch in ((1.0, "on", None), (0.5, "auto", None), (0.25, "auto", False), (0.25, "off", None)):
        what = f"{fraction:.2f} of the experts, graphs {graphs}, prefetch {prefetch}"
        model, _ = zipmoe.load(path, budget=req["budget_for"](fraction), device="cuda", workers=2, warm=fraction >= 1.0,
                               prefetch=prefetch)
        rt = model.zipmoe
        try:
            got, loop = _forced(model, prompt, stream, graphs=graphs)
            assert len(got) == len(want) == STEPS + 1
            for i, (a, b) in enumerate(zip(want, got)):
                assert torch.equal(a, b), f"{what}: logits differ at step {i} (max {float((a - b).abs().max()):.3g})"
            hits = rt.counters.hits
            if fraction < 1.0:
                assert hits["none"] > 0 and hits["full"] > 0, (what, hits)
            if graphs != "off":
                assert loop.graphed is not None and loop.graphed.stats["graphed_layers"] > 0, what
            if graphs == "auto" and fraction <= 0.25:
                assert loop.graphed.stats["host_layers"] > 0, (what, loop.graphed.stats)
        finally:
            rt.close()
            del model
            torch.cuda.empty_cache()
