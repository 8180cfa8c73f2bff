"""zipmoe.codecs.checkpoint: HF folders and .safetensors files, read by pread, clear errors."""

from __future__ import annotations

import json
import struct
import threading

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file as np_save
from safetensors.torch import save_file as torch_save

from zipmoe.codecs.checkpoint import open_checkpoint, read_safetensors_header
from zipmoe.errors import CheckpointError


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(16, 8, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.experts.0.gate_proj.weight": torch.randn(4, 8, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.experts.1.gate_proj.weight": torch.randn(4, 8, generator=g).to(torch.bfloat16),
        "model.layers.0.input_layernorm.weight": torch.randn(8, generator=g),
        "model.layers.0.mlp.gate.weight": torch.randn(2, 8, generator=g),
        "buf": torch.arange(5, dtype=torch.int64),
        "empty": torch.zeros(0, 3, dtype=torch.bfloat16),
    }


def _as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _folder(tmp_path, sharded: bool):
    d = tmp_path / ("sharded" if sharded else "single")
    d.mkdir()
    ts = _tensors()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2_moe", "num_experts": 2}))
    (d / "tokenizer.json").write_text("{}")
    (d / "generation_config.json").write_text("{}")
    (d / "chat_template.jinja").write_text("{{ x }}")
    (d / "README.md").write_text("not an extra file")
    if not sharded:
        torch_save(ts, str(d / "model.safetensors"))
    else:
        names = list(ts)
        a, b = names[:3], names[3:]
        torch_save({k: ts[k] for k in a}, str(d / "model-00001-of-00002.safetensors"))
        torch_save({k: ts[k] for k in b}, str(d / "model-00002-of-00002.safetensors"))
        wm = {k: "model-00001-of-00002.safetensors" for k in a} | {k: "model-00002-of-00002.safetensors" for k in b}
        (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return d, ts


@pytest.mark.parametrize("sharded", [False, True])
def test_folder_roundtrip(tmp_path, sharded):
    d, ts = _folder(tmp_path, sharded)
    with open_checkpoint(d) as ck:
        assert {t.name for t in ck.tensors} == set(ts)
        assert ck.config["model_type"] == "qwen2_moe"
        assert set(ck.extra_files) == {"config.json", "tokenizer.json", "generation_config.json", "chat_template.jinja"}
        assert ck.total_bytes == sum(len(_as_bytes(v)) for v in ts.values())
        assert len(ck.files) == (2 if sharded else 1)
        # file order: within a file, by offset
        for f in ck.files:
            offs = [t.offset for t in ck.tensors if t.file == f]
            assert offs == sorted(offs)
        for t in ck.tensors:
            ref = ts[t.name]
            assert t.shape == tuple(ref.shape)
            assert t.dtype == {torch.bfloat16: "BF16", torch.float32: "F32", torch.int64: "I64"}[ref.dtype]
            got = ck.read(t)
            assert got.dtype == np.uint8 and got.ndim == 1
            assert got.tobytes() == _as_bytes(ref)
        # partial reads and read-into
        t = ck.tensor("model.embed_tokens.weight")
        full = ck.read(t)
        assert ck.read(t, 10, 20).tobytes() == full[10:30].tobytes()
        out = np.empty(t.nbytes, np.uint8)
        assert ck.read(t.name, out=out) is out and out.tobytes() == full.tobytes()
        with pytest.raises(ValueError):
            ck.read(t, t.nbytes - 1, 2)


def test_single_file_and_threads(tmp_path):
    ts = _tensors()
    f = tmp_path / "w.safetensors"
    torch_save(ts, str(f))
    ck = open_checkpoint(f)
    assert ck.config is None and ck.extra_files == {}
    errs = []

    def work():
        try:
            for _ in range(20):
                for t in ck.tensors:
                    assert ck.read(t).tobytes() == _as_bytes(ts[t.name])
        except Exception as e:  # pragma: no cover
            errs.append(e)

    th = [threading.Thread(target=work) for _ in range(4)]
    [x.start() for x in th]
    [x.join() for x in th]
    assert not errs
    ck.close()


def test_numpy_saved_file(tmp_path):
    f = tmp_path / "n.safetensors"
    np_save({"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.arange(3, dtype=np.uint16)}, str(f))
    ts, meta = read_safetensors_header(f)
    assert [(t.name, t.dtype, t.shape) for t in ts] == [("a", "F32", (2, 3)), ("b", "U16", (3,))]


def _msg(exc_info) -> str:
    m = str(exc_info.value)
    assert "\n" not in m
    return m


def test_missing_path(tmp_path):
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(tmp_path / "nope")
    assert "no such file" in _msg(e)


def test_folder_without_safetensors(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(tmp_path)
    assert "no .safetensors" in _msg(e)


def test_bin_only(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(tmp_path)
    m = _msg(e)
    assert "only PyTorch .bin weights found" in m and "convert to safetensors" in m
    with pytest.raises(CheckpointError, match="only PyTorch .bin"):
        open_checkpoint(tmp_path / "pytorch_model.bin")


def test_not_safetensors_file(tmp_path):
    f = tmp_path / "x.txt"
    f.write_text("hi")
    with pytest.raises(CheckpointError, match="not a .safetensors"):
        open_checkpoint(f)


def _write_raw(path, header: object, data: bytes = b"", hlen: int | None = None):
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h) if hlen is None else hlen) + h + data)


@pytest.mark.parametrize(
    "header,data,hlen,why",
    [
        (b"", b"", None, "header length"),
        (b"{not json", b"", None, "invalid JSON"),
        ([1, 2], b"", None, "not a JSON object"),
        ({"a": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}}, b"", None, "past the end"),
        ({"a": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 4]}}, b"\0" * 4, None, "bytes for a BF16"),
        ({"a": {"dtype": "Q9", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4, None, "unsupported dtype"),
        ({"a": {"dtype": "BF16", "shape": [-2], "data_offsets": [0, 4]}}, b"\0" * 4, None, "bad shape"),
        ({"a": {"dtype": "BF16", "shape": [2], "data_offsets": [4, 0]}}, b"\0" * 4, None, "bad data_offsets"),
        ({"a": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]},
          "b": {"dtype": "BF16", "shape": [2], "data_offsets": [2, 6]}}, b"\0" * 6, None, "overlaps"),
        ({"a": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4, 10**9, "header length"),
    ],
)
def test_corrupt_header(tmp_path, header, data, hlen, why):
    f = tmp_path / "bad.safetensors"
    _write_raw(f, header, data, hlen)
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(f)
    m = _msg(e)
    assert why in m and "bad.safetensors" in m


def test_too_short_file(tmp_path):
    f = tmp_path / "short.safetensors"
    f.write_bytes(b"\1\2")
    with pytest.raises(CheckpointError, match="short.safetensors.*too short"):
        open_checkpoint(f)


def test_corrupt_shard_named_in_folder(tmp_path):
    d, _ = _folder(tmp_path, sharded=True)
    (d / "model-00002-of-00002.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        open_checkpoint(d)


def test_index_names_missing_shard(tmp_path):
    d, _ = _folder(tmp_path, sharded=True)
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(d)
    assert "model-00002-of-00002.safetensors which is missing" in _msg(e)


def test_index_lists_absent_tensor(tmp_path):
    d, _ = _folder(tmp_path, sharded=True)
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    idx["weight_map"]["ghost"] = "model-00001-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match="ghost"):
        open_checkpoint(d)


def test_truncated_after_open(tmp_path):
    f = tmp_path / "t.safetensors"
    torch_save({"a": torch.ones(1000, dtype=torch.bfloat16)}, str(f))
    ck = open_checkpoint(f)
    size = f.stat().st_size
    with open(f, "r+b") as fh:
        fh.truncate(size - 100)
    with pytest.raises(CheckpointError, match="truncated"):
        ck.read("a")
    ck.close()


def test_duplicate_names_across_files(tmp_path):
    torch_save({"a": torch.ones(2)}, str(tmp_path / "x1.safetensors"))
    torch_save({"a": torch.ones(2)}, str(tmp_path / "x2.safetensors"))
    with pytest.raises(CheckpointError, match="also appears"):
        open_checkpoint(tmp_path)


def test_consolidated_skipped(tmp_path):
    torch_save({"a": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    torch_save({"a": torch.ones(2)}, str(tmp_path / "consolidated.safetensors"))
    ck = open_checkpoint(tmp_path)
    assert [f.name for f in ck.files] == ["model.safetensors"]
