"""The ``moe-infinity`` engine of `zipmoe bench`: MoE-Infinity (EfficientMoE/MoE-Infinity), the
offloading MoE server the paper compares with, run in an environment of its own.

Its PyPI package ``moe-infinity`` (0.0.1.dev0) is a placeholder: an empty ``moe_infinity``
module. The real package is built from its source (C++/CUDA extensions, a CUDA GPU) by
``benchmarks/moe_infinity_build.sh``, which installs it with the Python packages it pins
(transformers 4.53, pydantic 1.x, ...) into a folder of its own, the *site*. zipmoe's own
process never imports from that folder: only the engine's worker process gets it, first on
its ``PYTHONPATH`` (:func:`worker_env`), so there ``import transformers`` finds MoE-Infinity's
transformers, not zipmoe's. The parent checks the site by starting a probe process with the same
environment (:func:`probe`), and says in one line what is missing: no site and no package, a
folder that is not a site, the PyPI placeholder, a package that does not import.

In the worker: ``moe_infinity.MoE(view, {"offload_path": ..., "device_memory_ratio": ...})``
(the budget as a share of the GPU's memory: the only memory MoE-Infinity lets a user size) and
its ``generate``. ``view`` is the source checkpoint as transformers 4.x reads it
(:func:`checkpoint_view`: links to the same safetensors files, config.json with the legacy keys
``torch_dtype`` and ``rope_theta`` that transformers 5 writes as ``dtype`` and
``rope_parameters``). MoE-Infinity converts the checkpoint into its own tensor store in the
offload folder on its first load (one folder per model, shared by every budget) and keeps every
expert it has read in pinned host memory, a pool it sizes when it is compiled
(``HOST_MEMORY_RATIO`` of the machine's RAM): that memory is outside any budget, so the engine
runs outside bench's memory cgroup and says so (``budget_broken``); its host and GPU memory are
recorded beside zipmoe's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from zipmoe.errors import DeviceError, UsageError

BUILD = "benchmarks/moe_infinity_build.sh"
EXTRA_LINE = ("baseline 'moe-infinity' needs MoE-Infinity built from its source (github.com/EfficientMoE/MoE-Infinity) "
              f"into a folder of its own: {BUILD} makes one, give it with --moe-infinity-site DIR "
              "(the PyPI package moe-infinity is an empty placeholder, so zipmoe[baselines] cannot install it)")
BUDGET_BROKEN = ("MoE-Infinity keeps every expert it has read in pinned host memory, a pool sized when it is compiled "
                 "(HOST_MEMORY_RATIO of the machine's RAM); the budget sizes its GPU cache only (device_memory_ratio)")

# The probe process: :func:`inspect_here` in a process with the site first on PYTHONPATH
_PROBE = ("import json\nfrom zipmoe.runtime.bench.moe_infinity_engine import inspect_here\n"
          "print('@@probe ' + json.dumps(inspect_here()))")


def inspect_here() -> dict:
    """What this process imports: moe_infinity found (``found``), its file, ``has_moe`` (False:
    the PyPI placeholder), the transformers it imports, or the first line of the error. Run in
    the probe process and in the worker: never in bench's own process."""
    import importlib.util

    out = {"python": sys.version.split()[0]}
    try:
        spec = importlib.util.find_spec("moe_infinity")
        out["found"] = spec is not None
        if spec is not None:
            out["file"] = spec.origin
            import moe_infinity

            out["has_moe"] = hasattr(moe_infinity, "MoE")
            out["version"] = getattr(moe_infinity, "__version__", None)
        import transformers

        out["transformers"] = transformers.__version__
        out["transformers_file"] = transformers.__file__
    except BaseException as exc:  # noqa: BLE001  (a failing import is what is reported)
        out["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return out


def refusal(seen: dict) -> str | None:
    """The one line for what :func:`inspect_here` saw, None when MoE-Infinity is usable."""
    if seen.get("found") is False:
        return EXTRA_LINE
    if "error" in seen:
        return f"baseline 'moe-infinity': moe_infinity does not import in its environment ({seen['error']})"
    if not seen.get("has_moe"):
        return ("baseline 'moe-infinity': the moe_infinity found is the PyPI placeholder (no MoE class); "
                + EXTRA_LINE.split("needs ", 1)[1])
    return None


def worker_env(site: str | None, environ: dict | None = None) -> dict:
    """The environment of a process that runs MoE-Infinity: ``site`` first on ``PYTHONPATH``
    (before the interpreter's own site-packages, so its pinned transformers wins), the rest of
    ``environ`` (default: this process's) unchanged. Without a site: the environment as it is."""
    env = dict(os.environ if environ is None else environ)
    if site:
        rest = env.get("PYTHONPATH", "")
        env["PYTHONPATH"] = os.pathsep.join([str(Path(site).resolve())] + ([rest] if rest else []))
    return env


def probe(site: str | None, python: str | None = None, timeout_s: float = 180.0) -> dict:
    """:func:`inspect_here` in a child process with :func:`worker_env`: nothing of the site is
    imported here."""
    try:
        r = subprocess.run([python or sys.executable, "-c", _PROBE], env=worker_env(site), capture_output=True, text=True,
                           timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"the probe process failed ({type(exc).__name__}: {exc})"}
    for line in reversed(r.stdout.splitlines()):
        if line.startswith("@@probe "):
            return json.loads(line[len("@@probe "):])
    tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": f"the probe process exited with status {r.returncode} ({tail})"}


def missing(site: str | None = None) -> str | None:
    """None when MoE-Infinity imports in its environment (``site`` first, if given), else the one line."""
    if site is not None and not Path(site, "moe_infinity").is_dir():
        if not Path(site).is_dir():
            return f"baseline 'moe-infinity': --moe-infinity-site {site} is not a folder ({BUILD} makes one)"
        return f"baseline 'moe-infinity': --moe-infinity-site {site} holds no moe_infinity package ({BUILD} makes one)"
    return refusal(probe(site))


def before_load(spec: dict) -> dict:
    """In the worker (its own environment): import MoE-Infinity, check the GPU, say how it runs."""
    seen = inspect_here()
    why = refusal(seen)
    if why:
        raise UsageError(why)
    if spec["device"] != "cuda":
        raise DeviceError("baseline 'moe-infinity' runs on a CUDA GPU only (its expert cache lives in GPU memory): use --device cuda")
    return {"moe_infinity": seen.get("version") or "?", "moe_infinity_file": seen.get("file"),
            "transformers": seen.get("transformers"), "site": spec.get("moe_infinity_site"), "budget_broken": BUDGET_BROKEN}


LEGACY_KEYS = ("torch_dtype", "rope_theta")


def legacy_config(config: dict) -> dict:
    """config.json as transformers 4.x reads it: ``torch_dtype`` from ``dtype`` and ``rope_theta``
    from ``rope_parameters`` where only the transformers-5 names are there (nothing else changes)."""
    out = dict(config)
    if "torch_dtype" not in out and out.get("dtype"):
        out["torch_dtype"] = out["dtype"]
    rp = out.get("rope_parameters")
    if "rope_theta" not in out and isinstance(rp, dict) and "rope_theta" in rp:
        out["rope_theta"] = rp["rope_theta"]
    return out


def checkpoint_view(source: str | Path, folder: str | Path) -> Path:
    """A folder that is ``source`` for transformers 4.x: a symbolic link to each of its files but
    config.json, which is :func:`legacy_config` of the source's. The source is not touched."""
    source, folder = Path(source).resolve(), Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.name == "config.json" or not f.is_file():
            continue
        link = folder / f.name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(f)
    config = json.loads((source / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(legacy_config(config), indent=2))
    return folder


def store_folder(offload_folder: str | Path) -> Path:
    """MoE-Infinity's tensor store: one per model, beside bench's per-engine offload folders, so
    every budget reuses the store the first load wrote."""
    return Path(offload_folder).parent / "moe-infinity-store"


def crash_hint(spec: dict) -> str:
    """What to run when MoE-Infinity's worker died of a signal: the build script's ``diagnose``
    on the same site, checkpoint view and store (it prints the faulting thread's native backtrace)."""
    off = Path(spec.get("offload_folder") or "offload/moe-infinity")
    site = spec.get("moe_infinity_site") or "SITE"
    return (f"to see where it crashed: {BUILD} diagnose {site} {off.parent / 'moe-infinity-view'} "
            f"{store_folder(off)}")


def load(spec: dict, info: dict):
    import torch
    from moe_infinity import MoE

    from zipmoe.machine import gpu_used_bytes

    total = torch.cuda.get_device_properties(0).total_memory
    ratio = max(0.001, min(0.95, int(spec["budget"]) / total))
    store = store_folder(spec["offload_folder"])
    store.mkdir(parents=True, exist_ok=True)
    view = checkpoint_view(spec["source"], Path(spec["offload_folder"]).parent / "moe-infinity-view")
    cfg = {"offload_path": str(store), "device_memory_ratio": ratio}
    used0 = gpu_used_bytes(torch)
    model = MoE(str(view), cfg)
    info.update(path=spec["source"], view=str(view), moe_infinity_config=cfg, gpu_used_before_load_bytes=used0,
                gpu_used_after_load_bytes=gpu_used_bytes(torch))
    inner = getattr(model, "model", None)
    if not hasattr(model, "device"):
        model.device = torch.device("cuda", 0)
    if inner is not None and not hasattr(model, "config"):
        model.config = inner.config
    return model, info
