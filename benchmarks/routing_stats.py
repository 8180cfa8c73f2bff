"""Routing statistics of a checkpoint on natural text: how popular each expert is per layer,
and how often consecutive tokens reuse experts.

    python benchmarks/routing_stats.py DIR [DIR ...] [--tokens 2048] [--layers N] [--json out.json]

DIR is a Hugging Face folder (a `zipmoe synth` output, or any MoE transformers loads). The model
runs on the CPU in float32 on one thread over natural English text (``corpus_passages()`` of
``zipmoe.runtime.plan.workload`` when it exists, else the public-domain passages below), split
into sequences of ``--seq`` bytes-or-tokens. Every router is hooked: its input is taken and the
top-k choice recomputed from its weight (the same for every family). ``--layers N`` loads only
the first N decoder layers: routing at layer L depends on layers below L only, so the figures
of those layers are exact. Per MoE layer it prints:

- ``H``: entropy (bits) of the selection distribution (share of all top-k selections that go to
  each expert); ``H_mm`` the same with the Miller-Madow finite-sample correction
  (+ (nonzero - 1) / (2 N ln 2)); ``log2 E`` is the uniform maximum.
- ``top``: the most popular expert's share of selections (uniform: 1/E).
- ``reuse``: share of a token's top-k experts that the previous token (same sequence) also
  chose; random baseline k/E. ``any``: share of tokens whose top-k set meets the previous
  token's (random: 1 - C(E-k, k) / C(E, k)). ``first``: share of tokens whose first choice equals
  the previous token's first choice (random: 1/E; the Mixtral paper's "first choice" column).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import warnings
from pathlib import Path

import numpy as np
import torch

# Public-domain English (Project Gutenberg texts: Darwin, Austen, Melville, Lincoln, Twain,
# Thoreau), used when the workload corpus is not available.
_FALLBACK = [
    "When on board H.M.S. Beagle, as naturalist, I was much struck with certain facts in the distribution "
    "of the inhabitants of South America, and in the geological relations of the present to the past "
    "inhabitants of that continent. These facts seemed to me to throw some light on the origin of species, "
    "that mystery of mysteries, as it has been called by one of our greatest philosophers. On my return "
    "home, it occurred to me, in 1837, that something might perhaps be made out on this question by "
    "patiently accumulating and reflecting on all sorts of facts which could possibly have any bearing on it.",
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
    "want of a wife. However little known the feelings or views of such a man may be on his first entering "
    "a neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is "
    "considered the rightful property of some one or other of their daughters. My dear Mr. Bennet, said his "
    "lady to him one day, have you heard that Netherfield Park is let at last?",
    "Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my purse, "
    "and nothing particular to interest me on shore, I thought I would sail about a little and see the "
    "watery part of the world. It is a way I have of driving off the spleen and regulating the circulation. "
    "Whenever I find myself growing grim about the mouth; whenever it is a damp, drizzly November in my soul, "
    "then, I account it high time to get to sea as soon as I can.",
    "Four score and seven years ago our fathers brought forth on this continent, a new nation, conceived in "
    "Liberty, and dedicated to the proposition that all men are created equal. Now we are engaged in a great "
    "civil war, testing whether that nation, or any nation so conceived and so dedicated, can long endure. "
    "We are met on a great battle-field of that war. We have come to dedicate a portion of that field, as a "
    "final resting place for those who here gave their lives that that nation might live.",
    "You don't know about me without you have read a book by the name of The Adventures of Tom Sawyer; but "
    "that ain't no matter. That book was made by Mr. Mark Twain, and he told the truth, mainly. There was "
    "things which he stretched, but mainly he told the truth. That is nothing. I never seen anybody but lied "
    "one time or another, without it was Aunt Polly, or the widow, or maybe Mary.",
    "I went to the woods because I wished to live deliberately, to front only the essential facts of life, "
    "and see if I could not learn what it had to teach, and not, when I came to die, discover that I had not "
    "lived. I did not wish to live what was not life, living is so dear; nor did I wish to practise "
    "resignation, unless it was quite necessary. I wanted to live deep and suck out all the marrow of life.",
]


def passages() -> list[str]:
    try:
        from zipmoe.runtime.plan.workload import corpus_passages

        out = [p for p in corpus_passages() if p.strip()]
        if out:
            return out
    except Exception:  # the workload module is optional here
        pass
    return list(_FALLBACK)


_ROUTER = re.compile(r"\.(mlp|block_sparse_moe)\.gate$|\.router\.classifier$")


def load(path: Path, layers: int | None):
    import transformers
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path)
    if layers is not None:
        if getattr(cfg, "is_encoder_decoder", False):
            raise SystemExit("--layers is for decoder-only models")
        cfg.num_hidden_layers = min(layers, cfg.num_hidden_layers)
    cls = getattr(transformers, cfg.architectures[0])
    kw = {} if cfg.model_type == "switch_transformers" else {"experts_implementation": "eager"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = cls.from_pretrained(path, config=cfg, dtype=torch.float32, **kw)
    model.eval()
    return model


def top_k_of(model) -> int:
    return int(getattr(model.config, "num_experts_per_tok", None) or 1)


def collect(model, sequences: list[torch.Tensor]) -> dict[str, list[np.ndarray]]:
    """{router name: [int array [tokens, k] of top-k experts, first choice first] per sequence}."""
    k = top_k_of(model)
    routers = {n: m for n, m in model.named_modules() if _ROUTER.search(n) and hasattr(m, "weight")}
    picks: dict[str, list[np.ndarray]] = {n: [] for n in routers}
    handles = []
    for name, mod in routers.items():
        def hook(m, args, _name=name):
            x = args[0].reshape(-1, args[0].shape[-1]).float()
            logits = x @ m.weight.float().T
            picks[_name].append(logits.topk(k, dim=-1).indices.numpy().astype(np.int32))

        handles.append(mod.register_forward_pre_hook(hook))
    seq2seq = getattr(model.config, "is_encoder_decoder", False)
    try:
        with torch.no_grad():
            for ids in sequences:
                ids = ids.reshape(1, -1)
                if seq2seq:
                    model(input_ids=ids, decoder_input_ids=ids)
                else:
                    (model.model if hasattr(model, "model") else model)(input_ids=ids)
    finally:
        for h in handles:
            h.remove()
    return {n: v for n, v in picks.items() if v}


def layer_stats(seqs: list[np.ndarray], num_experts: int) -> dict:
    k = seqs[0].shape[1]
    counts = np.bincount(np.concatenate([s.reshape(-1) for s in seqs]), minlength=num_experts)
    n = counts.sum()
    p = counts / n
    nz = p[p > 0]
    h = float(-(nz * np.log2(nz)).sum())
    h_mm = h + (len(nz) - 1) / (2 * n * math.log(2))
    inter, anyhit, first, pairs = 0.0, 0, 0, 0
    for s in seqs:
        if len(s) < 2:
            continue
        a, b = s[1:], s[:-1]
        same = (a[:, :, None] == b[:, None, :]).any(-1)  # [T-1, k]: expert of token t chosen by t-1
        inter += same.sum() / k
        anyhit += int(same.any(-1).sum())
        first += int((a[:, 0] == b[:, 0]).sum())
        pairs += len(a)
    e = num_experts
    any_base = 1.0 - math.comb(e - k, k) / math.comb(e, k) if e - k >= k else 1.0
    return dict(experts=e, top_k=k, selections=int(n), entropy_bits=h, entropy_mm_bits=h_mm,
                max_bits=math.log2(e), top_share=float(p.max()), reuse=inter / max(pairs, 1),
                reuse_random=k / e, any_overlap=anyhit / max(pairs, 1), any_random=any_base,
                first_repeat=first / max(pairs, 1), first_random=1.0 / e)


def measure(path, tokens: int = 2048, seq: int = 256, layers: int | None = None, text: str = "natural") -> dict:
    """Routing statistics of the model in ``path`` over ``tokens`` tokens of natural text
    (``text="random"``: token ids drawn uniformly from the synthetic tokenizer's 256 bytes, a
    stand-in for a large vocabulary's flatter token distribution)."""
    path = Path(path)
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = load(path, layers)
    ids: list[int] = []
    for passage in passages():
        ids.extend(tok(passage, add_special_tokens=False).input_ids)
        if len(ids) >= tokens:
            break
    while len(ids) < tokens:  # repeat the text if the corpus is short
        ids = ids + ids
    ids = ids[:tokens]
    if text == "random":
        ids = torch.randint(5, 261, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    elif text != "natural":
        raise SystemExit(f"unknown --text {text!r}: natural or random")
    sequences = [torch.tensor(ids[i:i + seq]) for i in range(0, len(ids), seq)]
    picks = collect(model, sequences)
    routers = dict(model.named_modules())
    out = {name: layer_stats(v, routers[name].weight.shape[0]) for name, v in picks.items()}
    cfg = json.loads((path / "config.json").read_text())
    return dict(path=str(path), synth=cfg.get("zipmoe_synth"), text=text, tokens=len(ids), layers=out)


def summary(r: dict) -> dict:
    ls = list(r["layers"].values())
    keys = ("entropy_bits", "entropy_mm_bits", "top_share", "reuse", "any_overlap", "first_repeat")
    return {k: float(np.mean([x[k] for x in ls])) for k in keys} | {
        k: ls[0][k] for k in ("experts", "top_k", "max_bits", "reuse_random", "any_random", "first_random")}


def print_report(r: dict) -> None:
    s = r.get("synth") or {}
    label = f"{s.get('family', '?')}/{s.get('preset', '?')} routing={s.get('routing', 'skewed')}" if s else r["path"]
    print(f"{label}: {r['tokens']} tokens of {r.get('text', 'natural')} text ({r['path']})")
    print(f"  {'router':<44} {'H':>6} {'H_mm':>6} {'log2E':>6} {'top':>6} {'reuse':>6} {'rand':>5} "
          f"{'any':>5} {'rand':>5} {'first':>5} {'rand':>5}")
    for name, x in r["layers"].items():
        print(f"  {name:<44} {x['entropy_bits']:6.3f} {x['entropy_mm_bits']:6.3f} {x['max_bits']:6.3f} "
              f"{x['top_share']:6.3f} {x['reuse']:6.3f} {x['reuse_random']:5.3f} {x['any_overlap']:5.3f} "
              f"{x['any_random']:5.3f} {x['first_repeat']:5.3f} {x['first_random']:5.3f}")
    m = summary(r)
    print(f"  {'mean':<44} {m['entropy_bits']:6.3f} {m['entropy_mm_bits']:6.3f} {m['max_bits']:6.3f} "
          f"{m['top_share']:6.3f} {m['reuse']:6.3f} {m['reuse_random']:5.3f} {m['any_overlap']:5.3f} "
          f"{m['any_random']:5.3f} {m['first_repeat']:5.3f} {m['first_random']:5.3f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", type=Path)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    ap.add_argument("--layers", type=int, default=None, help="load only the first N decoder layers")
    ap.add_argument("--text", default="natural", help="natural (English passages) or random (uniform byte tokens)")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    results = []
    for p in a.paths:
        r = measure(p, a.tokens, a.seq, a.layers, a.text)
        print_report(r)
        results.append(r)
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
