"""The ``moe-infinity`` engine of `zipmoe bench`: MoE-Infinity (EfficientMoE/MoE-Infinity), the
offloading MoE server the paper compares with, for users who have it installed.

Its PyPI package ``moe-infinity`` (0.0.1.dev0) is a placeholder: an empty ``moe_infinity``
module. The real package is built from its source release (C++/CUDA extensions, a CUDA GPU);
docs/bench.md records what was tried. The engine is selectable: with the real package and a
GPU it loads ``moe_infinity.MoE(source, {"offload_path": ..., "device_memory_ratio": ...})``
(the budget as a share of the GPU's memory) and decodes with its ``generate``; otherwise it
fails with one line saying which of these is missing.
"""

from __future__ import annotations

from zipmoe.errors import DeviceError, UsageError

EXTRA_LINE = ("baseline 'moe-infinity' needs MoE-Infinity built from its source release (github.com/EfficientMoE/MoE-Infinity; "
              "the PyPI package moe-infinity is an empty placeholder, so zipmoe[baselines] cannot install it)")


def missing() -> str | None:
    """None when a working moe_infinity is importable, else the one line."""
    import importlib.util

    spec = importlib.util.find_spec("moe_infinity")
    if spec is None:
        return EXTRA_LINE
    try:
        import moe_infinity
    except Exception as exc:  # noqa: BLE001
        return f"baseline 'moe-infinity': moe_infinity is installed but does not import ({type(exc).__name__}: {exc})"
    if not hasattr(moe_infinity, "MoE"):
        return "baseline 'moe-infinity': the installed moe_infinity is the PyPI placeholder (no MoE class); " + EXTRA_LINE.split("needs ", 1)[1]
    return None


def before_load(spec: dict) -> dict:
    why = missing()
    if why:
        raise UsageError(why)
    if spec["device"] != "cuda":
        raise DeviceError("baseline 'moe-infinity' runs on a CUDA GPU only (its expert cache lives in GPU memory): use --device cuda")
    import moe_infinity

    return {"moe_infinity": getattr(moe_infinity, "__version__", "?")}


def load(spec: dict, info: dict):
    import os

    import torch
    from moe_infinity import MoE

    total = torch.cuda.get_device_properties(0).total_memory
    ratio = max(0.01, min(0.95, int(spec["budget"]) / total))
    offload = os.path.join(spec["offload_folder"], "moe-infinity")
    os.makedirs(offload, exist_ok=True)
    cfg = {"offload_path": offload, "device_memory_ratio": ratio}
    model = MoE(spec["source"], cfg)
    info.update(path=spec["source"], moe_infinity_config=cfg)
    inner = getattr(model, "model", None)
    if inner is not None and not hasattr(model, "device"):
        model.device = getattr(inner, "device", torch.device("cuda", 0))
    return model, info
