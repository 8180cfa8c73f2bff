"""The moe-infinity baseline on the CPU box: its one-line refusals (no package, a folder that is not
a site, the PyPI placeholder, a package that does not import, no GPU), the isolation of its
environment (its own transformers in the worker, nothing of the site in bench's process), and the
checkpoint view transformers 4.x reads (the source untouched). The engine itself runs on the H200
box only (docs/benchmarks.md §26); here fake sites stand in for the built one."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zipmoe.runtime.bench import engines, moe_infinity_engine as mi

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _site(root: Path, init: str | None, transformers_version: str | None = None) -> Path:
    """A folder laid out like benchmarks/moe_infinity_build.sh's site: moe_infinity/__init__.py
    holding ``init`` (None: no package) and, when given, a stand-in transformers of that version."""
    root.mkdir(parents=True, exist_ok=True)
    if init is not None:
        (root / "moe_infinity").mkdir()
        (root / "moe_infinity" / "__init__.py").write_text(init)
    if transformers_version:
        (root / "transformers").mkdir()
        (root / "transformers" / "__init__.py").write_text(f"__version__ = {transformers_version!r}\n")
    return root


WORKING = "class MoE:\n    pass\n__version__ = '0.0.1'\n"


def _one_line(why):
    assert why and "\n" not in why and "Traceback" not in why
    return why


# ----------------------------------------------------------------------------- refusals


def test_no_site_and_no_package_names_the_build():
    assert importlib.util.find_spec("moe_infinity") is None  # zipmoe's environment never has it
    why = _one_line(engines.missing_extra("moe-infinity"))
    assert why == mi.EXTRA_LINE and "moe_infinity_build.sh" in why and "--moe-infinity-site" in why and "placeholder" in why


def test_a_site_that_is_not_a_folder(tmp_path):
    for p in (tmp_path / "nowhere", tmp_path / "a-file"):
        if p.name == "a-file":
            p.write_text("x")
        why = _one_line(engines.missing_extra("moe-infinity", str(p)))
        assert f"--moe-infinity-site {p} is not a folder" in why and "moe_infinity_build.sh" in why


def test_a_folder_without_the_package(tmp_path):
    site = _site(tmp_path / "site", None)
    why = _one_line(engines.missing_extra("moe-infinity", str(site)))
    assert "holds no moe_infinity package" in why


def test_the_pypi_placeholder(tmp_path):
    site = _site(tmp_path / "site", "")  # moe-infinity 0.0.1.dev0 from PyPI: an empty module
    why = _one_line(engines.missing_extra("moe-infinity", str(site)))
    assert "PyPI placeholder" in why and "source" in why


def test_a_package_that_does_not_import(tmp_path):
    site = _site(tmp_path / "site", "import moe_infinity._store\n")  # a build whose extension is missing
    why = _one_line(engines.missing_extra("moe-infinity", str(site)))
    assert "does not import in its environment" in why and "moe_infinity._store" in why


def test_a_working_site_passes_and_nothing_is_imported_here(tmp_path):
    site = _site(tmp_path / "site", WORKING)
    assert engines.missing_extra("moe-infinity", str(site)) is None
    assert "moe_infinity" not in sys.modules


def _worker_python(site: Path | None, code: str) -> subprocess.CompletedProcess:
    env = mi.worker_env(str(site) if site else None)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd="/")


def test_no_gpu_is_one_line_in_the_worker(tmp_path):
    """before_load in a process with the site's environment: a CPU run is refused with one line."""
    site = _site(tmp_path / "site", WORKING)
    r = _worker_python(site, "from zipmoe.runtime.bench import moe_infinity_engine as m\n"
                             "from zipmoe.errors import DeviceError\n"
                             "try:\n    m.before_load({'device': 'cpu'})\n"
                             "except DeviceError as e:\n    print('REFUSED', e)\n")
    assert r.returncode == 0, r.stderr
    assert "REFUSED baseline 'moe-infinity' runs on a CUDA GPU only" in r.stdout and "--device cuda" in r.stdout
    # the placeholder and a failing import are refused there too (the site may change after the parent's check)
    for init, needle in (("", "placeholder"), ("raise ImportError('libcudart.so.13: cannot open shared object file')\n", "does not import")):
        bad = _site(tmp_path / f"bad{len(needle)}", init)
        r = _worker_python(bad, "from zipmoe.runtime.bench import moe_infinity_engine as m\n"
                                "from zipmoe.errors import UsageError\n"
                                "try:\n    m.before_load({'device': 'cuda'})\n"
                                "except UsageError as e:\n    print('REFUSED', e)\n")
        assert r.returncode == 0 and "REFUSED" in r.stdout and needle in r.stdout and "\n" not in r.stdout.strip(), (r.stdout, r.stderr)


# ----------------------------------------------------------------------------- isolation


def test_worker_env_puts_the_site_first(tmp_path):
    site = _site(tmp_path / "site", WORKING)
    before = dict(os.environ)
    env = mi.worker_env(str(site), {"PYTHONPATH": "/somewhere/else", "X": "1"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(site.resolve()), "/somewhere/else"] and env["X"] == "1"
    assert mi.worker_env(str(site), {})["PYTHONPATH"] == str(site.resolve())
    assert mi.worker_env(None, {"PYTHONPATH": "/a"}) == {"PYTHONPATH": "/a"}
    assert dict(os.environ) == before  # this process's environment is not changed


def test_the_worker_sees_the_site_transformers_and_this_process_does_not(tmp_path):
    """The site's transformers (4.53, as MoE-Infinity pins) is what its processes import; bench's
    own process keeps zipmoe's transformers and never imports moe_infinity."""
    import transformers

    site = _site(tmp_path / "site", WORKING, transformers_version="4.53.0")
    p = mi.probe(str(site))
    assert p["found"] and p["has_moe"] and p["transformers"] == "4.53.0", p
    assert Path(p["transformers_file"]).resolve().is_relative_to(site.resolve()) and Path(p["file"]).resolve().is_relative_to(site.resolve())
    assert transformers.__version__ != "4.53.0" and not Path(transformers.__file__).resolve().is_relative_to(site.resolve())
    assert "moe_infinity" not in sys.modules
    # without the site, the probe sees zipmoe's own environment: no moe_infinity there
    q = mi.probe(None)
    assert q["found"] is False and q["transformers"] == transformers.__version__


def test_bench_starts_the_worker_with_the_site_environment(tmp_path, capsys):
    """`zipmoe bench --baseline moe-infinity --moe-infinity-site SITE` on the CPU: the worker is
    started with SITE first on its path (the fake package records what it saw), refuses the CPU with
    one line, and bench's process imports nothing of the site."""
    from test_cli_pack import run

    from zipmoe.codecs.writer import pack
    from zipmoe.runtime import synth

    record = tmp_path / "seen.json"
    site = _site(tmp_path / "site", WORKING + (
        "import json, os, sys\n"
        f"print(json.dumps({{'argv0': sys.argv[0], 'pythonpath': os.environ.get('PYTHONPATH', '')}}), file=open({str(record)!r}, 'a'))\n"))
    synth.write("mixtral", tmp_path / "mx", preset="tiny", seed=0, force=True, progress=False)
    pack(tmp_path / "mx", tmp_path / "mx.zmoe")
    out = tmp_path / "o.json"
    code, _out, err = run(capsys, "bench", tmp_path / "mx.zmoe", "--engine", "moe-infinity", "--moe-infinity-site", site,
                          "--budget", "2M", "--runs", "1", "--new-tokens", "2", "--device", "cpu", "--source", tmp_path / "mx",
                          "--json", out, "--work-dir", tmp_path / "w", "--no-cgroup")
    errs = [x for x in err.splitlines() if x.startswith("zipmoe: error")]
    assert code != 0 and len(errs) == 1 and "runs on a CUDA GPU only" in errs[0] and "Traceback" not in err, err
    seen = [json.loads(x) for x in record.read_text().splitlines()]  # the parent's probe process, then the worker
    assert [s["argv0"].endswith("worker.py") for s in seen] == [False, True], seen
    assert all(s["pythonpath"].split(os.pathsep)[0] == str(site.resolve()) for s in seen)
    assert "moe_infinity" not in sys.modules
    doc = json.loads(out.read_text())
    assert doc["configs"][0]["moe_infinity_site"] == str(site)


def test_the_site_option_and_its_environment_variable(tmp_path, capsys, monkeypatch):
    from test_cli_pack import run

    from zipmoe_cli.env import MOE_INFINITY_SITE, moe_infinity_site_env

    assert moe_infinity_site_env({}) is None and moe_infinity_site_env({MOE_INFINITY_SITE: ""}) is None
    assert moe_infinity_site_env({MOE_INFINITY_SITE: "~/mi"}) == Path("~/mi").expanduser()
    from zipmoe.runtime import synth
    from zipmoe.codecs.writer import pack

    synth.write("mixtral", tmp_path / "mx", preset="tiny", seed=0, force=True, progress=False)
    pack(tmp_path / "mx", tmp_path / "mx.zmoe")
    monkeypatch.setenv(MOE_INFINITY_SITE, str(tmp_path / "no-such-site"))
    code, _out, err = run(capsys, "bench", tmp_path / "mx.zmoe", "--engine", "moe-infinity", "--budget", "2M", "--runs", "1",
                          "--new-tokens", "2", "--device", "cpu", "--source", tmp_path / "mx", "--work-dir", tmp_path / "w",
                          "--json", tmp_path / "o.json", "--no-cgroup")
    errs = [x for x in err.splitlines() if x.startswith("zipmoe: error")]
    assert code != 0 and len(errs) == 1 and "no-such-site is not a folder" in errs[0] and "Traceback" not in err, err


# ----------------------------------------------------------------------------- the checkpoint view


def test_checkpoint_view_is_the_source_for_transformers_4(tmp_path):
    from zipmoe.runtime import synth

    src = tmp_path / "mx"
    synth.write("mixtral", src, preset="tiny", seed=0, force=True, progress=False)
    digest = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in src.iterdir() if f.is_file()}
    config = json.loads((src / "config.json").read_text())
    view = mi.checkpoint_view(src, tmp_path / "view")
    mi.checkpoint_view(src, tmp_path / "view")  # again: the links are made anew, nothing fails
    assert {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in src.iterdir() if f.is_file()} == digest
    for f in src.iterdir():
        if f.is_file() and f.name != "config.json":
            assert (view / f.name).is_symlink() and (view / f.name).resolve() == f.resolve()
    legacy = json.loads((view / "config.json").read_text())
    assert legacy["torch_dtype"] == config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    if "rope_parameters" in config:
        assert legacy["rope_theta"] == config["rope_parameters"]["rope_theta"]
    assert {k: v for k, v in legacy.items() if k not in mi.LEGACY_KEYS} == {k: v for k, v in config.items() if k not in mi.LEGACY_KEYS}


def test_legacy_config_keeps_what_is_there():
    assert mi.legacy_config({"torch_dtype": "float16", "dtype": "bfloat16"})["torch_dtype"] == "float16"
    assert mi.legacy_config({"rope_theta": 1.0, "rope_parameters": {"rope_theta": 2.0}})["rope_theta"] == 1.0
    assert "torch_dtype" not in mi.legacy_config({}) and "rope_theta" not in mi.legacy_config({"rope_parameters": None})


def test_store_is_shared_by_every_budget(tmp_path):
    assert mi.store_folder(tmp_path / "w" / "moe-infinity-8G") == mi.store_folder(tmp_path / "w" / "moe-infinity-16G") == tmp_path / "w" / "moe-infinity-store"


def test_build_script_and_patches_are_there():
    root = Path(__file__).parents[1]
    script = root / mi.BUILD
    assert script.is_file() and os.access(script, os.X_OK)
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    for ref in ("dev", "main"):
        patch = (root / "benchmarks" / "moe_infinity" / f"{ref}.patch").read_text()
        assert patch.startswith("diff --git") and "zipmoe patch" in patch
    r = subprocess.run(["bash", str(script), "build", "nope", "/tmp/x"], capture_output=True, text=True)
    assert r.returncode != 0 and r.stderr.strip().splitlines() == ["moe_infinity_build: unknown ref 'nope': dev or main"]


def test_build_never_replaces_a_folder_it_did_not_make(tmp_path):
    """`build REF SITE WORK` replaces SITE and WORK/REF only when an earlier build made them: a
    user's folder given by mistake is refused in one line and left as it was."""
    script = Path(__file__).parents[1] / mi.BUILD
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "moe-infinity-main-d617801.tar.gz").write_bytes(b"")  # present: the checks come first
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    env = dict(os.environ, BUNDLE=str(bundle))
    r = subprocess.run(["bash", str(script), "build", "main", str(mine), str(tmp_path / "w")], capture_output=True, text=True, env=env)
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1 and "did not make" in r.stderr
    assert (mine / "notes.txt").read_text() == "keep me"
    (tmp_path / "w" / "main").mkdir(parents=True)
    (tmp_path / "w" / "main" / "x").write_text("keep")
    r = subprocess.run(["bash", str(script), "build", "main", str(tmp_path / "new-site"), str(tmp_path / "w")], capture_output=True,
                       text=True, env=env)
    assert r.returncode != 0 and "WORK/main" in r.stderr and (tmp_path / "w" / "main" / "x").read_text() == "keep"


def test_report_shows_its_host_and_device_memory():
    """MoE-Infinity has no counted budget and allocates outside torch: the held column shows its
    peak RSS and the device's memory in use, not torch's allocator peak."""
    from zipmoe.runtime.bench import report

    row = {"engine": "moe-infinity", "peak_counted_bytes": None, "cuda_peak_bytes": 1 << 20,
           "gpu_used_bytes": 5 << 30, "peak_rss_run_bytes": {"median": 12 << 30}}
    held = report._fmt_held(row)
    assert held.startswith("rss ") and " · dev " in held and "12" in held and "5" in held.split("dev ")[1]
    zipmoe_row = {"engine": "zipmoe", "peak_counted_bytes": 3 << 30, "cuda_peak_bytes": 3 << 30, "gpu_used_bytes": 4 << 30,
                  "peak_rss_run_bytes": {"median": 2 << 30}}
    assert "rss" not in report._fmt_held(zipmoe_row) and "dev" not in report._fmt_held(zipmoe_row)


def test_diagnose_prints_the_native_backtrace_of_a_crash(tmp_path):
    """`moe_infinity_build.sh diagnose`: a fake MoE-Infinity that dies of SIGSEGV in native code
    (as the real one does in set_topology on the H200 box, docs/benchmarks.md §26) is reported with
    the signal, the thread and a backtrace that names the native function."""
    import shutil

    if shutil.which("gcc") is None or shutil.which("addr2line") is None:
        pytest.fail("the diagnose command needs gcc and addr2line (binutils), as the GPU box has")
    site = _site(tmp_path / "site", "import ctypes\nclass MoE:\n    def __init__(self, *a, **k):\n"
                                    "        print('[INFO] converting', flush=True)\n        ctypes.string_at(0)\n")
    view = tmp_path / "view"
    view.mkdir()
    (view / "config.json").write_text("{}")
    script = Path(__file__).parents[1] / mi.BUILD
    r = subprocess.run(["bash", str(script), "diagnose", str(site), str(view), str(tmp_path / "store"), str(tmp_path / "work")],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHON=sys.executable))
    assert r.returncode != 0
    assert "exit status 139" in r.stdout and "[INFO] converting" in r.stdout and "@@crash signal 11" in r.stdout, r.stdout + r.stderr
    assert "string_at" in r.stdout or "strlen" in r.stdout  # the frames are resolved to function names
    assert (tmp_path / "work" / "diagnose.log").is_file()


def test_a_worker_killed_by_a_signal_names_it_and_for_moe_infinity_the_diagnosis():
    from zipmoe.runtime.bench.run import no_report_error

    spec = {"engine": "moe-infinity", "moe_infinity_site": "/tmp/moei-site-main", "offload_folder": "/w/offload/moe-infinity-8G"}
    line = no_report_error(spec, -11)
    assert line.startswith("worker exited with status -11 (SIGSEGV) and no report; to see where it crashed: ")
    assert f"{mi.BUILD} diagnose /tmp/moei-site-main /w/offload/moe-infinity-view /w/offload/moe-infinity-store" in line
    assert no_report_error({"engine": "zipmoe"}, -9) == "worker exited with status -9 (SIGKILL) and no report"
    assert no_report_error({"engine": "moe-infinity"}, 1) == "worker exited with status 1 and no report"
