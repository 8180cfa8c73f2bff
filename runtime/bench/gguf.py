"""The model as a bf16 GGUF file, for the ``llama.cpp`` baseline of `zipmoe bench`.

bf16 GGUF is lossless: every bf16 weight of the safetensors source is copied bit for bit (2-D
and 3-D tensors stay bf16; 1-D ones, the norms, become float32 as llama.cpp's own converter
stores them, which is exact for bf16 values). It is written with ``gguf``'s writer (the
``gguf`` package, in the ``demo`` and ``baselines`` extras), streaming one tensor at a time, in
the layout llama.cpp's ``convert_hf_to_gguf.py --outtype bf16`` writes:

- Mixtral (``model_type`` mixtral; the demo model): architecture ``llama`` with
  ``llama.expert_count``; attention ``q``/``k`` rows permuted to llama.cpp's rotary layout
  (the converter's ``LlamaModel.permute``); the experts of a layer stacked into
  ``blk.L.ffn_{gate,up,down}_exps`` [E, I, H] / [E, H, I]; the router ``ffn_gate_inp``.
  Per-expert (``experts.N.w1``) and fused (``experts.gate_up_proj``) checkpoints both work.
- The tokenizer (``tokenizer.json``, byte-level BPE) as ``gpt2`` tokens, types and merges,
  padded with ``[PADn]`` tokens up to ``vocab_size``. The bench feeds token ids, so the
  tokenizer only has to load.

Other families (Qwen-MoE, OLMoE, DeepSeek-V2, Switch) are not written here: convert them with
llama.cpp's ``convert_hf_to_gguf.py SRC --outtype bf16 --outfile X.gguf`` (in the
``llama-cpp-python`` source distribution under ``vendor/llama.cpp``) and give
``zipmoe bench --gguf X.gguf``. Anything that cannot be converted raises :class:`GGUFError`
with one line; the output is written to a temporary name and renamed only when complete.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from zipmoe.errors import ZipmoeError

SUPPORTED = ("mixtral",)
GGUF_NAME = "model-bf16.gguf"
EXTRA_LINE = "the llama.cpp baseline's GGUF conversion needs the gguf package: pip install 'zipmoe[baselines]'"


class GGUFError(ZipmoeError):
    """The model could not be converted to GGUF (one line: what and why)."""


# ----------------------------------------------------------------------------- names


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_DENSE_LAYER = {
    "input_layernorm.weight": "attn_norm",
    "post_attention_layernorm.weight": "ffn_norm",
    "self_attn.q_proj.weight": "attn_q",
    "self_attn.k_proj.weight": "attn_k",
    "self_attn.v_proj.weight": "attn_v",
    "self_attn.o_proj.weight": "attn_output",
    "block_sparse_moe.gate.weight": "ffn_gate_inp",
    "mlp.gate.weight": "ffn_gate_inp",
}
_TOP = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm", "lm_head.weight": "output"}
_EXPS = {"gate": "ffn_gate_exps", "up": "ffn_up_exps", "down": "ffn_down_exps"}


def permute_rows(w, n_head: int):
    """llama.cpp's rotary layout for q/k rows (convert_hf_to_gguf's ``LlamaModel.permute``):
    HF rotates halves of each head, llama.cpp adjacent pairs. A row permutation: lossless."""
    shape = w.shape
    return w.reshape(n_head, 2, shape[0] // n_head // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _config(source: Path) -> dict:
    try:
        return json.loads(Path(source, "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise GGUFError(f"GGUF conversion failed: cannot read {source}/config.json ({exc})") from None


def check_supported(config: dict) -> None:
    mt = config.get("model_type")
    if mt not in SUPPORTED:
        raise GGUFError(
            f"GGUF conversion of model_type {mt!r} is not built into zipmoe (it converts {', '.join(SUPPORTED)}): convert it with "
            "llama.cpp's convert_hf_to_gguf.py --outtype bf16 and give --gguf FILE")


# ----------------------------------------------------------------------------- tokenizer


def tokenizer_kv(source: Path, config: dict) -> dict:
    """tokens, token types and merges (gpt2 byte-level BPE) from tokenizer.json."""
    vocab_size = int(config.get("vocab_size") or 0)
    path = Path(source, "tokenizer.json")
    if not path.is_file():
        raise GGUFError(f"GGUF conversion failed: {source} has no tokenizer.json (llama.cpp needs the vocabulary in the file)")
    try:
        tj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise GGUFError(f"GGUF conversion failed: cannot read {path} ({exc})") from None
    model = tj.get("model") or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise GGUFError(f"GGUF conversion failed: {path} is a {model.get('type')!r} tokenizer; only byte-level BPE (gpt2) is converted here")
    by_id: dict[int, str] = {int(i): t for t, i in model["vocab"].items()}
    special = set()
    for a in tj.get("added_tokens") or []:
        by_id[int(a["id"])] = a["content"]
        if a.get("special"):
            special.add(int(a["id"]))
    n = max(vocab_size, max(by_id) + 1 if by_id else 0)
    tokens, types = [], []
    for i in range(n):
        if i in by_id:
            tokens.append(by_id[i])
            types.append(3 if i in special else 1)  # CONTROL / NORMAL
        else:
            tokens.append(f"[PAD{i}]")
            types.append(5)  # UNUSED
    merges = []
    for m in model.get("merges") or []:
        merges.append(m if isinstance(m, str) else " ".join(m))
    if not merges:  # llama.cpp insists on the key; a vocabulary without merges gets one harmless merge
        a, b = next(((x, y) for x in tokens for y in tokens if len(x) == 1 and len(y) == 1), (tokens[0], tokens[0]))
        merges = [f"{a} {b}"]
    gen = {}
    try:
        gen = json.loads(Path(source, "generation_config.json").read_text())
    except (OSError, json.JSONDecodeError):
        pass
    ids = {}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = config.get(key, gen.get(key))
        if isinstance(v, list):
            v = v[0] if v else None
        if isinstance(v, int) and 0 <= v < n:
            ids[key] = v
    return {"tokens": tokens, "types": types, "merges": merges, "ids": ids}


# ----------------------------------------------------------------------------- tensors


def _plan_tensors(source: Path, config: dict):
    """[(gguf name, [(file, hf name, how)], kind)] in order; kind "dense" or ("exps", proj)."""
    from safetensors import safe_open

    from zipmoe.codecs.naming import classify

    files = sorted(Path(source).glob("*.safetensors"))
    if not files:
        raise GGUFError(f"GGUF conversion failed: no .safetensors files in {source}")
    n_layers = int(config["num_hidden_layers"])
    n_exp = int(config.get("num_local_experts") or config.get("num_experts") or 0)
    dense: dict[str, tuple] = {}
    experts: dict[tuple, dict] = {}  # (layer, proj) -> {expert or None: (file, name)}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                shape = tuple(st.get_slice(name).get_shape())
                role = classify(name, shape, config)
                if role.role == "expert":
                    experts.setdefault((role.layer, role.proj), {})[role.expert] = (f, name)
                    continue
                if name in _TOP:
                    dense[_TOP[name]] = (f, name)
                    continue
                m = _LAYER.match(name)
                if m and m.group(2) in _DENSE_LAYER:
                    dense[f"blk.{m.group(1)}.{_DENSE_LAYER[m.group(2)]}"] = (f, name)
                    continue
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                raise GGUFError(f"GGUF conversion failed: tensor {name!r} has no place in llama.cpp's llama/Mixtral layout")
    plan = []
    for key in ("token_embd", "output_norm", "output"):
        if key in dense:
            plan.append((key + ".weight", [dense.pop(key)], "dense"))
    for L in range(n_layers):
        for part in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate_inp"):
            k = f"blk.{L}.{part}"
            if k not in dense:
                raise GGUFError(f"GGUF conversion failed: layer {L} has no {part} tensor")
            plan.append((k + ".weight", [dense.pop(k)], part))
        for proj in ("gate", "up", "down"):
            per = experts.get((L, proj))
            if per is not None and None not in per:
                if sorted(per) != list(range(n_exp)):
                    raise GGUFError(f"GGUF conversion failed: layer {L} {proj}: experts {sorted(per)} instead of 0..{n_exp - 1}")
                plan.append((f"blk.{L}.{_EXPS[proj]}.weight", [per[e] for e in range(n_exp)], ("stack", proj)))
            elif per is not None:  # fused [E, I, H] / [E, H, I]
                plan.append((f"blk.{L}.{_EXPS[proj]}.weight", [per[None]], ("fused", proj)))
            elif (L, "gate_up") in experts and proj in ("gate", "up"):
                plan.append((f"blk.{L}.{_EXPS[proj]}.weight", [experts[(L, "gate_up")][None]], ("gate_up", proj)))
            else:
                raise GGUFError(f"GGUF conversion failed: layer {L} has no {proj} experts")
    return plan


def _load(parts, how, config: dict):
    """The torch tensor (bf16 or float32) for one GGUF tensor, in HF orientation."""
    import torch
    from safetensors import safe_open

    def get(f, name):
        with safe_open(str(f), framework="pt") as st:
            return st.get_tensor(name)

    if how == "dense" or isinstance(how, str):
        t = get(*parts[0])
        if how in ("attn_q", "attn_k"):
            n_head = int(config["num_attention_heads"]) if how == "attn_q" else int(config.get("num_key_value_heads") or config["num_attention_heads"])
            t = permute_rows(t, n_head).contiguous()
        return t
    mode, proj = how
    if mode == "stack":
        return torch.stack([get(*p) for p in parts])
    t = get(*parts[0])
    if mode == "gate_up":  # [E, 2I, H]: gate rows first (transformers' chunk(2))
        half = t.shape[1] // 2
        t = t[:, :half] if proj == "gate" else t[:, half:]
    return t.contiguous()


def _as_gguf_array(t):
    """(numpy array, raw dtype) for the writer: bf16 as its bytes, 1-D as float32, float32 as is."""
    import gguf
    import numpy as np
    import torch

    if t.dim() <= 1:
        return t.to(torch.float32).numpy(), None
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(np.uint8), gguf.GGMLQuantizationType.BF16
    if t.dtype == torch.float32:
        return t.numpy(), None
    if t.dtype == torch.float16:
        return t.numpy(), None
    raise GGUFError(f"GGUF conversion failed: a {t.dtype} weight (bf16, float16 or float32 only)")


_ST_DTYPES = {"BF16": "bfloat16", "F32": "float32", "F16": "float16"}


def _info(parts, how):
    """(shape, numpy dtype, bytes, raw dtype) of one GGUF tensor from the safetensors headers
    (what :func:`_as_gguf_array` will produce), without reading the data."""
    import gguf
    import numpy as np
    from safetensors import safe_open

    f, name = parts[0]
    with safe_open(str(f), framework="pt") as st:
        sl = st.get_slice(name)
        shape = list(sl.get_shape())
        dt = sl.get_dtype()
    if dt not in _ST_DTYPES:
        raise GGUFError(f"GGUF conversion failed: tensor {name!r} is {dt} (bf16, float16 or float32 only)")
    if not isinstance(how, str):
        mode, _ = how
        if mode == "stack":
            shape = [len(parts)] + shape
        elif mode == "gate_up":
            shape[1] //= 2
    n = int(np.prod(shape)) if shape else 1
    if len(shape) <= 1:
        return shape, np.dtype(np.float32), 4 * n, None
    if dt == "BF16":
        return shape[:-1] + [2 * shape[-1]], np.dtype(np.uint8), 2 * n, gguf.GGMLQuantizationType.BF16
    if dt == "F16":
        return shape, np.dtype(np.float16), 2 * n, None
    return shape, np.dtype(np.float32), 4 * n, None


def convert(source: Path, out: Path, log=lambda m: None) -> Path:
    """Write ``source`` (safetensors folder) as a bf16 GGUF at ``out`` (atomically)."""
    try:
        import gguf
    except ImportError:
        raise GGUFError(EXTRA_LINE) from None
    source, out = Path(source), Path(out)
    config = _config(source)
    check_supported(config)
    plan = _plan_tensors(source, config)
    tok = tokenizer_kv(source, config)
    H = int(config["hidden_size"])
    n_head = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or H // n_head)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    try:
        w.add_name(Path(source).name)
        w.add_context_length(int(config.get("max_position_embeddings") or 4096))
        w.add_embedding_length(H)
        w.add_block_count(int(config["num_hidden_layers"]))
        w.add_feed_forward_length(int(config["intermediate_size"]))
        w.add_head_count(n_head)
        w.add_head_count_kv(int(config.get("num_key_value_heads") or n_head))
        rope = config.get("rope_parameters") or {}
        w.add_rope_freq_base(float(rope.get("rope_theta") or config.get("rope_theta") or 10000.0))
        w.add_layer_norm_rms_eps(float(config.get("rms_norm_eps") or 1e-5))
        w.add_expert_count(int(config.get("num_local_experts") or 0))
        w.add_expert_used_count(int(config.get("num_experts_per_tok") or 0))
        w.add_rope_dimension_count(head_dim)
        if head_dim != H // n_head:
            w.add_key_length(head_dim)
            w.add_value_length(head_dim)
        w.add_vocab_size(len(tok["tokens"]))
        w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tok["tokens"])
        w.add_token_types(tok["types"])
        w.add_token_merges(tok["merges"])
        for key, fn in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id), ("pad_token_id", w.add_pad_token_id)):
            if key in tok["ids"]:
                fn(tok["ids"][key])
        w.add_add_bos_token(False)
        # tensor infos first (shapes from the safetensors headers), then the data one tensor at a time
        for name, parts, how in plan:
            shape, dtype, nbytes, raw = _info(parts, how)
            w.add_tensor_info(name, shape, dtype, nbytes, raw_dtype=raw)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for name, parts, how in plan:
            arr, _ = _as_gguf_array(_load(parts, how, config))
            w.write_tensor_data(arr)
            del arr
        w.close()
        os.replace(tmp, out)
    except GGUFError:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    except OSError as exc:
        w.close()
        tmp.unlink(missing_ok=True)
        raise GGUFError(f"GGUF conversion failed: writing {out}: {exc.strerror or exc}") from None
    except Exception as exc:  # noqa: BLE001  (a converter bug or a checkpoint it did not expect: one line)
        w.close()
        tmp.unlink(missing_ok=True)
        raise GGUFError(f"GGUF conversion failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None
    return out


def prepare(source: Path, work: Path, given: Path | None, log=lambda m: None) -> Path:
    """The GGUF the llama.cpp engine serves: ``--gguf FILE``, else ``source`` converted once into
    the work folder (redone when the source's safetensors change)."""
    if given is not None:
        g = Path(given)
        if not g.is_file():
            raise GGUFError(f"--gguf {g}: no such file")
        with open(g, "rb") as f:
            if f.read(4) != b"GGUF":
                raise GGUFError(f"--gguf {g}: not a GGUF file")
        return g
    out = Path(work) / "gguf" / GGUF_NAME
    stamp = out.with_name(out.name + ".source")
    ident = f"{Path(source).resolve()}:{max((p.stat().st_mtime_ns for p in Path(source).glob('*.safetensors')), default=0)}"
    if out.exists() and stamp.exists() and stamp.read_text() == ident:
        return out
    log(f"converting {source} to a bf16 GGUF at {out} for the 'llama.cpp' engine (once)")
    convert(source, out, log)
    stamp.write_text(ident)
    return out
