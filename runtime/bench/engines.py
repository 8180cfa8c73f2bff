"""The engines `zipmoe bench` compares, and how each one is loaded inside its worker process.

| engine | what it is | loaded with |
|---|---|---|
| ``zipmoe`` | the runtime with its plan (+planning) | ``zipmoe.load(container, budget, device, plan=plan.json)`` |
| ``zipmoe-pools`` | ablation: heterogeneous pools, default split, no plan | ``zipmoe.load(container, budget, device, plan=None)`` |
| ``zipmoe-noprefetch`` | ablation: the plan, no prefetch across layers | ``zipmoe.load(container, budget, device, plan=PLAN, prefetch=False)`` |
| ``zipmoe-basic`` | ablation: basic eviction only (one pool of full tensors) | ``zipmoe.load(..., plan={"pools": {"full": ...}})`` |
| ``uncompressed`` | the runtime on a container written with codec ``raw``, full-tensor pool | ``zipmoe.load(raw_container, budget, device, plan={"pools": {"full": ...}})`` |
| ``accelerate`` | Hugging Face disk offload of the same model | ``from_pretrained(source, device_map="auto", max_memory=..., offload_folder=...)`` |
| ``resident`` | everything in memory, no budget (the ceiling and the token reference) | ``from_pretrained(source, device_map={"": device})`` |

The zipmoe engines only use the public ``zipmoe.load`` keyword arguments; an option the
runtime does not accept yet makes :func:`check_runtime_options` say precisely which one.
The Hugging Face engines load with ``experts_implementation="eager"`` where the installed
transformers knows it (the reference the runtime is bit-identical to) and ``dtype="auto"``.

This module imports torch/transformers lazily: the parent process of `zipmoe bench` uses
only the table and the checks, the worker process does the loading.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from zipmoe.errors import UsageError


@dataclass(frozen=True)
class EngineSpec:
    name: str
    kind: str  # "zipmoe" (zipmoe.load) or "hf" (transformers from_pretrained)
    needs: str  # "container", "raw_container" or "source"
    budgeted: bool  # runs under the budget (and its cgroup)
    extra: str | None  # the pip extra that installs what it needs
    doc: str


ENGINES: dict[str, EngineSpec] = {
    e.name: e
    for e in (
        EngineSpec("zipmoe", "zipmoe", "container", True, None, "zipmoe runtime with plan (+planning)"),
        EngineSpec("zipmoe-default", "zipmoe", "container", True, None, "zipmoe without --plan: the plan chat and serve fit at load (runtime/plan/default.py)"),
        EngineSpec("zipmoe-pools", "zipmoe", "container", True, None, "ablation: heterogeneous pools, the runtime's fixed 60/40 split, no plan"),
        EngineSpec("zipmoe-basic", "zipmoe", "container", True, None, "ablation: basic eviction only (full-tensor pool)"),
        EngineSpec("zipmoe-noprefetch", "zipmoe", "container", True, None, "ablation: the plan without prefetch across layers"),
        EngineSpec("uncompressed", "zipmoe", "raw_container", True, None, "zipmoe runtime on a codec-raw container (no compression)"),
        EngineSpec("accelerate", "hf", "source", True, "bench", "transformers + accelerate disk offload (device_map=auto, max_memory, offload_folder)"),
        EngineSpec("resident", "hf", "source", False, None, "transformers, every weight in memory (no budget)"),
        EngineSpec("deepspeed", "deepspeed", "source", True, "baselines", "DeepSpeed ZeRO-Inference: ZeRO-3, parameters offloaded to NVMe (async I/O) or CPU memory"),
        EngineSpec("llama.cpp", "llama.cpp", "gguf", True, "baselines", "llama-cpp-python serving the model as a bf16 GGUF, memory-mapped"),
        EngineSpec("moe-infinity", "moe-infinity", "source", True, "baselines", "MoE-Infinity (built from source; CUDA only)"),
    )
}
BASELINES = ("accelerate", "uncompressed", "resident", "deepspeed", "llama.cpp", "moe-infinity")
# engines whose code lives in their own module (runtime/bench/<module>.py: before_load, load)
ENGINE_MODULES = {"deepspeed": "deepspeed_engine", "llama.cpp": "llamacpp_engine", "moe-infinity": "moe_infinity_engine"}
ABLATIONS = ("zipmoe-basic", "zipmoe-pools", "zipmoe-noprefetch", "zipmoe")

# The plan each zipmoe engine passes to zipmoe.load (a dict is accepted like plan.json; the
# runtime scales pools larger than what the budget leaves down to it, keeping their shape).
FULL_ONLY_PLAN = {"pools": {"full": 1 << 60, "compressed": 0, "sm_only": 0, "e_only": 0}}
ENGINE_PLAN: dict[str, str] = {
    "zipmoe": "user",  # --plan plan.json (or the runtime's default split when none is given)
    "zipmoe-default": "fitted",  # the default plan of chat and serve, fitted at load (profile + earlier runs' statistics)
    "zipmoe-pools": "default",  # the runtime's own heterogeneous split (zipmoe.load without a plan)
    "zipmoe-basic": "full_only",  # basic eviction only: one pool of full bf16 tensors
    "zipmoe-noprefetch": "user",  # the plan, prefetch across layers off
    "uncompressed": "full_only",  # codec raw: a "compressed" entry would be as large as a full one
}
# What every engine computes in: the checkpoint's dtype (zipmoe.load(dtype=...), from_pretrained(dtype=...)).
BENCH_DTYPE = "auto"
# Options zipmoe.load must accept for the bench (beyond path, budget, device, plan).
RUNTIME_OPTIONS: dict[str, tuple] = {name: () for name in ENGINE_PLAN}


def engine(name: str) -> EngineSpec:
    try:
        return ENGINES[name]
    except KeyError:
        raise UsageError(f"unknown engine {name!r}: choose from {', '.join(ENGINES)}") from None


def missing_extra(name: str, moe_infinity_site: str | None = None) -> str | None:
    """A one-line reason when the engine's Python packages are missing, else None (MoE-Infinity:
    in its own environment, ``moe_infinity_site`` first on the path; see moe_infinity_engine)."""
    spec = engine(name)
    import importlib.util

    if spec.name == "accelerate":
        if importlib.util.find_spec("accelerate") is None:
            return "baseline 'accelerate' needs the accelerate package: pip install 'zipmoe[bench]'"
    if spec.name == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        from zipmoe.runtime.bench.deepspeed_engine import EXTRA_LINE

        return EXTRA_LINE
    if spec.name == "llama.cpp":
        if importlib.util.find_spec("llama_cpp") is None:
            from zipmoe.runtime.bench.llamacpp_engine import EXTRA_LINE

            return EXTRA_LINE
    if spec.name == "moe-infinity":
        from zipmoe.runtime.bench.moe_infinity_engine import missing

        return missing(moe_infinity_site)
    return None


def _engine_module(name: str):
    import importlib

    return importlib.import_module(f"zipmoe.runtime.bench.{ENGINE_MODULES[name]}")


def before_load(spec: dict) -> dict:
    """In the worker, before its cgroup is tightened to the budget: import what the engine needs
    (it belongs to the process's own baseline, as torch does) and say how it will run; a
    ``budget_broken`` key says why the engine cannot keep the budget (it then runs outside it)."""
    name = spec["engine"]
    if name not in ENGINE_MODULES:
        return {}
    return _engine_module(name).before_load(spec)


def _load_fn():
    """runtime.engine.loader.load (what zipmoe.load forwards to; its signature lists the options)."""
    try:
        from zipmoe.runtime.engine import loader
    except ImportError as exc:
        raise UsageError(f"the zipmoe runtime is not available in this build ({exc})") from None
    return loader.load


def check_runtime_options(name: str) -> str | None:
    """None when ``zipmoe.load`` accepts what the engine needs, else the missing option, exactly."""
    spec = engine(name)
    if spec.kind != "zipmoe":
        return None
    try:
        fn = _load_fn()
    except UsageError as exc:
        return str(exc)
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    params = sig.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None  # accepts **kwargs: find out at load time
    for opt in RUNTIME_OPTIONS.get(name, ()):
        if opt not in params:
            return f"engine {name!r} needs zipmoe.load(..., {opt}=...) which the runtime does not accept yet"
    return None


def engine_plan(name: str, user_plan, container_id: str | None = None):
    """The ``plan`` argument for a zipmoe engine (a generated plan names its container)."""
    how = ENGINE_PLAN[name]
    if how == "user":
        return str(user_plan) if user_plan else None
    if how == "full_only":
        return dict(FULL_ONLY_PLAN, pools=dict(FULL_ONLY_PLAN["pools"]), container_id=container_id, source="zipmoe bench")
    return None


def container_id(path) -> str:
    from zipmoe.codecs.reader import ContainerReader

    with ContainerReader(path) as r:
        return r.container_id


# ----------------------------------------------------------------------------- in the worker


def _torch_dtype_kw(transformers) -> str:
    """``dtype`` (transformers >= 4.56/5.x) or the older ``torch_dtype``."""
    try:
        sig = inspect.signature(transformers.PreTrainedModel.from_pretrained)
        if "torch_dtype" in sig.parameters and "dtype" not in sig.parameters:
            return "torch_dtype"
    except (TypeError, ValueError):
        pass
    return "dtype"


def _auto_class(config: dict):
    import transformers

    if config.get("is_encoder_decoder"):
        return transformers.AutoModelForSeq2SeqLM
    return transformers.AutoModelForCausalLM


def hf_max_memory(budget: int, device: str) -> dict:
    """accelerate's max_memory for a budget: the whole budget on the device that computes.

    On CUDA every weight that does not fit the GPU share goes to disk ("cpu": 0); the host
    memory the cgroup allows on top (page cache of the offloaded files) only favours the
    baseline, so comparisons stay conservative.
    """
    if device == "cuda":
        return {0: int(budget), "cpu": 0}
    return {"cpu": int(budget)}


def rows_of(spec: dict) -> int:
    """The rows the default plan is fitted for: the cases' batch when every case has the same one,
    else 1 (``bench --batch 1,4`` loads once for both)."""
    rows = {int(c.get("batch") or 1) for c in spec.get("cases") or []}
    return rows.pop() if len(rows) == 1 else 1


def load_engine(spec: dict):
    """Load the engine described by the worker spec; returns (model, runtime or None, info dict)."""
    name = spec["engine"]
    es = engine(name)
    device = spec["device"]
    if es.kind == "zipmoe":
        from zipmoe.machine import decode_workers, torch_threads

        fn = _load_fn()  # runtime.engine.loader.load (a clear error when the runtime is missing)
        # the checkpoint's own dtype, as chat and serve compute and as the Hugging Face engines
        # load (dtype="auto"): every engine computes the same model (the demo is float32)
        kwargs = {"dtype": BENCH_DTYPE}
        if spec.get("threads"):
            kwargs["threads"] = int(spec["threads"])
        else:  # as chat, serve and the planner's passes: the cores the decode workers leave (torch's
            # default, every core, oversubscribes them with the workers: what the profile measured is not what ran)
            kwargs["threads"] = torch_threads(decode_workers())
        if "force" in inspect.signature(_load_fn()).parameters:
            # the engine runs in bench's own cgroup, whose limit bench sizes (budget + what the
            # process needs + a margin) and whose OOM kills it reports: not a user's limit to refuse
            kwargs["force"] = True
        if spec.get("readers"):  # what `zipmoe bench` read from ZIPMOE_READERS / ZIPMOE_PREFETCH
            kwargs["readers"] = int(spec["readers"])
        if spec.get("prefetch") is not None:
            kwargs["prefetch"] = bool(spec["prefetch"])
        if name == "zipmoe-noprefetch":
            kwargs["prefetch"] = False
        if spec.get("trace") and name == "zipmoe":
            kwargs["trace"] = spec["trace"]  # activation trace for `zipmoe plan --trace`
        path = spec["raw_container"] if es.needs == "raw_container" else spec["container"]
        line = None
        if ENGINE_PLAN[name] == "fitted":
            from zipmoe.runtime.plan.default import default_plan

            plan, line = default_plan(path, int(spec["budget"]), device, decode_workers(), spec.get("cache_dir"),
                                      readers=spec.get("readers"), profile_path=spec.get("profile"), dtype=BENCH_DTYPE,
                                      batch=rows_of(spec))
        else:
            plan = engine_plan(name, spec.get("plan"), container_id(path) if ENGINE_PLAN[name] == "full_only" else None)
        model, _tok = fn(path, budget=int(spec["budget"]), device=device, plan=plan, **kwargs)
        rt = getattr(model, "zipmoe", None)
        info = {"path": str(path), "plan": plan if not isinstance(plan, dict) else (plan.get("source") or "full-tensor pool only")}
        if line:
            info["default_plan"] = line
            if isinstance(plan, dict) and plan.get("pools"):
                info["default_plan_pools"] = plan["pools"]
        if rt is not None and hasattr(rt, "describe"):
            try:
                info["runtime"] = rt.describe()
            except Exception:
                pass
        return model, rt, info

    if es.kind == "llama.cpp":
        model, info = _engine_module(name).load(spec, dict(spec.get("before_load") or {}))
        return model, None, info
    if es.kind == "moe-infinity":
        model, info = _engine_module(name).load(spec, dict(spec.get("before_load") or {}))
        return model, None, info
    import transformers

    source = spec["source"]
    import json
    from pathlib import Path

    config = json.loads(Path(source, "config.json").read_text())
    cls = _auto_class(config)
    kw = {_torch_dtype_kw(transformers): BENCH_DTYPE}
    if name == "accelerate":
        kw.update(device_map="auto", max_memory=hf_max_memory(spec["budget"], device), offload_folder=spec["offload_folder"])
        # keep accelerate's state dict offload off: it would put the whole state dict on disk first
    else:
        kw.update(device_map={"": device})
    if name == "deepspeed":  # ZeRO-3 places the weights itself (zero.Init): no device_map
        kw.pop("device_map", None)
    info = {"path": str(source), "kwargs": {k: str(v) for k, v in kw.items()}}

    def from_pretrained():
        try:
            m = cls.from_pretrained(source, experts_implementation="eager", **kw)
            info["experts_implementation"] = "eager"
        except (TypeError, ValueError) as exc:
            if "experts_implementation" not in str(exc):
                raise
            m = cls.from_pretrained(source, **kw)
            info["experts_implementation"] = "default (this transformers has no experts_implementation)"
        return m

    if name == "deepspeed":
        info.update(spec.get("before_load") or {})
        model, info = _engine_module(name).load(spec, from_pretrained, info)
        return model, None, info
    model = from_pretrained()
    model.eval()
    if name == "accelerate":
        dm = getattr(model, "hf_device_map", {}) or {}
        placed: dict[str, int] = {}
        for v in dm.values():
            placed[str(v)] = placed.get(str(v), 0) + 1
        info["device_map_summary"] = placed
    return model, None, info
