"""`zipmoe pack / verify / unpack` through the CLI entry point (in process: same code path as the
console script, errors as one line on stderr)."""

from __future__ import annotations

import errno
import json
import os
import struct

import pytest
import torch
from safetensors.torch import load_file

from test_container_helpers import rewrite_index, write_dense, write_fused, write_mixtral
from zipmoe.codecs.reader import ContainerReader
from zipmoe_cli.app import main


def run(capsys, *args) -> tuple[int, str, str]:
    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    assert code != 0
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("zipmoe: error: ") and "Traceback" not in err
    for n in needles:
        assert n in lines[0], lines[0]


def same_tensors(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and torch.equal(a[k].contiguous().view(torch.uint8), b[k].contiguous().view(torch.uint8)) for k in a)


def load_folder(d) -> dict:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("writer,codec", [(write_mixtral, "zstd"), (write_fused, "lz4"), (write_mixtral, "lz4hc")])
def test_pack_verify_unpack_round_trip(tmp_path, capsys, writer, codec):
    src = writer(tmp_path / "src")
    code, out, err = run(capsys, "pack", tmp_path / "src", "-o", tmp_path / "m.zmoe", "--codec", codec,
                         "--shard-size", "4K", "--workers", "2")
    assert code == 0, err
    assert "bound" in out and "bf16 tensors" in out and "expert tensors" in out
    code, out, err = run(capsys, "verify", tmp_path / "m.zmoe", "--against", tmp_path / "src")
    assert code == 0, err
    assert out.startswith("OK") and "identical to" in out
    code, out, err = run(capsys, "unpack", tmp_path / "m.zmoe", "-o", tmp_path / "out")
    assert code == 0, err
    assert same_tensors(load_folder(tmp_path / "out"), src)
    for name in os.listdir(tmp_path / "src"):
        if not name.endswith(".safetensors") and name != "model.safetensors.index.json":
            assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "src" / name).read_bytes()


def test_unpack_shards_with_an_index(tmp_path, capsys):
    from zipmoe.codecs.safetensors_out import unpack

    src = write_mixtral(tmp_path / "src")
    assert run(capsys, "pack", tmp_path / "src", "-o", tmp_path / "m.zmoe")[0] == 0
    unpack(tmp_path / "m.zmoe", tmp_path / "out", max_shard_bytes=8000)
    idx = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    shards = sorted(set(idx["weight_map"].values()))
    assert len(shards) > 1 and set(idx["weight_map"]) == set(src)
    assert same_tensors(load_folder(tmp_path / "out"), src)
    # the restored folder packs again to the same tensors
    assert run(capsys, "pack", tmp_path / "out", "-o", tmp_path / "again.zmoe")[0] == 0
    assert run(capsys, "verify", tmp_path / "again.zmoe", "--against", tmp_path / "src")[0] == 0


def test_unpacked_folder_loads_in_transformers_like_the_source(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg).to(torch.bfloat16).eval()
    model.save_pretrained(tmp_path / "src")
    assert run(capsys, "pack", tmp_path / "src", "-o", tmp_path / "m.zmoe")[0] == 0
    assert run(capsys, "unpack", tmp_path / "m.zmoe", "-o", tmp_path / "out")[0] == 0
    a = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "src", dtype=torch.bfloat16).eval()
    b = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.bfloat16).eval()
    sa, sb = a.state_dict(), b.state_dict()
    assert same_tensors(sa, sb)
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)


# ------------------------------------------------------------------ refusals and bad input


def test_pack_refuses_overwrite_and_unpack_refuses_non_empty(tmp_path, capsys):
    write_dense(tmp_path / "d")
    (tmp_path / "x.zmoe").write_bytes(b"mine")
    code, _, err = run(capsys, "pack", tmp_path / "d", "-o", tmp_path / "x.zmoe")
    assert_one_line_error(code, err, "already exists", "--force")
    assert (tmp_path / "x.zmoe").read_bytes() == b"mine"
    assert run(capsys, "pack", tmp_path / "d", "-o", tmp_path / "x.zmoe", "--force")[0] == 0
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "notes.txt").write_text("keep")
    code, _, err = run(capsys, "unpack", tmp_path / "x.zmoe", "-o", tmp_path / "o")
    assert_one_line_error(code, err, "not empty", "--force")
    assert run(capsys, "unpack", tmp_path / "x.zmoe", "-o", tmp_path / "o", "--force")[0] == 0
    assert (tmp_path / "o" / "notes.txt").read_text() == "keep"
    assert (tmp_path / "o" / "model.safetensors").exists()


def test_non_moe_model_packs_and_says_so(tmp_path, capsys):
    write_dense(tmp_path / "d")
    code, out, err = run(capsys, "pack", tmp_path / "d", "-o", tmp_path / "d.zmoe")
    assert code == 0
    assert "no expert tensors found: packed as a dense model" in err + out


@pytest.mark.parametrize("case", ["missing", "empty", "bin_only", "corrupt_header"])
def test_bad_sources(tmp_path, capsys, case):
    src = tmp_path / "src"
    if case != "missing":
        src.mkdir()
        (src / "config.json").write_text("{}")
    if case == "bin_only":
        (src / "pytorch_model.bin").write_bytes(b"\0" * 10)
    if case == "corrupt_header":
        (src / "model.safetensors").write_bytes(struct.pack("<Q", 20) + b"{not json at all!!!}")
    code, _, err = run(capsys, "pack", src, "-o", tmp_path / "o.zmoe")
    needle = {"missing": "no such file", "empty": "no .safetensors", "bin_only": ".bin",
              "corrupt_header": "corrupt safetensors header"}[case]
    assert_one_line_error(code, err, needle)
    assert not (tmp_path / "o.zmoe").exists()


def test_bad_options(tmp_path, capsys):
    write_dense(tmp_path / "d")
    code, _, err = run(capsys, "pack", tmp_path / "d", "-o", tmp_path / "o.zmoe", "--codec", "brotli")
    assert code == 2 and "unknown codec 'brotli'" in err
    code, _, err = run(capsys, "pack", tmp_path / "d", "-o", tmp_path / "o.zmoe", "--shard-size", "lots")
    assert code == 2 and "cannot read size" in err


@pytest.fixture
def packed(tmp_path, capsys):
    write_mixtral(tmp_path / "src")
    assert run(capsys, "pack", tmp_path / "src", "-o", tmp_path / "m.zmoe", "--shard-size", "4K")[0] == 0
    return tmp_path / "m.zmoe"


def _reheader(data: bytes, major: int = 1, index_fn=None) -> bytes:
    return rewrite_index(data, index_fn, major=major)


def _brot(doc: dict) -> None:
    """Give the first zstd chunk the unknown codec id "brot"."""
    c = next(c for e in doc["tensors"] for c in e["chunks"] if c["codec"] == "zstd")
    c["codec"] = "brot"


@pytest.mark.parametrize("damage", ["truncated", "chunk_flip", "index_flip", "magic", "future", "codec", "missing"])
def test_bad_containers(packed, capsys, damage):
    data = packed.read_bytes()
    with ContainerReader(packed) as r:
        e = r.entries[3]
        c = e.chunks[-1]
    bad = packed.with_name("bad.zmoe")
    if damage == "truncated":
        bad.write_bytes(data[: len(data) - 100])
    elif damage == "chunk_flip":
        b = bytearray(data)
        b[c.offset + 3] ^= 1
        bad.write_bytes(bytes(b))
    elif damage == "index_flip":
        b = bytearray(data)
        b[-10] ^= 4
        bad.write_bytes(bytes(b))
    elif damage == "magic":
        bad.write_bytes(b"PK\x03\x04" + data[4:])
    elif damage == "future":
        bad.write_bytes(_reheader(data, major=3))
    elif damage == "codec":
        bad.write_bytes(_reheader(data, index_fn=_brot))
    needle = {"truncated": "truncated", "chunk_flip": f"tensor {e.name} chunk {len(e.chunks) - 1} (sm): checksum mismatch",
              "index_flip": "index checksum mismatch", "magic": "not a .zmoe file",
              "future": "newer zipmoe", "codec": "unknown codec 'brot'", "missing": "no such file"}[damage]
    for cmd in (["verify", bad], ["unpack", bad, "-o", packed.parent / "unpacked"]):
        code, _, err = run(capsys, *cmd)
        assert_one_line_error(code, err, needle)
    assert not (packed.parent / "unpacked").exists()
    assert not [p for p in os.listdir(packed.parent) if "zipmoe-unpack" in p]


def test_verify_against_a_different_source(packed, tmp_path, capsys):
    write_mixtral(tmp_path / "other", seed=9)
    code, _, err = run(capsys, "verify", packed, "--against", tmp_path / "other")
    assert_one_line_error(code, err, "differs from the source")


def test_no_space_left_through_the_cli(tmp_path, capsys, monkeypatch):
    write_mixtral(tmp_path / "src")
    (tmp_path / "out").mkdir()
    real, calls = os.write, {"n": 0}

    def full_disk(fd, data):
        calls["n"] += 1
        if calls["n"] > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(os, "write", full_disk)
    code, _, err = run(capsys, "pack", tmp_path / "src", "-o", tmp_path / "out" / "m.zmoe", "--workers", "1")
    monkeypatch.setattr(os, "write", real)
    assert_one_line_error(code, err, "no space left")
    assert os.listdir(tmp_path / "out") == []


def test_no_space_left_during_unpack_leaves_nothing(packed, capsys, monkeypatch):
    import builtins

    from zipmoe.codecs import safetensors_out

    class FullDisk:
        def __init__(self, f):
            self._f = f

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name):
            return getattr(self._f, name)

    def fake_open(path, mode="r", *a, **k):
        f = builtins.open(path, mode, *a, **k)
        return FullDisk(f) if "w" in mode else f

    monkeypatch.setattr(safetensors_out, "open", fake_open, raising=False)
    code, _, err = run(capsys, "unpack", packed, "-o", packed.parent / "restored")
    assert_one_line_error(code, err, "no space left")
    assert not (packed.parent / "restored").exists()
    assert not [p for p in os.listdir(packed.parent) if "zipmoe-unpack" in p]


def _dead_pid() -> int:
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_leftovers_of_a_killed_pack_or_unpack_are_removed_next_time(tmp_path, capsys):
    """SIGKILL leaves pack's hidden .tmp file (or unpack's folder); the next run for the same
    output removes those whose process is gone, and only those."""
    from zipmoe.codecs.tempfiles import host_tag, pack_temp

    write_mixtral(tmp_path / "src")
    dead, alive, here = _dead_pid(), os.getpid(), host_tag()
    assert pack_temp(tmp_path / "m.zmoe").name.startswith(f".m.zmoe.{alive}.{here}.")
    stale = tmp_path / f".m.zmoe.{dead}.{here}.0123abcd.tmp"
    stale.write_bytes(bytes(4096))  # header placeholder: zeros, as a killed pack leaves it
    running = tmp_path / f".m.zmoe.{alive}.{here}.89abcdef.tmp"  # a pack still going: kept
    running.write_bytes(bytes(4096))
    foreign = tmp_path / f".m.zmoe.{dead}.{here}.deadbeef.tmp"  # not written by pack (has bytes): kept
    foreign.write_bytes(b"ZMOE\x01" + bytes(100))
    other = tmp_path / f".n.zmoe.{dead}.{here}.0123abcd.tmp"  # another output's: kept
    other.write_bytes(bytes(10))
    # another machine's or container's pack into the same (shared) folder: its pid means
    # nothing here, so it is kept even though no such process runs here; likewise the older
    # name format, which does not say where its process ran
    elsewhere = "0" * 8 if here != "0" * 8 else "1" * 8
    remote = tmp_path / f".m.zmoe.{dead}.{elsewhere}.0123abcd.tmp"
    remote.write_bytes(bytes(4096))
    legacy = tmp_path / f".m.zmoe.{dead}.0123abcd.tmp"
    legacy.write_bytes(bytes(4096))
    code, out, err = run(capsys, "pack", tmp_path / "src", "-o", tmp_path / "m.zmoe")
    assert code == 0, err
    assert not stale.exists() and running.exists() and foreign.exists() and other.exists()
    assert remote.exists() and legacy.exists()
    assert f"removed 1 leftover temporary file(s) of an interrupted pack: {stale.name}" in " ".join(out.split())
    left = tmp_path / f".out.zipmoe-unpack-{dead}-{here}-0123abcd"
    (left / "sub").mkdir(parents=True)
    (left / "model-00001.safetensors").write_bytes(b"x")
    remote_dir = tmp_path / f".out.zipmoe-unpack-{dead}-{elsewhere}-0123abcd"
    remote_dir.mkdir()
    code, out, err = run(capsys, "unpack", tmp_path / "m.zmoe", "-o", tmp_path / "out")
    assert code == 0, err
    assert not left.exists() and (tmp_path / "out").is_dir()
    assert [p for p in os.listdir(tmp_path) if "zipmoe-unpack" in p] == [remote_dir.name]


def test_stale_removal_skips_names_whose_pid_is_out_of_range(tmp_path):
    """A name that looks like a leftover but whose number is no possible pid (os.kill raises
    OverflowError) is not one of ours: kept, and the pack does not fail on it."""
    from zipmoe.codecs.tempfiles import host_tag, remove_stale

    odd = tmp_path / f".m.zmoe.99999999999999999999.{host_tag()}.0123abcd.tmp"
    odd.write_bytes(bytes(4096))
    assert remove_stale(tmp_path, "m.zmoe") == []
    assert odd.exists()
