"""DeepSpeed's NVMe offload with a libaio built into a folder of its own: benchmarks/libaio_build.sh
(bundle, build, env, check) and `zipmoe bench --deepspeed-libaio PREFIX`
(``ZIPMOE_BENCH_DEEPSPEED_LIBAIO``), which hands the op's build process and the engines' workers
the compiler and loader paths to it.

The option's one-line errors, the environment it sets and the script's refusals run everywhere
on fake prefixes. Building libaio needs its source, the tarball ``.aio/libaio-0.3.113.tar.gz``
(``benchmarks/libaio_build.sh bundle``, from a clone of libaio; ignored by git): CI has no copy
(it reaches only the package registries, and no PyPI package ships libaio.so with libaio.h), so
there the slow tests below skip. Where the tarball is, they build libaio into
``build/libaio-test/prefix`` (seconds) and run the tiny Mixtral with ``--deepspeed-offload nvme
--deepspeed-libaio`` on the CPU; the async_io op is JIT-built once into
``build/libaio-test/torch_extensions`` (about 6 minutes of g++ on two cores; later runs load it).
Both are ignored by git and outside ``.aio``, the folder carried to the GPU box (the op's build
folder is 140 MB).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zipmoe.errors import UsageError
from zipmoe.runtime.bench import deepspeed_engine

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "libaio_build.sh"
TARBALL = ROOT / ".aio" / "libaio-0.3.113.tar.gz"
CACHE = ROOT / "build" / "libaio-test"
VARS = ("CFLAGS", "LDFLAGS", "CPATH", "LIBRARY_PATH", "LD_RUN_PATH", "LD_LIBRARY_PATH")
needs_tarball = pytest.mark.skipif(not TARBALL.exists(), reason=f"no {TARBALL.relative_to(ROOT)} (benchmarks/libaio_build.sh bundle "
                                                                  "makes it from a clone of libaio; CI has none)")


def _fake_prefix(root: Path, lib: bool = True, header: bool = True) -> Path:
    (root / "include").mkdir(parents=True, exist_ok=True)
    (root / "lib").mkdir(exist_ok=True)
    if header:
        (root / "include" / "libaio.h").write_text("/* fake */\n")
    if lib:
        (root / "lib" / "libaio.so").write_bytes(b"")
    return root


@pytest.fixture
def kept_environ():
    """The compiler and loader variables as they were before the test (use_libaio sets them)."""
    before = {k: os.environ.get(k) for k in VARS}
    yield
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _script(*args, env=None):
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True, cwd="/tmp",
                          env=env if env is not None else {"PATH": os.environ["PATH"]})


def test_check_libaio_is_one_line(tmp_path, monkeypatch):
    assert deepspeed_engine.check_libaio(None) is None and deepspeed_engine.check_libaio("") is None
    for prefix, missing in [(tmp_path / "none", "include/libaio.h or lib/libaio.so"),
                            (_fake_prefix(tmp_path / "nolib", lib=False), "lib/libaio.so"),
                            (_fake_prefix(tmp_path / "nohdr", header=False), "include/libaio.h")]:
        with pytest.raises(UsageError) as exc:
            deepspeed_engine.check_libaio(prefix)
        msg = str(exc.value)
        assert msg.startswith(f"--deepspeed-libaio {str(prefix)!r}: no {missing} there") and "libaio_build.sh" in msg and "\n" not in msg
    good = _fake_prefix(tmp_path / "good")
    assert deepspeed_engine.check_libaio(good) == str(good)
    monkeypatch.chdir(tmp_path)
    assert deepspeed_engine.check_libaio("good") == str(good)  # made absolute: the workers run elsewhere


def test_libaio_env_puts_the_prefix_first(tmp_path):
    p = str(_fake_prefix(tmp_path / "p"))
    env = deepspeed_engine.libaio_env(p, {})
    assert env == {"CFLAGS": f"-I{p}/include", "LDFLAGS": f"-L{p}/lib -Wl,-rpath,{p}/lib", "CPATH": f"{p}/include",
                   "LIBRARY_PATH": f"{p}/lib", "LD_RUN_PATH": f"{p}/lib", "LD_LIBRARY_PATH": f"{p}/lib"}
    (tmp_path / "p" / "cuda-lib").mkdir()  # the build script's libcuda.so link (-lcuda of DeepSpeed's CUDA op)
    env = deepspeed_engine.libaio_env(p, {"CFLAGS": "-O2", "CPATH": "/a", "LD_LIBRARY_PATH": "/b", "LIBRARY_PATH": ""})
    assert env["CFLAGS"] == f"-I{p}/include -O2" and env["CPATH"] == f"{p}/include:/a" and env["LD_LIBRARY_PATH"] == f"{p}/lib:/b"
    assert env["LIBRARY_PATH"] == f"{p}/lib:{p}/cuda-lib"


def test_the_script_prints_what_bench_sets(tmp_path):
    """`libaio_build.sh env PREFIX`, evaluated in a clean shell, gives what libaio_env gives."""
    p = _fake_prefix(tmp_path / "p")
    for cuda in (False, True):
        if cuda:
            (p / "cuda-lib").mkdir()
            (p / "cuda-lib" / "libcuda.so").write_bytes(b"")
        r = subprocess.run(["bash", "-c", f'eval "$(bash {SCRIPT} env {p})" && env -0'], capture_output=True, text=True,
                           cwd="/tmp", env={"PATH": os.environ["PATH"]})
        assert r.returncode == 0, r.stderr
        got = dict(x.split("=", 1) for x in r.stdout.split("\0") if x)
        assert {k: got.get(k) for k in VARS} == deepspeed_engine.libaio_env(str(p), {})


def test_the_script_refuses_what_it_did_not_make(tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    tar = tmp_path / "libaio.tar.gz"
    tar.write_bytes(b"")
    r = _script("build", tar, foreign)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        f"libaio_build: PREFIX {foreign} is a folder this script did not make (no .libaio_build): give a new or empty path"]
    assert [x.name for x in foreign.iterdir()] == ["keep.txt"]
    r = _script("build", tmp_path / "none.tar.gz", tmp_path / "new")
    assert r.returncode == 1 and "no " + str(tmp_path / "none.tar.gz") in r.stderr and not (tmp_path / "new").exists()
    r = _script("env", tmp_path / "new")
    assert r.returncode == 1 and "has no include/libaio.h or lib/libaio.so" in r.stderr and not r.stdout
    r = _script("build", tar)
    assert r.returncode == 1 and "usage: build TARBALL PREFIX" in r.stderr
    r = _script("frob")
    assert r.returncode == 1 and "unknown command 'frob'" in r.stderr


def test_bench_sets_the_libaio_paths_for_deepspeed_only(tmp_path, monkeypatch, capsys, kept_environ):
    """--deepspeed-libaio (else ZIPMOE_BENCH_DEEPSPEED_LIBAIO) reaches the op's build process and
    the workers through the environment they inherit; a prefix without libaio is one line."""
    from test_cli_pack import assert_one_line_error, run
    from zipmoe.runtime.bench import run as bench_run

    seen = []
    monkeypatch.setattr(bench_run, "run_bench", lambda cfg, log=None, progress_factory=None: (
        seen.append({k: os.environ.get(k) for k in VARS}), ({"summary": []}, []))[1])
    monkeypatch.setattr("zipmoe_cli.bench._print_report", lambda *a, **k: None)
    monkeypatch.delenv("ZIPMOE_BENCH_DEEPSPEED_LIBAIO", raising=False)
    for k in VARS:
        monkeypatch.delenv(k, raising=False)
    z = tmp_path / "x.zmoe"
    z.write_bytes(b"")
    good, bad = _fake_prefix(tmp_path / "aio"), tmp_path / "empty"
    bad.mkdir()
    args = ["bench", z, "--engine", "deepspeed", "--budget", "1G"]
    code, _, err = run(capsys, *args, "--deepspeed-libaio", good)
    assert code == 0, err
    assert seen.pop() == deepspeed_engine.libaio_env(str(good), {})
    for k in VARS:
        os.environ.pop(k, None)
    monkeypatch.setenv("ZIPMOE_BENCH_DEEPSPEED_LIBAIO", str(good))
    code, _, err = run(capsys, *args)
    assert code == 0, err
    assert seen.pop()["CPATH"] == f"{good}/include"
    for k in VARS:
        os.environ.pop(k, None)
    code, _, err = run(capsys, "bench", z, "--engine", "zipmoe", "--budget", "1G")  # no deepspeed: nothing set
    assert code == 0, err
    assert seen.pop() == dict.fromkeys(VARS)
    code, _, err = run(capsys, *args, "--deepspeed-libaio", bad)
    assert_one_line_error(code, err, f"--deepspeed-libaio {str(bad)!r}: no include/libaio.h or lib/libaio.so there")
    monkeypatch.setenv("ZIPMOE_BENCH_DEEPSPEED_LIBAIO", str(bad))
    code, _, err = run(capsys, *args)
    assert_one_line_error(code, err, f"ZIPMOE_BENCH_DEEPSPEED_LIBAIO={str(bad)!r}: no include/libaio.h or lib/libaio.so there")
    assert not seen and os.environ.get("CPATH") is None


def test_deepspeed_env_reads_the_libaio_prefix(tmp_path):
    from zipmoe_cli.env import DEEPSPEED_LIBAIO, deepspeed_libaio_env

    p = _fake_prefix(tmp_path / "p")
    assert deepspeed_libaio_env({}) is None and deepspeed_libaio_env({DEEPSPEED_LIBAIO: " "}) is None
    assert deepspeed_libaio_env({DEEPSPEED_LIBAIO: str(p)}) == str(p)
    with pytest.raises(UsageError, match="ZIPMOE_BENCH_DEEPSPEED_LIBAIO='/nowhere': no include/libaio.h or lib/libaio.so there"):
        deepspeed_libaio_env({DEEPSPEED_LIBAIO: "/nowhere"})


@pytest.fixture(scope="module")
def prefix():
    """libaio built from the tarball into build/libaio-test/prefix (kept: the cached op's RUNPATH names it)."""
    p = CACHE / "prefix"
    if not (p / "lib" / "libaio.so").exists():
        r = _script("build", TARBALL, p, env=dict(os.environ))
        assert r.returncode == 0, r.stderr[-2000:]
    return p


@pytest.mark.slow
@needs_tarball
def test_the_script_builds_libaio(tmp_path):
    r = _script("build", TARBALL, tmp_path / "aio", env=dict(os.environ))
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"libaio 0.3.113 in {tmp_path / 'aio'}" in r.stdout
    assert (tmp_path / "aio" / "include" / "libaio.h").exists() and (tmp_path / "aio" / "lib" / "libaio.so.1.0.2").exists()
    r = _script("build", TARBALL, tmp_path / "aio", env=dict(os.environ))  # its own folder: built again
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.slow
@needs_tarball
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_deepspeed_nvme_offload_with_the_built_libaio(prefix, tmp_path, capsys, monkeypatch, kept_environ):
    from test_baselines_e2e import _bench
    from zipmoe.codecs.writer import pack
    from zipmoe.runtime import synth

    synth.write("mixtral", tmp_path / "mx", preset="tiny", seed=0, force=True, progress=False)
    pack(tmp_path / "mx", tmp_path / "mx.zmoe")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(CACHE / "torch_extensions"))
    # one ninja however pytest was started (pip's, beside the interpreter, else the system's):
    # ninja 1.11 and 1.13 take each other's build logs for stale and compile the op again
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    code, cap, doc = _bench(tmp_path, "deepspeed", capsys, "ds-nvme-libaio", "--deepspeed-offload", "nvme",
                            "--deepspeed-libaio", str(prefix), "--deepspeed-build-timeout", "800")
    assert code == 0, cap.err[-3000:]
    ds = next(d for d in doc["results"] if d["engine"] == "deepspeed")
    info = ds["load_info"]
    assert ds["ok"] and info["offload_param"] == "nvme" and not ds.get("budget_broken")
    assert info["libaio"] == [str(prefix / "lib" / "libaio.so.1.0.2")]  # the op found it (its RUNPATH, LD_LIBRARY_PATH)
    assert ds["runs"][0]["generated"] == 4
    assert doc["token_check"]["same"], doc["token_check"]  # the same greedy tokens as zipmoe


def test_arch_list_suffixes_become_what_deepspeed_parses(monkeypatch):
    """The H200 box's TORCH_CUDA_ARCH_LIST held '9.0a': DeepSpeed 0.19.8's op builder stopped with
    `invalid literal for int() with base 10: '0a'` (docs/benchmarks.md §27). bench hands it the
    plain capability, keeps +PTX, and changes nothing it can already read."""
    from zipmoe.runtime.bench import deepspeed_engine as d

    assert d.deepspeed_arch_list("9.0a") == "9.0"
    assert d.deepspeed_arch_list("8.0 9.0a 10.0f+PTX") == "8.0;9.0;10.0+PTX"
    assert d.deepspeed_arch_list("9.0") is None and d.deepspeed_arch_list("8.6;9.0+PTX") is None
    assert d.deepspeed_arch_list(None) is None and d.deepspeed_arch_list("") is None
    # what DeepSpeed's own parser does with the result (builder.compute_capability_args' sort key)
    for cc in d.deepspeed_arch_list("9.0a;10.0f+PTX").split(";"):
        tuple(int(part.split("+")[0]) for part in cc.split("."))
