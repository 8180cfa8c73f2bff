"""The model as a bf16 GGUF for the ``llama.cpp`` baseline of `zipmoe bench`, written by
llama.cpp's own converter.

The converter is ``convert_hf_to_gguf.py`` with its ``conversion/`` package and ``gguf-py/``, as
the llama.cpp source that llama-cpp-python's source distribution vendors ships them
(``llama_cpp_python-X/vendor/llama.cpp/``). zipmoe keeps no copy of it; it finds a folder that
holds it (:func:`resolve_converter`), in this order:

1. ``--llama-cpp-source DIR`` (``ZIPMOE_BENCH_LLAMA_CPP_SOURCE``, read by the command line): a
   llama.cpp checkout, an unpacked llama-cpp-python sdist or a folder written by ``fetch`` below;
2. the user cache, ``<cache>/llama.cpp/<llama-cpp-python version>/`` (``<cache>`` is zipmoe's
   cache folder, ``ZIPMOE_CACHE_DIR`` or ``~/.cache/zipmoe``);
3. else extracted there from the sdist of the installed llama-cpp-python version (fetched with
   ``pip download``; the newest when llama-cpp-python is not installed), so that the converter
   and the library that serves its output come from the same llama.cpp.

The converter runs in a subprocess of this Python (runtime/bench/llamacpp_launch.py says how),
``--outtype bf16``: bf16 matrices are copied bit for bit, norms and routers become float32 (exact).
It reads a *view* of the checkpoint (:func:`make_view`, a temporary folder; the source is never
written), which differs from the source only where the converter cannot read it, or llama.cpp
the file it writes:

- ``config.json`` with ``q_lora_rank: 0`` for a DeepSeek-V2 without one whose layer count is not
  V2-Lite's (:func:`_view_config`): llama.cpp would refuse the file;
- ``merges.txt`` with one merge when the tokenizer has none (zipmoe synth's byte-level tokenizer):
  llama.cpp refuses a BPE vocabulary without the merges key;
- per-expert tensors where the checkpoint has transformers 5's fused experts
  (``mlp.experts.gate_up_proj``) and the family's converter reads only per-expert ones
  (Mixtral, OLMoE, DeepSeek-V2; Qwen2-MoE and Qwen3-MoE read both): those shards are rewritten
  into the view with every expert's slices (same bytes), the others linked.

Every failure is one line (:class:`GGUFError`): no converter and no network, a version the index
does not have, a folder without the converter, a family llama.cpp has no architecture for
(SwitchTransformers is encoder-decoder), the converter's own error (the last line of its log).

``python -m zipmoe.runtime.bench.llamacpp_convert fetch DIR [--version V] [--sdist]`` writes the
converter folder into DIR for a machine without network (give it as ``--llama-cpp-source DIR``);
``--sdist`` also writes ``llama_cpp_python-V-trimmed.tar.gz`` there, the source distribution
without what building llama-cpp-python does not read (:data:`TRIM`), to build it offline;
``--wheels 3.12`` the wheels of :data:`EXTRA_WHEELS` into ``DIR/wheels``.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from zipmoe.errors import UsageError
from zipmoe.units import format_size

GGUF_NAME = "model-bf16.gguf"
CONVERTER = "convert_hf_to_gguf.py"
DIST = "llama-cpp-python"
VERSION_FILE = "llama-cpp-python.version"  # written by fetch: the sdist the folder came from

#: zipmoe's families and llama.cpp's architecture for each.
ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "olmoe": "olmoe", "deepseek_v2": "deepseek2"}
#: Families whose converter reads transformers 5's fused experts; the others get per-expert tensors in the view.
READS_FUSED = ("qwen2_moe", "qwen3_moe")

#: What the converter folder holds (under vendor/llama.cpp/ in the sdist).
CONVERTER_PARTS = (CONVERTER, "conversion/", "gguf-py/gguf/", "gguf-py/pyproject.toml", "gguf-py/LICENSE", "LICENSE")

#: What the trimmed sdist leaves out (fnmatch patterns on paths below the sdist's top folder):
#: llama-cpp-python's git history (its version comes from llama_cpp/__init__.py; without it
#: llama.cpp's build info says "unknown"), the tokenizer test vocabularies (models/*.gguf and their
#: .inp/.out), documentation, media, tests, examples and tools that llama-cpp-python's build does
#: not add (it adds vendor/llama.cpp with tools, tests and examples off, plus tools/mtmd), CI files.
TRIM = (
    ".git/*", "docs/*", "examples/*", "tests/*", "docker/*", ".github/*", "scripts/*", "mkdocs.yml",
    "vendor/llama.cpp/models/*.gguf", "vendor/llama.cpp/models/*.gguf.inp", "vendor/llama.cpp/models/*.gguf.out",
    "vendor/llama.cpp/docs/*", "vendor/llama.cpp/media/*", "vendor/llama.cpp/tests/*", "vendor/llama.cpp/examples/*",
    "vendor/llama.cpp/pocs/*", "vendor/llama.cpp/benches/*", "vendor/llama.cpp/app/*", "vendor/llama.cpp/ci/*",
    "vendor/llama.cpp/.github/*", "vendor/llama.cpp/.devops/*", "vendor/llama.cpp/skills/*", "vendor/llama.cpp/.gemini/*",
    "vendor/llama.cpp/.pi/*", "vendor/llama.cpp/gguf-py/tests/*", "vendor/llama.cpp/gguf-py/examples/*",
    "vendor/llama.cpp/tools/*",
)
#: ... except these (the multimodal library llama-cpp-python builds unless -DLLAVA_BUILD=OFF).
KEEP = ("vendor/llama.cpp/tools/mtmd/*", "vendor/llama.cpp/tools/CMakeLists.txt")

PIP_TIMEOUT_S = 900


class GGUFError(UsageError):
    """The model could not be converted to GGUF, or the converter was not found (one line)."""


# ----------------------------------------------------------------------------- the converter


def installed_version() -> str | None:
    """The installed llama-cpp-python's version, or None."""
    try:
        return importlib.metadata.version(DIST)
    except importlib.metadata.PackageNotFoundError:
        return None


def find_converter(folder: Path) -> Path | None:
    """The folder holding convert_hf_to_gguf.py and gguf-py/: ``folder`` itself (a llama.cpp
    checkout or a fetched folder) or its vendor/llama.cpp (an unpacked llama-cpp-python sdist)."""
    for cand in (Path(folder), Path(folder) / "vendor" / "llama.cpp"):
        if (cand / CONVERTER).is_file() and (cand / "gguf-py" / "gguf" / "__init__.py").is_file():
            return cand
    return None


def folder_version(folder: Path) -> str:
    """Which llama.cpp a converter folder is: the sdist version ``fetch`` recorded, else ``?``."""
    try:
        return Path(folder, VERSION_FILE).read_text().strip()
    except OSError:
        return "?"


def resolve_converter(given: Path | None, cache_dir: Path | None, log=lambda m: None) -> Path:
    """The converter folder: ``given``, else the user cache's for the installed llama-cpp-python
    version, else fetched into that cache from the version's sdist."""
    if given is not None:
        g = Path(given).expanduser()
        if not g.is_dir():
            raise GGUFError(f"--llama-cpp-source {g}: no such folder")
        found = find_converter(g)
        if found is None:
            raise GGUFError(f"--llama-cpp-source {g}: no {CONVERTER} with gguf-py/ in it (nor in vendor/llama.cpp/): give a llama.cpp "
                            "checkout, an unpacked llama-cpp-python sdist or a folder from `python -m zipmoe.runtime.bench.llamacpp_convert fetch DIR`")
        return found
    version = installed_version()
    root = Path(cache_dir).expanduser() if cache_dir is not None else Path(tempfile.gettempdir()) / "zipmoe-cache"
    if version is not None:
        cached = find_converter(root / "llama.cpp" / version)
        if cached is not None:
            return cached
    log(f"fetching llama.cpp's converter from the llama-cpp-python {version or '(newest)'} source distribution into {root / 'llama.cpp'} (once)")
    return fetch(root / "llama.cpp", version, subfolder=True)


def _pip_download(args: list[str], dest: Path, what: str, hint: str = "") -> subprocess.CompletedProcess:
    """``pip download ARGS --no-deps -d DEST`` (one retry, quiet), its output captured; one line
    naming ``what`` (then ``hint``) when it does not finish in :data:`PIP_TIMEOUT_S`."""
    cmd = [sys.executable, "-m", "pip", "download", *args, "--no-deps", "-d", str(dest),
           "--retries", "1", "--timeout", "20", "--disable-pip-version-check", "-q"]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise GGUFError(f"pip download {what} did not finish in {PIP_TIMEOUT_S} s{hint}") from None


def download_sdist(version: str | None, dest: Path) -> Path:
    """llama-cpp-python's sdist (``version`` or the newest) downloaded by pip into ``dest``."""
    spec = f"{DIST}=={version}" if version else DIST
    p = _pip_download([spec, "--no-binary", DIST], dest, spec, ": give --llama-cpp-source DIR")
    found = sorted(Path(dest).glob("llama_cpp_python-*.tar.gz"))
    if p.returncode != 0 or not found:
        err = p.stderr or p.stdout or ""
        if re.search(r"(?i)connection|resolve|network|unreachable|timed out|proxy|Could not fetch URL", err):
            why = "the package index is not reachable"  # pip then says no version matched, too: this first
        elif re.search(r"No matching distribution|Could not find a version", err):
            why = f"the package index has no source distribution of {spec}"
        else:
            why = _last_line(err) or f"pip exited with {p.returncode}"
        raise GGUFError(f"llama.cpp's converter: cannot download {spec}'s source distribution ({why}); give --llama-cpp-source DIR "
                        "(a folder from `python -m zipmoe.runtime.bench.llamacpp_convert fetch DIR` where the index is reachable)")
    return found[-1]


#: What llama.cpp's converter (sentencepiece, for Llama-family tokenizers) and llama-cpp-python
#: (diskcache, imported by ``llama_cpp``) need beyond zipmoe's own dependencies.
EXTRA_WHEELS = ("sentencepiece", "diskcache")


def download_wheels(python: str, dest: Path) -> list[Path]:
    """:data:`EXTRA_WHEELS` as wheels for Python ``python`` (this machine's platform) into ``dest``."""
    p = _pip_download([*EXTRA_WHEELS, "--only-binary", ":all:", "--python-version", python], dest, " ".join(EXTRA_WHEELS))
    if p.returncode != 0:
        raise GGUFError(f"cannot download {', '.join(EXTRA_WHEELS)} wheels for Python {python}: {_last_line(p.stderr or p.stdout)}")
    return sorted(Path(dest).glob("*.whl"))


def _sdist_version(sdist: Path) -> str:
    m = re.match(r"llama_cpp_python-(.+)\.tar\.gz$", Path(sdist).name)
    return m.group(1) if m else "?"


def _open_sdist(sdist: Path) -> tarfile.TarFile:
    try:
        return tarfile.open(sdist, "r:gz")
    except (OSError, tarfile.TarError) as exc:
        raise GGUFError(f"{sdist}: not a readable llama-cpp-python source distribution ({exc})") from None


def extract_converter(sdist: Path, dest: Path) -> Path:
    """The converter's files (:data:`CONVERTER_PARTS`) from ``sdist`` into ``dest`` (made whole
    under a temporary name, then renamed): the folder ``--llama-cpp-source`` takes."""
    dest = Path(dest)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    n = 0
    with _open_sdist(sdist) as tar:
        for m in tar:
            parts = m.name.split("/", 1)
            rel = parts[1] if len(parts) == 2 else ""
            if not rel.startswith("vendor/llama.cpp/") or not (m.isfile() or m.isdir()):
                continue
            rel = rel[len("vendor/llama.cpp/"):]
            if ".." in Path(rel).parts:
                continue
            if not any(rel == p or (p.endswith("/") and rel.startswith(p)) for p in CONVERTER_PARTS) or "/__pycache__/" in rel:
                continue
            if m.isfile():
                out = tmp / rel
                out.parent.mkdir(parents=True, exist_ok=True)
                with tar.extractfile(m) as src, open(out, "wb") as f:
                    shutil.copyfileobj(src, f)
                n += 1
    if find_converter(tmp) is None:
        shutil.rmtree(tmp, ignore_errors=True)
        raise GGUFError(f"{sdist}: no vendor/llama.cpp/{CONVERTER} with gguf-py/ in this source distribution")
    (tmp / VERSION_FILE).write_text(f"{DIST} {_sdist_version(sdist)}\n")
    if dest.exists():  # a folder fetched earlier (or by a process beside this one): replaced whole
        old = dest.with_name(f".{dest.name}.{os.getpid()}.old")
        os.replace(dest, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(tmp, dest)
    return dest


def trim_sdist(sdist: Path, out: Path) -> Path:
    """``sdist`` rewritten to ``out`` without the members :data:`TRIM` names (a .tar.gz that pip
    still builds; see docs/bench.md for the command)."""
    out = Path(out)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    with _open_sdist(sdist) as tar, tarfile.open(tmp, "w:gz", compresslevel=9) as w:
        for m in tar:
            rel = m.name.split("/", 1)[1] if "/" in m.name else ""
            if rel and any(fnmatch.fnmatch(rel, p) or fnmatch.fnmatch(rel + "/x", p) for p in TRIM) \
                    and not any(fnmatch.fnmatch(rel, k) or fnmatch.fnmatch(rel + "/x", k) for k in KEEP):
                continue
            w.addfile(m, tar.extractfile(m) if m.isfile() else None)
    os.replace(tmp, out)
    return out


def fetch(dest: Path, version: str | None = None, subfolder: bool = False, sdist_out: bool = False,
          sdist_file: Path | None = None) -> Path:
    """Download llama-cpp-python's sdist (``version``, else the newest) and extract the converter
    into ``dest`` (``dest/<version>`` with ``subfolder``); with ``sdist_out`` also write the
    trimmed sdist into ``dest``. ``sdist_file``: use that sdist instead of downloading."""
    dest = Path(dest).expanduser()
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=dest) as tmp:
        sdist = Path(sdist_file) if sdist_file is not None else download_sdist(version, Path(tmp))
        got = _sdist_version(sdist)
        if version is not None and got != version:
            raise GGUFError(f"{sdist}: llama-cpp-python {got}, not the {version} asked for")
        folder = extract_converter(sdist, dest / got if subfolder else dest / ".converter")
        if not subfolder:  # the converter's files straight into dest, beside what is there
            for p in folder.iterdir():
                target = dest / p.name
                if target.is_dir() and not target.is_symlink():
                    shutil.rmtree(target)
                elif target.exists() or target.is_symlink():
                    target.unlink()
                os.replace(p, target)
            folder.rmdir()
            folder = dest
        if sdist_out:
            trim_sdist(sdist, dest / f"llama_cpp_python-{got}-trimmed.tar.gz")
    return find_converter(folder) or folder


# ----------------------------------------------------------------------------- the view


def _config(source: Path) -> dict:
    try:
        cfg = json.loads(Path(source, "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise GGUFError(f"GGUF conversion failed: cannot read {source}/config.json ({exc})") from None
    if not isinstance(cfg, dict):
        raise GGUFError(f"GGUF conversion failed: {source}/config.json is not a JSON object")
    return cfg


def check_convertible(config: dict) -> None:
    """One line for what llama.cpp has no architecture for (the converter would say it less clearly)."""
    mt = config.get("model_type")
    if mt == "switch_transformers" or config.get("is_encoder_decoder"):
        raise GGUFError(f"GGUF conversion: llama.cpp serves decoder-only models; {mt!r} is encoder-decoder (SwitchTransformers), "
                        "so the llama.cpp baseline cannot run it")


def _view_config(config: dict) -> tuple[dict | None, str]:
    """config.json as the view gives it, with why, or (None, "") when the source's is read as it is.

    A DeepSeek-V2 without q_lora_rank (V2-Lite's full q_proj) gets ``q_lora_rank: 0`` unless it
    has 26 or 27 layers: llama.cpp reads the key of every DeepSeek-V2 whose layer count is not
    V2-Lite's (its test for 'Lite'), and the converter writes it only when it is not null; with 0
    llama.cpp builds the full q projection, as it does for V2-Lite."""
    if config.get("model_type") == "deepseek_v2" and config.get("q_lora_rank") is None \
            and config.get("num_hidden_layers") not in (26, 27):
        return dict(config, q_lora_rank=0), (f"q_lora_rank 0 for null (llama.cpp reads that key unless a DeepSeek-V2 has "
                                             f"V2-Lite's 26 or 27 layers; this one has {config.get('num_hidden_layers')})")
    return None, ""


def _one_merge(tok: dict) -> str | None:
    """``merges.txt`` text with one merge when tokenizer.json is a BPE without merges, else None.
    llama.cpp needs the merges key of a BPE vocabulary; one merge of two single-character tokens
    changes nothing the bench does (it feeds token ids)."""
    model = tok.get("model") or {}
    if model.get("type") != "BPE" or model.get("merges"):
        return None
    vocab = model.get("vocab") or {}
    singles = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if len(t) == 1 and t != " "]
    if len(singles) < 2:
        return None
    return f"#version: 0.2\n{singles[0]} {singles[1]}\n"


def _fused_split_names(name: str, proj: str, n: int, family) -> list[tuple[int, str, str]]:
    """(expert, part, per-expert name) of each slice of a fused tensor: parts gate and up of a
    gate_up tensor, else its own projection; names as the family's per-expert checkpoints have them."""
    base = name[: name.index("mlp.experts.")] + family.moe_module + ".experts."
    projs = ("gate", "up") if proj == "gate_up" else (proj,)
    return [(e, p, f"{base}{e}.{family.expert_projs[p]}.weight") for e in range(n) for p in projs]


def _write_split(src: Path, view: Path, config: dict, family, weight_map: dict) -> None:
    """One shard with fused experts rewritten into the view: its dense tensors as they are, every
    fused tensor as per-expert tensors (gate rows first in gate_up, as transformers splits it)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from zipmoe.codecs.naming import classify

    dense, k = {}, 0
    stem = src.name[: -len(".safetensors")]
    with safe_open(str(src), framework="pt") as st:
        for name in st.keys():
            shape = tuple(st.get_slice(name).get_shape())
            role = classify(name, shape, config)
            if not role.fused:
                dense[name] = st.get_tensor(name)
                continue
            t = st.get_tensor(name)
            half = t.shape[1] // 2
            parts = {}
            for e, p, split in _fused_split_names(name, role.proj, t.shape[0], family):
                x = t[e]
                if role.proj == "gate_up":
                    x = x[:half] if p == "gate" else x[half:]
                parts[split] = x.contiguous().clone()
            k += 1
            out = f"{stem}-experts-{k:05d}.safetensors"
            save_file(parts, str(view / out), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(parts, out))
            del t, parts
    if dense:
        out = f"{stem}-dense.safetensors"
        save_file(dense, str(view / out), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(dense, out))


def make_view(source: Path, view: Path, config: dict | None = None) -> list[str]:
    """The checkpoint as the converter reads it, in ``view`` (links to the source's files, adjusted
    where the module docstring says; ``config``: the source's config.json, read when not given).
    Returns what was adjusted, one phrase each."""
    from safetensors import safe_open

    from zipmoe.codecs.naming import classify

    source, view = Path(source), Path(view)
    config = _config(source) if config is None else config
    view.mkdir(parents=True, exist_ok=True)
    files = sorted(source.glob("*.safetensors"))
    if not files:
        raise GGUFError(f"GGUF conversion failed: no .safetensors files in {source}")
    notes = []
    fused = set()
    names: dict[Path, list[str]] = {}  # each shard's tensor names, for the index of the linked ones
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            names[f] = list(st.keys())
            if any(classify(n, tuple(st.get_slice(n).get_shape()), config).fused for n in names[f]):
                fused.add(f)
    mt = config.get("model_type")
    family = None
    if fused and mt not in READS_FUSED:
        from zipmoe.runtime.synth.registry import FAMILIES

        family = FAMILIES.get(mt)
        if family is None:
            raise GGUFError(f"GGUF conversion: {source} has fused experts (mlp.experts.gate_up_proj) and zipmoe does not know "
                            f"{mt!r}'s per-expert names, which llama.cpp's converter reads")
    adjusted, why = _view_config(config)
    if adjusted is not None:
        (view / "config.json").write_text(json.dumps(adjusted, indent=2))
        notes.append(why)
    for p in source.iterdir():
        if p.name.endswith(".safetensors") or p.name == "model.safetensors.index.json" or not p.is_file() \
                or (view / p.name).exists():
            continue
        (view / p.name).symlink_to(p.resolve())
    weight_map: dict[str, str] = {}
    for f in files:
        if family is not None and f in fused:
            _write_split(f, view, config, family, weight_map)
            continue
        (view / f.name).symlink_to(f.resolve())
        weight_map.update(dict.fromkeys(names[f], f.name))
    if family is not None:
        notes.append(f"fused experts written per expert ({mt}'s converter reads per-expert tensors only)")
    (view / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    tj = source / "tokenizer.json"
    if tj.is_file() and not (source / "merges.txt").exists():
        try:
            merge = _one_merge(json.loads(tj.read_text(encoding="utf-8")))
        except (OSError, json.JSONDecodeError):
            merge = None
        if merge is not None:
            (view / "merges.txt").write_text(merge, encoding="utf-8")
            notes.append("merges.txt with one merge (the tokenizer has none; llama.cpp needs the key)")
    return notes


# ----------------------------------------------------------------------------- conversion


def _last_line(text: str) -> str:
    """The line of a log that says why: the last exception or ERROR line, else the last line."""
    lines = [x.strip() for x in (text or "").splitlines() if x.strip()]
    for x in reversed(lines):
        if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b", x) or x.startswith("ERROR:"):
            return x
    return lines[-1] if lines else ""


def convert(source: Path, out: Path, converter: Path, log=lambda m: None) -> Path:
    """``source`` (a safetensors folder) as a bf16 GGUF at ``out``, written by the converter in
    ``converter`` in a subprocess (atomically: a temporary name, renamed when it succeeded)."""
    source, out, converter = Path(source), Path(out), Path(converter)
    config = _config(source)
    check_convertible(config)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    logf = out.with_name(out.name + ".log")
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}  # its own gguf-py, not an installed gguf
    env["HF_HUB_OFFLINE"] = "1"
    launcher = Path(__file__).with_name("llamacpp_launch.py")
    with tempfile.TemporaryDirectory(prefix=".view-", dir=out.parent) as view:
        for note in make_view(source, Path(view), config):
            log(f"  view for the converter: {note}")
        cmd = [sys.executable, str(launcher), str(converter), str(view), "--outfile", str(tmp), "--outtype", "bf16"]
        try:
            with open(logf, "w") as lf:
                rc = subprocess.run(cmd, stdout=lf, stderr=subprocess.STDOUT, env=env).returncode
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise GGUFError(f"GGUF conversion failed: cannot run {CONVERTER} ({exc})") from None
    if rc != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        text = logf.read_text(errors="replace")[-20000:] if logf.is_file() else ""
        why = _last_line(text)
        m = re.search(r"No module named '([\w.]+)'", why)
        if m:
            why = f"it needs the {m.group(1).split('.')[0]} package (pip install 'zipmoe[baselines]')"
        raise GGUFError(f"GGUF conversion failed: llama.cpp's {CONVERTER} ({converter}) exited with {rc}: {why} (log: {logf})")
    os.replace(tmp, out)
    return out


def prepare(source: Path, work: Path, given: Path | None, log=lambda m: None, llama_cpp_source: Path | None = None,
            cache_dir: Path | None = None) -> Path:
    """The GGUF the llama.cpp engine serves: ``--gguf FILE``, else ``source`` converted once into
    the work folder by llama.cpp's converter (redone when the source's safetensors or the
    converter change)."""
    if given is not None:
        g = Path(given)
        if not g.is_file():
            raise GGUFError(f"--gguf {g}: no such file")
        with open(g, "rb") as f:
            if f.read(4) != b"GGUF":
                raise GGUFError(f"--gguf {g}: not a GGUF file")
        return g
    config = _config(source)
    check_convertible(config)
    converter = resolve_converter(llama_cpp_source, cache_dir, log)
    out = Path(work) / "gguf" / GGUF_NAME
    stamp = out.with_name(out.name + ".source")
    newest = max((p.stat().st_mtime_ns for p in Path(source).glob("*.safetensors")), default=0)
    ident = (f"{Path(source).resolve()}:{newest}:{converter.resolve()}:{folder_version(converter)}:"
             f"{(converter / CONVERTER).stat().st_mtime_ns}")
    if out.exists() and stamp.exists() and stamp.read_text() == ident:
        return out
    log(f"converting {source} to a bf16 GGUF at {out} with llama.cpp's {CONVERTER} ({converter}) for the 'llama.cpp' engine (once)")
    stamp.unlink(missing_ok=True)
    convert(source, out, converter, log)
    stamp.write_text(ident)
    return out


# ----------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zipmoe.runtime.bench.llamacpp_convert",
                                 description="llama.cpp's converter for zipmoe bench's llama.cpp baseline, for a machine without network.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help="write the converter folder (convert_hf_to_gguf.py, conversion/, gguf-py/) into DIR")
    f.add_argument("dir", type=Path)
    f.add_argument("--version", default=None, help="llama-cpp-python version (default: the installed one, else the newest)")
    f.add_argument("--sdist", action="store_true", help="also write llama_cpp_python-V-trimmed.tar.gz into DIR (builds offline)")
    f.add_argument("--from-sdist", type=Path, default=None, metavar="FILE", help="use this sdist instead of downloading one")
    f.add_argument("--wheels", default=None, metavar="PYTHON", help="also download into DIR/wheels the wheels, for that Python "
                   f"version (e.g. 3.12), that the converter and llama-cpp-python need beyond zipmoe's dependencies: {', '.join(EXTRA_WHEELS)}")
    args = ap.parse_args(argv)
    try:
        version = args.version or (None if args.from_sdist else installed_version())
        folder = fetch(args.dir, version, sdist_out=args.sdist, sdist_file=args.from_sdist)
        if args.wheels:
            download_wheels(args.wheels, Path(args.dir) / "wheels")
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    size = sum(p.stat().st_size for p in folder.rglob("*")
               if p.is_file() and not p.name.endswith((".tar.gz", ".whl")) and not p.name.startswith("."))
    print(f"converter: {folder} ({folder_version(folder)}, {format_size(size)}): zipmoe bench --llama-cpp-source {folder}")
    for t in sorted(Path(args.dir).glob("llama_cpp_python-*-trimmed.tar.gz")) if args.sdist else []:
        print(f"trimmed sdist: {t} ({format_size(t.stat().st_size)})")
    for w in sorted((Path(args.dir) / "wheels").glob("*.whl")) if args.wheels else []:
        print(f"wheel: {w} ({format_size(w.stat().st_size)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
