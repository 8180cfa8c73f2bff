"""`zipmoe synth`: every family's tiny preset loads in transformers and runs; the bytes on disk
are what transformers loads (split and fused layouts); determinism; skew; bad input."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from zipmoe.errors import OutOfSpaceError, UsageError
from zipmoe.runtime import synth

FAMILIES = list(synth.FAMILIES)


@pytest.fixture(autouse=True)
def _threads():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _load(path: Path, family: str):
    import transformers

    cls = getattr(transformers, synth.FAMILIES[family].model_class)
    if family == "switch_transformers":
        return cls.from_pretrained(path)
    return cls.from_pretrained(path, experts_implementation="eager")


def _read_all(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():
                out[k] = sf.get_tensor(k)
    return out


_EXPERT = re.compile(r"^(.*)\.(mlp|block_sparse_moe)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")


def _model_view(model, disk_name: str) -> torch.Tensor:
    """The slice of the loaded model that a disk tensor should have become."""
    params = dict(model.named_parameters())
    m = _EXPERT.match(disk_name)
    if m:
        base, _, e, proj = m.group(1), m.group(2), int(m.group(3)), m.group(4)
        gate_up = params[f"{base}.mlp.experts.gate_up_proj"]
        half = gate_up.shape[1] // 2
        if proj in ("w1", "gate_proj"):
            return gate_up[e, :half]
        if proj in ("w3", "up_proj"):
            return gate_up[e, half:]
        return params[f"{base}.mlp.experts.down_proj"][e]
    return params[disk_name.replace(".block_sparse_moe.", ".mlp.")]


def _assert_loaded_equals_disk(model, path: Path) -> None:
    disk = _read_all(path)
    covered = 0
    for name, t in disk.items():
        got = _model_view(model, name)
        assert got.shape == t.shape, name
        assert torch.equal(got.detach(), t), f"{name}: loaded value differs from the file"
        covered += t.numel()
    assert covered == sum(p.numel() for p in model.parameters()), "some parameters were not in the files"


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_loads_runs_and_generates(tmp_path, family):
    r = synth.write(family, tmp_path / "m", progress=False)
    assert r.params > 0 and (tmp_path / "m" / "config.json").is_file()
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["zipmoe_synth"]["family"] == family
    assert 2.4 < r.entropy("per_tensor") < 2.9
    model = _load(tmp_path / "m", family)
    _assert_loaded_equals_disk(model, tmp_path / "m")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path / "m")
    ids = tok("The quick brown fox", return_tensors="pt").input_ids
    with torch.no_grad():
        if family == "switch_transformers":
            out = model(input_ids=ids, decoder_input_ids=ids[:, :3])
        else:
            out = model(input_ids=ids)
        assert torch.isfinite(out.logits).all()
        gen = model.generate(ids, max_new_tokens=4, do_sample=False, min_new_tokens=4)
    assert gen.shape[1] >= 4


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v2"])
def test_fused_layout_loads_to_same_model(tmp_path, family):
    synth.write(family, tmp_path / "s", progress=False)
    r = synth.write(family, tmp_path / "f", layout="fused", progress=False)
    names = set(_read_all(tmp_path / "f"))
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in names)
    assert not any(".experts.0." in n for n in names)
    a, b = _load(tmp_path / "s", family), _load(tmp_path / "f", family)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    assert r.nbytes == sum(p.numel() for p in b.parameters()) * 2


def test_switch_has_no_fused_layout(tmp_path):
    with pytest.raises(UsageError, match="no fused layout"):
        synth.write("switch_transformers", tmp_path / "x", layout="fused", progress=False)


def _digest(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def test_deterministic_by_seed(tmp_path):
    a = synth.write("qwen3_moe", tmp_path / "a", seed=7, progress=False)
    b = synth.write("qwen3_moe", tmp_path / "b", seed=7, progress=False)
    c = synth.write("qwen3_moe", tmp_path / "c", seed=8, progress=False)
    assert _digest(a.path) == _digest(b.path)
    assert _digest(a.path)["model.safetensors"] != _digest(c.path)["model.safetensors"]


def test_sharded_output_has_index(tmp_path):
    r = synth.write("olmoe", tmp_path / "m", max_shard_bytes=200_000, progress=False)
    index = json.loads((r.path / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in r.path.glob("*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == r.nbytes
    model = _load(r.path, "olmoe")
    _assert_loaded_equals_disk(model, r.path)


# Which experts a model's routers pick (for the skew test): every router module (``...mlp.gate`` /
# ``block_sparse_moe.gate`` / ``router.classifier``) is hooked, its input taken, and the top-k
# choice recomputed from the router weight, the same for every family whatever the module returns.
_ROUTER_MODULE = re.compile(r"\.(mlp|block_sparse_moe)\.gate$|\.router\.classifier$")


def router_modules(model) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if _ROUTER_MODULE.search(n) and hasattr(m, "weight")}


def expert_counts(model, top_k: int, run) -> dict[str, np.ndarray]:
    """Run ``run()`` (a forward pass) and count, per router, how often each expert is in a
    token's top-k. Returns {router module name: counts[num_experts]}."""
    counts: dict[str, np.ndarray] = {}
    handles = []
    for name, mod in router_modules(model).items():
        def hook(m, args, _name=name):
            x = args[0].reshape(-1, args[0].shape[-1]).float()
            logits = x @ m.weight.float().T
            idx = logits.topk(top_k, dim=-1).indices.reshape(-1)
            c = np.bincount(idx.numpy(), minlength=m.weight.shape[0])
            counts[_name] = counts.get(_name, 0) + c

        handles.append(mod.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    return counts


def popularity_stats(counts: dict[str, np.ndarray]) -> dict[str, float]:
    """Mean over routers of: the top expert's share of choices, and the normalised entropy of
    the choice distribution (1 = uniform)."""
    top, ent = [], []
    for c in counts.values():
        p = c / c.sum()
        top.append(float(p.max()))
        nz = p[p > 0]
        ent.append(float(-(nz * np.log(nz)).sum() / np.log(len(p))))
    return {"top_share": float(np.mean(top)), "entropy": float(np.mean(ent))}


def _popularity(path: Path, family: str) -> dict:
    model = _load(path, family)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 261, (4, 64), generator=g)
    k = getattr(model.config, "num_experts_per_tok", 1)
    counts = expert_counts(model, k, lambda: model(input_ids=ids))
    return popularity_stats(counts)


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v2"])
def test_skew_changes_expert_popularity(tmp_path, family):
    flat = _popularity(synth.write(family, tmp_path / "s0", skew=0.0, progress=False).path, family)
    hot = _popularity(synth.write(family, tmp_path / "s2", skew=2.0, progress=False).path, family)
    # 8 experts, top-2, 256 tokens: skew 0 is near uniform, skew 2 concentrates on a few experts.
    assert flat["entropy"] > 0.9
    assert hot["entropy"] < flat["entropy"] - 0.2
    assert hot["top_share"] > flat["top_share"] + 0.1


def test_student_t_has_heavier_tails(tmp_path):
    n = synth.write("mixtral", tmp_path / "n", progress=False)
    t = synth.write("mixtral", tmp_path / "t", dist="student-t", progress=False)
    assert t.entropy("per_tensor") > n.entropy("per_tensor")


def test_bad_input(tmp_path, monkeypatch):
    with pytest.raises(UsageError, match="mixtral.*qwen2_moe"):
        synth.write("llama", tmp_path / "x")
    with pytest.raises(UsageError, match="tiny"):
        synth.write("mixtral", tmp_path / "x", preset="huge")
    with pytest.raises(UsageError, match="bf16"):
        synth.write("mixtral", tmp_path / "x", dtype="fp8")
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("x")
    with pytest.raises(UsageError, match="--force"):
        synth.write("mixtral", full, progress=False)
    assert (full / "keep.txt").read_text() == "x"
    r = synth.write("mixtral", full, force=True, progress=False)
    assert not (full / "keep.txt").exists() and (r.path / "model.safetensors").is_file()

    import shutil
    from collections import namedtuple

    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(1 << 40, 1 << 40, 1 << 20))
    with pytest.raises(OutOfSpaceError, match=r"needs .*GiB, 1.00 MiB free"):
        synth.write("mixtral", tmp_path / "big", preset="mixtral-8x7b")
    assert not (tmp_path / "big").exists()
    assert not list(tmp_path.glob(".big*"))


def test_crash_leaves_nothing(tmp_path, monkeypatch):
    from zipmoe.runtime.synth import shards

    def boom(self, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shards.ShardWriter, "write", boom)
    with pytest.raises(OutOfSpaceError, match="disk full"):
        synth.write("mixtral", tmp_path / "m", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_presets_and_table():
    assert synth.presets("qwen2_moe")[0] == "tiny"
    assert "qwen1.5-moe-a2.7b" in synth.presets("qwen2_moe")
    rows = {(r["family"], r["preset"]): r for r in synth.preset_table("qwen2_moe")}
    assert abs(rows[("qwen2_moe", "qwen1.5-moe-a2.7b")]["params"] / 1e9 - 14.3) < 0.1


# The published config.json fields of the paper's two other models (deepseek-ai/DeepSeek-V2-Lite,
# google/switch-large-128 on the Hugging Face hub) that set a tensor's shape or the routing.
PUBLISHED = {
    ("deepseek_v2", "deepseek-v2-lite"): dict(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64,
        n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, topk_method="greedy", routed_scaling_factor=1.0,
        norm_topk_prob=False),
    ("switch_transformers", "switch-large-128"): dict(
        vocab_size=32128, d_model=1024, d_ff=4096, d_kv=64, num_heads=16, num_layers=24, num_decoder_layers=24,
        num_sparse_encoder_layers=12, num_sparse_decoder_layers=12, num_experts=128, expert_capacity=64,
        relative_attention_num_buckets=32, feed_forward_proj="relu", tie_word_embeddings=True),
}


@pytest.mark.parametrize("family,preset", sorted(PUBLISHED))
def test_paper_presets_match_the_published_configs(family, preset):
    """The presets the paper's figures are measured on have the published models' shapes: every
    field above equal, and the parameter count the model cards give (15.7 B, 26 B)."""
    fam = synth.FAMILIES[family]
    cfg = fam.config(preset)
    assert {k: getattr(cfg, k) for k in PUBLISHED[(family, preset)]} == PUBLISHED[(family, preset)]
    rows = {(r["family"], r["preset"]): r for r in synth.preset_table(family)}
    expect = {"deepseek-v2-lite": 15.7, "switch-large-128": 26.3}[preset]
    assert abs(rows[(family, preset)]["params"] / 1e9 - expect) / expect < 0.02


def test_real_size_plan_names_and_shards():
    """The plan of a real preset (nothing written): family names, shapes, <= 2 GB shards."""
    from zipmoe.runtime.synth.family import tensor_plan
    from zipmoe.runtime.synth.shards import plan_shards

    fam = synth.FAMILIES["mixtral"]
    plan = {t.name: t for t in tensor_plan(fam, fam.config("mixtral-8x7b"))}
    assert plan["model.layers.31.block_sparse_moe.experts.7.w2.weight"].shape == (4096, 14336)
    assert plan["model.layers.31.block_sparse_moe.gate.weight"].shape == (8, 4096)
    assert abs(sum(t.nbytes for t in plan.values()) / 2 - 46.70e9) < 0.01e9
    shards = plan_shards([(t.name, "BF16", t.shape, t.nbytes) for t in plan.values()])
    assert len(shards) > 40 and all(sh.nbytes <= 2_000_000_000 for sh in shards)


def test_cli_list_and_errors(tmp_path, capsys):
    from zipmoe_cli.app import main

    with pytest.raises(SystemExit) as e:
        main(["synth", "nope", "-o", str(tmp_path / "x")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown family 'nope'" in err and "switch_transformers" in err
    for argv in (["synth", "mixtral", "-o", str(tmp_path / "m"), "--seed", "3"], ["synth", "--list", "mixtral"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 0
    out = capsys.readouterr().out
    assert "exponent entropy" in out and (tmp_path / "m" / "model.safetensors").is_file()
    assert "mixtral-8x7b" in out


# Routing "natural": the Zipf exponent solved for a trained model's per-layer selection entropy.


def test_natural_skew_solves_the_idealised_entropy():
    from zipmoe.runtime.synth.family import NATURAL_ENTROPY
    from zipmoe.runtime.synth.weights import natural_skew, selection_entropy

    for experts, k in ((60, 4), (8, 2), (64, 8), (128, 1)):
        s = natural_skew(experts, k, NATURAL_ENTROPY)
        assert 0 < s < 0.5
        assert abs(selection_entropy(s, experts, k) - NATURAL_ENTROPY * np.log2(experts)) < 0.005
    assert natural_skew(60, 4, NATURAL_ENTROPY) == natural_skew(60, 4, NATURAL_ENTROPY)


def test_default_routing_by_preset(tmp_path):
    tiny = synth.write("mixtral", tmp_path / "t", progress=False)
    assert tiny.routing == "skewed" and tiny.skew == 1.0
    cfg = json.loads((tiny.path / "config.json").read_text())["zipmoe_synth"]
    assert "routing" not in cfg and cfg["skew"] == 1.0  # the tiny fixtures keep their bytes
    n = synth.write("mixtral", tmp_path / "n", routing="natural", progress=False)
    cfg = json.loads((n.path / "config.json").read_text())["zipmoe_synth"]
    assert cfg["routing"] == "natural" and 0 < cfg["skew"] < 0.5 and n.skew == cfg["skew"]
    assert abs(cfg["target_entropy_bits"] - 2.986) < 0.01
    with pytest.raises(UsageError, match="natural solves its own"):
        synth.write("mixtral", tmp_path / "x", routing="natural", skew=1.0, progress=False)
    with pytest.raises(UsageError, match="unknown routing 'bogus'"):
        synth.write("mixtral", tmp_path / "x", routing="bogus", progress=False)


def test_natural_routing_is_deterministic(tmp_path):
    a = synth.write("qwen2_moe", tmp_path / "a", routing="natural", seed=3, progress=False)
    b = synth.write("qwen2_moe", tmp_path / "b", routing="natural", seed=3, progress=False)
    assert _digest(a.path) == _digest(b.path)


def _selection_entropy_bits(path: Path, family: str) -> float:
    """Mean per-router entropy (bits) of the top-k selections over 1,024 uniform random byte
    tokens (the flat token distribution of a large vocabulary)."""
    model = _load(path, family)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 261, (4, 256), generator=g)
    k = getattr(model.config, "num_experts_per_tok", 1)
    counts = expert_counts(model, k, lambda: model(input_ids=ids))
    ent = []
    for c in counts.values():
        p = c[c > 0] / c.sum()
        ent.append(float(-(p * np.log2(p)).sum()))
    return float(np.mean(ent))


@pytest.mark.parametrize("family", ["mixtral", "olmoe"])
def test_natural_routing_entropy_near_target_and_above_skewed(tmp_path, family):
    nat = synth.write(family, tmp_path / "n", routing="natural", progress=False)
    skw = synth.write(family, tmp_path / "s", routing="skewed", progress=False)
    target = json.loads((nat.path / "config.json").read_text())["zipmoe_synth"]["target_entropy_bits"]
    h_nat = _selection_entropy_bits(nat.path, family)
    h_skw = _selection_entropy_bits(skw.path, family)
    # 8 experts, top-2: target 2.986 bits of 3. The realised entropy falls a little short of the
    # idealised router's (the hidden states share directions besides the one the bias uses;
    # docs/synth.md has the measured gaps): within 0.2 bits here, and far above skew 1.
    assert target - 0.2 < h_nat <= 3.0
    assert h_nat > h_skw + 0.25


def test_cli_routing_bogus_is_one_line(tmp_path, capsys):
    from zipmoe_cli.app import main

    with pytest.raises(SystemExit) as e:
        main(["synth", "mixtral", "-o", str(tmp_path / "x"), "--routing", "bogus"])
    assert e.value.code != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown routing 'bogus'" in err and "Traceback" not in err
    assert not (tmp_path / "x").exists()


def test_layers_keeps_the_first_layers_of_a_preset_and_refuses_what_it_cannot_cut(tmp_path, capsys):
    """`--layers N`: the preset's shapes with N decoder layers (recorded in config.json); a count
    outside 1..layers is one line and exit 2."""
    from zipmoe_cli.app import main

    r = synth.write("qwen2_moe", tmp_path / "q", preset="tiny", layout="fused", layers=1, progress=False)
    cfg = json.loads((r.path / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["zipmoe_synth"]["layers"] == 1
    with safe_open(str(next(r.path.glob("*.safetensors"))), "pt") as f:
        assert not any(".layers.1." in k for k in f.keys())
    full = json.loads((synth.write("qwen2_moe", tmp_path / "f", preset="tiny", progress=False).path / "config.json").read_text())
    for bad in ("0", str(full["num_hidden_layers"] + 1)):
        with pytest.raises(SystemExit) as exc:
            main(["synth", "qwen2_moe", "-o", str(tmp_path / f"b{bad}"), "--layers", bad])
        assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--layers must be between 1 and" in err and "Traceback" not in err


def test_layers_of_an_encoder_decoder_cut_both_sides_at_the_sparse_step(tmp_path, capsys):
    """SwitchTransformers `--layers N`: N encoder and N decoder layers, the sparse ones at the
    preset's own step (every other layer), every tensor's shape kept; a count that would move the
    sparse layers, or leave none, is one line and exit 2."""
    from zipmoe_cli.app import main

    r = synth.write("switch_transformers", tmp_path / "s", preset="small", layers=2, progress=False)
    cfg = json.loads((r.path / "config.json").read_text())
    assert (cfg["num_layers"], cfg["num_decoder_layers"]) == (2, 2) and cfg["zipmoe_synth"]["layers"] == 2
    assert (cfg["num_sparse_encoder_layers"], cfg["num_sparse_decoder_layers"]) == (1, 1)
    assert (cfg["encoder_sparse_step"], cfg["decoder_sparse_step"]) == (2, 2)
    full = synth.write("switch_transformers", tmp_path / "f", preset="small", progress=False).path
    with safe_open(str(next(r.path.glob("*.safetensors"))), "pt") as f, \
            safe_open(str(next(full.glob("*.safetensors"))), "pt") as g:
        names = set(f.keys())
        assert names < set(g.keys())  # the first layers of each side, with the full model's names and shapes
        assert not any(".block.2." in k for k in names) and any(".block.1.layer.1.mlp.experts." in k for k in names)
        assert all(f.get_slice(k).get_shape() == g.get_slice(k).get_shape() for k in names)
    for bad, line in (("1", "--layers must be between 2"), ("3", "give a multiple of 2")):
        with pytest.raises(SystemExit) as exc:
            main(["synth", "switch_transformers", "--preset", "small", "-o", str(tmp_path / f"b{bad}"), "--layers", bad])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert line in err and "Traceback" not in err
