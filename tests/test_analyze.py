"""zipmoe.codecs.entropy and `zipmoe analyze` (through the console entry point)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from zipmoe.codecs.checkpoint import open_checkpoint
from zipmoe.codecs.entropy import (analyze, bound_fraction, entropy_bits, field_entropy,
                                   tensor_histogram)
from zipmoe_cli.app import main


def _h(x: np.ndarray) -> float:
    _, c = np.unique(x, return_counts=True)
    p = c / c.sum()
    return float(-(p * np.log2(p)).sum())


def _u16(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().reshape(-1).view(np.uint16)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe")
    g = torch.Generator().manual_seed(0)
    ts = {}
    for L in range(2):
        for e in range(3):
            for p in ("w1", "w2", "w3"):
                ts[f"model.layers.{L}.block_sparse_moe.experts.{e}.{p}.weight"] = (torch.randn(32, 48, generator=g) * 0.02).bfloat16()
        ts[f"model.layers.{L}.block_sparse_moe.gate.weight"] = torch.randn(3, 48, generator=g)
    ts["model.layers.2.mlp.experts.gate_up_proj"] = (torch.randn(3, 16, 48, generator=g) * 0.03).bfloat16()
    ts["model.embed_tokens.weight"] = torch.randn(50, 48, generator=g).bfloat16()
    ts["model.norm.weight"] = torch.ones(48, dtype=torch.bfloat16)
    ts["empty"] = torch.zeros(0, dtype=torch.bfloat16)
    save_file(ts, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"model_type": "mixtral", "num_local_experts": 3}))
    return d, ts


def _run(capsys, *args):
    with pytest.raises(SystemExit) as e:
        main(list(args))
    out = capsys.readouterr()
    return e.value.code or 0, out.out, out.err


def test_entropy_helpers():
    assert entropy_bits(np.array([1, 1, 1, 1])) == pytest.approx(2.0)
    assert entropy_bits(np.array([5, 0, 0])) == 0.0
    assert entropy_bits(np.zeros(3)) == 0.0
    assert bound_fraction(2.5) == pytest.approx(10.5 / 16)
    u = np.random.default_rng(1).integers(0, 1 << 16, 100_000, dtype=np.uint16)
    hist = np.bincount(u, minlength=65536)
    fe = field_entropy(hist)
    assert fe.n == u.size
    assert fe.sign_bits == pytest.approx(_h(u >> 15))
    assert fe.exp_bits == pytest.approx(_h((u >> 7) & 0xFF))
    assert fe.mant_bits == pytest.approx(_h(u & 0x7F))
    assert fe.sm_bits == pytest.approx(_h(((u >> 8) & 0x80) | (u & 0x7F)))


def test_streamed_histogram_matches(model):
    d, ts = model
    with open_checkpoint(d) as ck:
        t = ck.tensor("model.embed_tokens.weight")
        ref = np.bincount(_u16(ts[t.name]), minlength=65536)
        assert np.array_equal(tensor_histogram(ck, t), ref)
        assert np.array_equal(tensor_histogram(ck, t, chunk_elements=333), ref)  # many odd chunks


def test_analyze_api(model):
    d, ts = model
    res = analyze(d)
    by = {r.name: r for r in res.tensors}
    assert len(by) == len(ts)
    r = by["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    assert (r.role, r.layer, r.expert, r.proj) == ("expert", 1, 2, "up")
    u = _u16(ts[r.name])
    assert r.entropy.exp_bits == pytest.approx(_h((u >> 7) & 0xFF))
    assert r.entropy.bound == pytest.approx((8 + _h((u >> 7) & 0xFF)) / 16)
    assert by["model.layers.0.block_sparse_moe.gate.weight"].entropy is None  # F32
    assert by["empty"].entropy is None
    assert by["model.layers.2.mlp.experts.gate_up_proj"].fused
    # totals: size-weighted per-tensor bound
    bf = [r for r in res.tensors if r.entropy is not None]
    n = sum(r.entropy.n for r in bf)
    want = sum(r.entropy.n * (8 + r.entropy.exp_bits) for r in bf) / (16 * n)
    assert res.total.bound == pytest.approx(want)
    assert res.by_role["other"].tensors == 2  # the two F32 routers
    assert res.total.tensors == len(ts)


def test_threads_give_the_same_result(model):
    d, _ = model
    one = analyze(d, workers=1).to_dict()
    two = analyze(d, workers=2, chunk_elements=1000).to_dict()
    one.pop("seconds"), two.pop("seconds")
    assert one == two


def test_cli_json(model, capsys):
    d, ts = model
    code, out, err = _run(capsys, "analyze", str(d), "--json")
    assert code == 0, err
    doc = json.loads(out)
    names = [t["name"] for t in doc["tensors"]]
    assert sorted(names) == sorted(ts)
    for t in doc["tensors"]:
        for k in ("name", "dtype", "shape", "role", "layer", "expert", "exp_entropy_bits"):
            assert k in t
        if t["dtype"] != "BF16" or not t["nbytes"]:
            assert t["exp_entropy_bits"] is None and t["bound"] is None
        else:
            assert 0 <= t["exp_entropy_bits"] <= 8
    tot = doc["total"]
    assert tot["tensors"] == len(ts) and 0.5 < tot["bound"] < 1.0
    assert set(doc["by_role"]) == {"expert", "dense", "other"}


def test_cli_measure(model, capsys):
    d, _ = model
    code, out, err = _run(capsys, "analyze", str(d), "--json", "--measure", "--codec", "zstd-fast,lz4")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["measured_codecs"] == ["zstd-fast", "lz4"]
    t = next(t for t in doc["tensors"] if t["name"] == "model.embed_tokens.weight")
    m = t["codecs"]["zstd-fast"]
    assert m["stored_bytes"] >= t["nbytes"] // 2  # the raw SM half at least
    assert m["ratio"] >= t["bound"] - 0.01
    assert m["decode_gbps"] > 0
    assert set(doc["total"]["codecs"]) == {"zstd-fast", "lz4"}
    for t in doc["tensors"]:
        if t["dtype"] != "BF16":
            assert "codecs" not in t


def test_cli_tables(model, capsys):
    d, _ = model
    code, out, err = _run(capsys, "analyze", str(d))
    assert code == 0, err
    assert "expert (bf16)" in out and "non-bf16" in out
    assert "model.layers.1.block_sparse_moe.experts.2.w3.weight" in out
    assert out.strip().splitlines()[-1].startswith("bound (8 + H(exp))/16 per tensor")
    code, out, err = _run(capsys, "analyze", str(d / "model.safetensors"), "--measure", "--codec", "lz4")
    assert code == 0, err
    assert "lz4" in out and "over the bound" in out


def test_cli_summary_for_many_tensors(tmp_path, capsys):
    ts = {f"model.layers.{i}.mlp.experts.{e}.up_proj.weight": torch.full((4, 4), float(i + e + 1)).bfloat16()
          for i in range(10) for e in range(5)}
    ts["big"] = torch.randn(64, 64).bfloat16()
    save_file(ts, str(tmp_path / "m.safetensors"))
    code, out, _ = _run(capsys, "analyze", str(tmp_path / "m.safetensors"), "--top", "3")
    assert code == 0
    assert "largest 3 of 51 tensors" in out and "big" in out
    code, out, _ = _run(capsys, "analyze", str(tmp_path / "m.safetensors"), "--all")
    assert "51 tensors" in out and "model.layers.9.mlp.experts.4.up_proj.weight" in out


@pytest.mark.parametrize("setup,needle", [
    ("missing", "no such file"),
    ("bin", "only PyTorch .bin weights found"),
    ("corrupt", "corrupt safetensors header"),
    ("empty_dir", "no .safetensors"),
])
def test_cli_errors(tmp_path, capsys, setup, needle):
    p = tmp_path / "x"
    if setup == "bin":
        p.mkdir()
        (p / "pytorch_model.bin").write_bytes(b"0")
    elif setup == "corrupt":
        p = tmp_path / "x.safetensors"
        p.write_bytes(b"\x10\0\0\0\0\0\0\0{bad json at all}")
    elif setup == "empty_dir":
        p.mkdir()
    code, out, err = _run(capsys, "analyze", str(p))
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zipmoe: error:") and needle in lines[0]
    assert "Traceback" not in err


def test_cli_usage_errors(model, capsys):
    d, _ = model
    code, _, err = _run(capsys, "analyze", str(d), "--codec", "nope")
    assert code == 2 and "unknown codec" in err
    code, _, err = _run(capsys, "analyze", str(d), "--shard-size", "1K", "--measure")
    assert code == 2 and "shard-size" in err
