"""The llama.cpp baseline's GGUF, written by llama.cpp's own convert_hf_to_gguf.py: every family
zipmoe synthesises converts bit for bit (per-expert and fused layouts), the converter is found or
fetched, and every failure is one line."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch

from llamacpp_fixture import converter_folder, gguf_module
from zipmoe.codecs.naming import classify
from zipmoe.runtime.bench import llamacpp_convert as lc

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2")
#: GGUF tensors that are a rearrangement of checkpoint tensors, not a copy: llama's rotary q/k row
#: order, DeepSeek-V2's kv_b_proj split into k_b and v_b.
REARRANGED = {"llama": ("attn_q.weight", "attn_k.weight"), "deepseek2": ("attn_k_b.weight", "attn_v_b.weight")}


@pytest.fixture(scope="module")
def converter(tmp_path_factory):
    return converter_folder(tmp_path_factory)


@pytest.fixture(scope="module")
def synth_dir(tmp_path_factory):
    from zipmoe.runtime import synth

    root = tmp_path_factory.mktemp("llamacpp-synth")

    def get(family: str, layout: str = "split") -> Path:
        d = root / f"{family}-{layout}"
        if not d.exists():
            synth.write(family, d, preset="tiny", seed=0, layout=layout, force=True, progress=False)
        return d

    return get


@pytest.fixture(scope="module")
def converted(converter, synth_dir, tmp_path_factory):
    """The GGUF of each (family, layout), converted once per module."""
    out_root = tmp_path_factory.mktemp("llamacpp-gguf")
    done: dict = {}

    def get(family: str, layout: str = "split") -> Path:
        if (family, layout) not in done:
            done[family, layout] = lc.convert(synth_dir(family, layout), out_root / f"{family}-{layout}.gguf", converter)
        return done[family, layout]

    return get


def _field(reader, key):
    f = reader.fields[key]
    v = f.parts[f.data[0]]
    return bytes(v).decode() if f.types and f.types[0].name == "STRING" else v.tolist()[0]


def _bits(t) -> np.ndarray:
    """A GGUF tensor as bf16 bits (uint16) in the checkpoint's orientation; float32 must be exact bf16."""
    shape = [int(x) for x in reversed(list(t.shape))]
    if t.tensor_type.name == "BF16":
        return np.ascontiguousarray(t.data).view(np.uint16).reshape(shape)
    assert t.tensor_type.name == "F32", (t.name, t.tensor_type.name)
    u = np.ascontiguousarray(t.data, dtype=np.float32).view(np.uint32).reshape(shape)
    assert not (u & 0xFFFF).any(), f"{t.name}: float32 values that are not bf16 values"  # the widening is exact
    return (u >> 16).astype(np.uint16)


def _checkpoint(src: Path) -> dict[str, np.ndarray]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            assert t.dtype == torch.bfloat16, name
            out[name] = t.view(torch.int16).numpy().view(np.uint16)
    return out


def _key(a: np.ndarray) -> tuple:
    return a.shape, hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def _check_bit_exact(family: str, src: Path, gguf_path: Path, gguf) -> None:
    config = json.loads((src / "config.json").read_text())
    ck = _checkpoint(src)
    r = gguf.GGUFReader(str(gguf_path))
    arch = _field(r, "general.architecture")
    assert arch == lc.ARCH[family]
    n_exp = config.get("num_local_experts") or config.get("num_experts") or config.get("n_routed_experts")
    assert _field(r, f"{arch}.expert_count") == n_exp
    assert _field(r, "general.file_type") == gguf.LlamaFileType.MOSTLY_BF16
    if family == "deepseek_v2":  # null in the checkpoint, 0 in the view (test_the_view_gives_a_small_deepseek_q_lora_rank_0)
        assert _field(r, "deepseek2.attention.q_lora_rank") == 0
    # tensor count: the per-expert tensors of a layer become 3 stacked ones; DeepSeek-V2's kv_b_proj two
    roles = [classify(n, a.shape, config) for n, a in ck.items()]
    experts = [x for x in roles if x.role == "expert"]
    moe_layers = {x.layer for x in experts}
    extra = config["num_hidden_layers"] if family == "deepseek_v2" else 0
    assert len(r.tensors) == len(ck) - len(experts) + 3 * len(moe_layers) + extra
    # every tensor bf16 (norms, biases and routers float32, exactly), every checkpoint byte once
    by_key = defaultdict(list)
    for name, a in ck.items():
        by_key[_key(a)].append(name)
    used, rearranged = set(), []
    for t in r.tensors:
        a = _bits(t)
        f32 = a.ndim == 1 or ".ffn_gate_inp" in t.name
        assert t.tensor_type.name == ("F32" if f32 else "BF16"), (t.name, t.tensor_type.name)
        pieces = list(a) if t.name.endswith("_exps.weight") else [a]
        if t.name.endswith("_exps.weight"):
            assert a.shape[0] == n_exp, t.name
        for p in pieces:
            match = [n for n in by_key.get(_key(p), []) if n not in used]
            if match:
                used.add(match[0])
            else:
                rearranged.append((t.name, p))
    assert {n.split(".", 2)[-1] for n, _ in rearranged} <= set(REARRANGED.get(arch, ())), [n for n, _ in rearranged]
    left = [n for n in ck if n not in used]
    assert np.array_equal(np.sort(np.concatenate([ck[n].ravel() for n in left] or [np.zeros(0, np.uint16)])),
                          np.sort(np.concatenate([p.ravel() for _, p in rearranged] or [np.zeros(0, np.uint16)]))), left
    # a few experts by name: blk.L.ffn_{gate,up,down}_exps[e] is experts.e's projection, byte for byte
    from zipmoe.runtime.synth.registry import FAMILIES as SYNTH

    fam = SYNTH[family]
    t = {x.name: x for x in r.tensors}
    L = max(moe_layers)
    for e in (0, n_exp - 1):
        for proj in ("gate", "up", "down"):
            hf = f"model.layers.{L}.{fam.moe_module}.experts.{e}.{fam.expert_projs[proj]}.weight"
            assert np.array_equal(_bits(t[f"blk.{L}.ffn_{proj}_exps.weight"])[e], ck[hf]), hf
    assert np.array_equal(_bits(t["token_embd.weight"]), ck["model.embed_tokens.weight"])


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_conversion_is_bit_exact(family, converter, synth_dir, converted):
    _check_bit_exact(family, synth_dir(family), converted(family), gguf_module(converter))


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_layout_converts_to_the_same_gguf(family, converter, converted):
    """transformers 5's fused experts: read by the converter (Qwen) or handed to it per expert in
    the view (the others); either way the same GGUF as from the per-expert checkpoint."""
    gguf = gguf_module(converter)
    a = {t.name: t for t in gguf.GGUFReader(str(converted(family))).tensors}
    b = {t.name: t for t in gguf.GGUFReader(str(converted(family, "fused"))).tensors}
    assert set(a) == set(b)
    for name in a:
        assert a[name].tensor_type == b[name].tensor_type and np.array_equal(np.asarray(a[name].data), np.asarray(b[name].data)), name


def test_converter_check_breaks_on_a_changed_byte(converter, synth_dir, converted, tmp_path):
    """The bit-exactness check can fail: one flipped bit in one expert of the GGUF is caught."""
    import shutil

    bad = tmp_path / "bad.gguf"
    shutil.copy(converted("olmoe"), bad)
    gguf = gguf_module(converter)
    t = next(x for x in gguf.GGUFReader(str(bad)).tensors if x.name == "blk.1.ffn_up_exps.weight")
    with open(bad, "r+b") as f:
        f.seek(int(t.data_offset) + 10)
        b = f.read(1)
        f.seek(int(t.data_offset) + 10)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(AssertionError):
        _check_bit_exact("olmoe", synth_dir("olmoe"), bad, gguf)


def test_view_links_the_source_and_leaves_it_alone(synth_dir, tmp_path):
    src = synth_dir("olmoe", "fused")
    before = {p.name: p.stat().st_mtime_ns for p in src.iterdir()}
    notes = lc.make_view(src, tmp_path / "v")
    assert {p.name: p.stat().st_mtime_ns for p in src.iterdir()} == before  # nothing written to the source
    assert any("per expert" in n for n in notes) and any("merges.txt" in n for n in notes)
    assert (tmp_path / "v" / "config.json").is_symlink() and (tmp_path / "v" / "tokenizer.json").is_symlink()
    index = json.loads((tmp_path / "v" / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in index and not any("gate_up_proj" in n for n in index)
    # a per-expert checkpoint is linked as it is
    notes = lc.make_view(synth_dir("qwen2_moe"), tmp_path / "q")
    assert not any("per expert" in n for n in notes)
    assert all(p.is_symlink() for p in (tmp_path / "q").glob("*.safetensors"))


def test_prepare_converts_once_and_checks_a_given_file(converter, synth_dir, tmp_path):
    logs = []
    src = synth_dir("qwen2_moe")
    a = lc.prepare(src, tmp_path, None, logs.append, llama_cpp_source=converter)
    mtime = a.stat().st_mtime_ns
    b = lc.prepare(src, tmp_path, None, logs.append, llama_cpp_source=converter)
    assert a == b and b.stat().st_mtime_ns == mtime and len([m for m in logs if m.startswith("converting")]) == 1
    assert lc.prepare(src, tmp_path, a) == a
    (tmp_path / "x.gguf").write_bytes(b"not a gguf")
    with pytest.raises(lc.GGUFError, match="not a GGUF file"):
        lc.prepare(src, tmp_path, tmp_path / "x.gguf")
    with pytest.raises(lc.GGUFError, match="no such file"):
        lc.prepare(src, tmp_path, tmp_path / "missing.gguf")


# ----------------------------------------------------------------------------- one-line failures


def _one_line(exc_info, *words):
    msg = str(exc_info.value)
    assert "\n" not in msg and "Traceback" not in msg, msg
    for w in words:
        assert w in msg, msg


def test_a_bad_converter_folder_is_one_line(tmp_path):
    with pytest.raises(lc.GGUFError) as e:
        lc.resolve_converter(tmp_path / "missing", None)
    _one_line(e, "no such folder")
    (tmp_path / "empty").mkdir()
    with pytest.raises(lc.GGUFError) as e:
        lc.resolve_converter(tmp_path / "empty", None)
    _one_line(e, "no convert_hf_to_gguf.py", "fetch DIR")


def _fake_converter(root: Path, body: str) -> Path:
    (root / "gguf-py" / "gguf").mkdir(parents=True)
    (root / "gguf-py" / "gguf" / "__init__.py").write_text("")
    (root / "convert_hf_to_gguf.py").write_text(body)
    return root


def test_an_sdist_folder_and_a_checkout_are_found(tmp_path):
    sd = tmp_path / "llama_cpp_python-9.9.9"
    _fake_converter(sd / "vendor" / "llama.cpp", "")
    assert lc.resolve_converter(sd, None) == sd / "vendor" / "llama.cpp"
    assert lc.resolve_converter(sd / "vendor" / "llama.cpp", None) == sd / "vendor" / "llama.cpp"


def test_the_converters_failure_is_one_line_with_its_last_error(synth_dir, tmp_path):
    conv = _fake_converter(tmp_path / "conv", "import sys\nprint('INFO: working')\n"
                           "def main():\n    print('Traceback ...', file=sys.stderr)\n    raise ValueError('Can not map tensor x')\n")
    with pytest.raises(lc.GGUFError) as e:
        lc.convert(synth_dir("mixtral"), tmp_path / "out" / "m.gguf", conv)
    _one_line(e, "exited with 1", "ValueError: Can not map tensor x", "log:")
    assert not list((tmp_path / "out").glob("*.gguf")) and not list((tmp_path / "out").glob(".*tmp"))
    conv2 = _fake_converter(tmp_path / "conv2", "def main():\n    import sentencepiece_missing_here\n")
    with pytest.raises(lc.GGUFError) as e:
        lc.convert(synth_dir("mixtral"), tmp_path / "out" / "m.gguf", conv2)
    _one_line(e, "needs the sentencepiece_missing_here package")


def test_switch_transformers_is_one_line(tmp_path):
    from zipmoe.runtime import synth

    synth.write("switch_transformers", tmp_path / "sw", preset="tiny", seed=0, force=True, progress=False)
    with pytest.raises(lc.GGUFError) as e:
        lc.prepare(tmp_path / "sw", tmp_path / "w", None)
    _one_line(e, "encoder-decoder", "SwitchTransformers")
    with pytest.raises(lc.GGUFError) as e:
        lc.convert(tmp_path / "sw", tmp_path / "w" / "x.gguf", tmp_path)
    _one_line(e, "encoder-decoder")


def test_the_view_gives_a_small_deepseek_q_lora_rank_0(synth_dir, tmp_path):
    """llama.cpp reads q_lora_rank of every DeepSeek-V2 but one with V2-Lite's 26 or 27 layers;
    null (V2-Lite's full q_proj) is written as 0 in the view, which llama.cpp builds the same way."""
    notes = lc.make_view(synth_dir("deepseek_v2"), tmp_path / "v")
    cfg = json.loads((tmp_path / "v" / "config.json").read_text())
    assert cfg["q_lora_rank"] == 0 and not (tmp_path / "v" / "config.json").is_symlink() and any("q_lora_rank" in n for n in notes)
    assert json.loads((synth_dir("deepseek_v2") / "config.json").read_text())["q_lora_rank"] is None  # the source as it was
    assert lc._view_config({"model_type": "deepseek_v2", "q_lora_rank": None, "num_hidden_layers": 27})[0] is None
    assert lc._view_config({"model_type": "deepseek_v2", "q_lora_rank": 1536, "num_hidden_layers": 3})[0] is None


def test_an_unreachable_index_is_one_line(tmp_path, monkeypatch):
    import os

    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # no find-links or extra index of this machine's
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens on the discard port
    with pytest.raises(lc.GGUFError) as e:
        lc.resolve_converter(None, tmp_path)
    _one_line(e, "not reachable", "--llama-cpp-source")


def test_a_missing_version_is_one_line(converter, tmp_path):
    """(The converter fixture skips this where the index cannot be reached.)"""
    with pytest.raises(lc.GGUFError) as e:
        lc.fetch(tmp_path, "0.0.0")
    _one_line(e, "no source distribution of llama-cpp-python==0.0.0")


def test_bench_keeps_its_other_engines_when_the_conversion_fails(tmp_path, monkeypatch, capsys):
    """llama.cpp on SwitchTransformers, or with a folder without the converter: one line each, the
    zipmoe engine's results kept."""
    from zipmoe.codecs.writer import pack
    from zipmoe.runtime import synth
    from zipmoe.runtime.bench import engines
    from zipmoe.runtime.bench import run as bench_run
    from zipmoe_cli.app import main

    monkeypatch.setattr(engines, "missing_extra", lambda name, *a: None)  # as if llama-cpp-python were installed

    def fake_worker(spec, support, limit, log_path, on_progress, timeout_s=None):
        run = {"engine": spec["engine"], "budget": spec["budget"], "batch": 1, "new_tokens": 2, "generated": 2, "case": "b1-n2",
               "ttft_s": 0.1, "tpot_s": 0.05, "e2e_s": 0.15, "tokens_per_s": 13.3, "tokens": [[1, 2]]}
        return {"engine": spec["engine"], "budget": spec["budget"], "ok": True, "runs": [run]}

    monkeypatch.setattr(bench_run, "run_worker", fake_worker)
    (tmp_path / "empty").mkdir()
    for family, extra, words in (("switch_transformers", [], ("encoder-decoder",)),
                                 ("mixtral", ["--llama-cpp-source", str(tmp_path / "empty")], ("no convert_hf_to_gguf.py",))):
        synth.write(family, tmp_path / family, preset="tiny", seed=0, force=True, progress=False)
        pack(tmp_path / family, tmp_path / f"{family}.zmoe")
        out = tmp_path / f"{family}.json"
        with pytest.raises(SystemExit) as exc:
            main(["bench", str(tmp_path / f"{family}.zmoe"), "--baseline", "llama.cpp", "--budget", "2M", "--runs", "1", "--new-tokens", "2",
                  "--device", "cpu", "--source", str(tmp_path / family), "--json", str(out), "--disk-bw", "1G",
                  "--work-dir", str(tmp_path / f"w-{family}"), *extra])
        err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("zipmoe: error")]
        assert exc.value.code == 1 and len(err) == 1 and all(w in err[0] for w in words), err
        assert [d["engine"] for d in json.loads(out.read_text())["results"] if d["ok"]] == ["zipmoe"]


def test_the_environment_names_the_converter_folder(tmp_path, monkeypatch):
    from zipmoe_cli.env import llama_cpp_source_env

    assert llama_cpp_source_env({}) is None and llama_cpp_source_env({"ZIPMOE_BENCH_LLAMA_CPP_SOURCE": " "}) is None
    assert llama_cpp_source_env({"ZIPMOE_BENCH_LLAMA_CPP_SOURCE": str(tmp_path)}) == tmp_path


# ----------------------------------------------------------------------------- the offline bundle


def _fake_sdist(path: Path) -> Path:
    files = {
        "PKG-INFO": "x", "pyproject.toml": "x", "CMakeLists.txt": "x", "llama_cpp/__init__.py": "__version__ = '9.9.9'",
        ".git/objects/pack/big.pack": "x" * 1000, "docs/index.md": "x", "tests/test_x.py": "x",
        "vendor/llama.cpp/CMakeLists.txt": "x", "vendor/llama.cpp/src/llama.cpp": "x", "vendor/llama.cpp/ggml/src/ggml.c": "x",
        "vendor/llama.cpp/models/ggml-vocab-gpt-2.gguf": "x" * 1000, "vendor/llama.cpp/models/ggml-vocab-gpt-2.gguf.inp": "x",
        "vendor/llama.cpp/models/templates/t.jinja": "x", "vendor/llama.cpp/docs/build.md": "x", "vendor/llama.cpp/media/a.png": "x",
        "vendor/llama.cpp/tools/server/server.cpp": "x", "vendor/llama.cpp/tools/mtmd/mtmd.cpp": "x",
        "vendor/llama.cpp/tools/CMakeLists.txt": "x", "vendor/llama.cpp/examples/simple/simple.cpp": "x",
        "vendor/llama.cpp/tests/test-x.cpp": "x", "vendor/llama.cpp/.github/workflows/ci.yml": "x",
        "vendor/llama.cpp/convert_hf_to_gguf.py": "def main(): pass\n", "vendor/llama.cpp/conversion/__init__.py": "",
        "vendor/llama.cpp/conversion/base.py": "", "vendor/llama.cpp/gguf-py/gguf/__init__.py": "",
        "vendor/llama.cpp/gguf-py/pyproject.toml": "", "vendor/llama.cpp/gguf-py/tests/test_a.py": "",
        "vendor/llama.cpp/LICENSE": "MIT", "vendor/llama.cpp/requirements.txt": "",
    }
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"llama_cpp_python-9.9.9/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_fetch_writes_the_converter_folder_and_the_trimmed_sdist(tmp_path, capsys):
    sdist = _fake_sdist(tmp_path / "llama_cpp_python-9.9.9.tar.gz")
    assert lc.main(["fetch", str(tmp_path / "bundle"), "--from-sdist", str(sdist), "--sdist"]) == 0
    out = capsys.readouterr().out
    assert "--llama-cpp-source" in out and "trimmed sdist" in out
    got = sorted(str(p.relative_to(tmp_path / "bundle")) for p in (tmp_path / "bundle").rglob("*") if p.is_file())
    assert got == ["LICENSE", "conversion/__init__.py", "conversion/base.py", "convert_hf_to_gguf.py", "gguf-py/gguf/__init__.py",
                   "gguf-py/pyproject.toml", "llama-cpp-python.version", "llama_cpp_python-9.9.9-trimmed.tar.gz"]
    assert lc.folder_version(tmp_path / "bundle") == "llama-cpp-python 9.9.9"
    assert lc.resolve_converter(tmp_path / "bundle", None) == tmp_path / "bundle"
    with tarfile.open(tmp_path / "bundle" / "llama_cpp_python-9.9.9-trimmed.tar.gz") as tar:
        kept = {m.name.split("/", 1)[1] for m in tar if m.isfile()}
    assert {"PKG-INFO", "pyproject.toml", "CMakeLists.txt", "llama_cpp/__init__.py", "vendor/llama.cpp/src/llama.cpp",
            "vendor/llama.cpp/ggml/src/ggml.c", "vendor/llama.cpp/tools/mtmd/mtmd.cpp", "vendor/llama.cpp/models/templates/t.jinja",
            "vendor/llama.cpp/convert_hf_to_gguf.py", "vendor/llama.cpp/gguf-py/gguf/__init__.py"} <= kept
    assert not kept & {".git/objects/pack/big.pack", "docs/index.md", "tests/test_x.py", "vendor/llama.cpp/models/ggml-vocab-gpt-2.gguf",
                       "vendor/llama.cpp/models/ggml-vocab-gpt-2.gguf.inp", "vendor/llama.cpp/docs/build.md", "vendor/llama.cpp/media/a.png",
                       "vendor/llama.cpp/tools/server/server.cpp", "vendor/llama.cpp/examples/simple/simple.cpp",
                       "vendor/llama.cpp/tests/test-x.cpp", "vendor/llama.cpp/.github/workflows/ci.yml"}
    # a version other than the sdist's is refused
    assert lc.main(["fetch", str(tmp_path / "b2"), "--from-sdist", str(sdist), "--version", "1.0"]) == 2
    assert "not the 1.0 asked for" in capsys.readouterr().err


def test_fetch_wheels_for_the_gpu_box(converter, tmp_path):
    """The wheels the converter and llama_cpp need beyond zipmoe's dependencies, for another Python
    (the GPU box's 3.12). (The converter fixture skips this where the index cannot be reached.)"""
    got = [p.name for p in lc.download_wheels("3.12", tmp_path)]
    assert any(n.startswith("sentencepiece-") and "cp312" in n for n in got) and any(n.startswith("diskcache-") for n in got), got
