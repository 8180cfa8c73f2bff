"""``zipmoe.load``: a transformers model whose experts are served from a .zmoe container.

Steps (each a function below):

1. resolve the device (``auto`` -> CUDA when available; ``cuda`` without one -> DeviceError);
2. open the container, recognise the family (ModelError listing the supported ones);
3. write the embedded files (config.json, tokenizer files, generation config) to a temporary
   folder and read config, tokenizer and generation config from it with transformers;
4. build the model skeleton with every *parameter* on the meta device (buffers, such as rotary
   ``inv_freq``, are computed for real in ``__init__``): :func:`params_on_meta`; fused families
   are built with ``experts_implementation="zipmoe"`` (see :mod:`.experts_hook`);
5. decode the dense tensors from the container, rename them the way transformers' own loader
   does (its conversion mapping, e.g. Mixtral's ``block_sparse_moe`` -> ``mlp``), cast them
   to the dtype transformers would give them, and assign them (``load_state_dict(assign=True)``);
   tie weights; every parameter that is not an expert weight must now be real (ModelError
   otherwise). Expert parameters stay on meta and are never touched;
6. build the :class:`~zipmoe.runtime.engine.core.Runtime` under the budget and attach it:
   ``model.zipmoe``, and ``module._zipmoe_runtime`` / ``_zipmoe_layer`` on each experts module
   (SwitchTransformers' experts modules are replaced by :class:`.experts_hook.SwitchExperts`).
"""

from __future__ import annotations

import contextlib
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch

from zipmoe.errors import ContainerError, ModelError, UsageError
from zipmoe import machine
from zipmoe.units import parse_size

from zipmoe.runtime.engine import dtypes
from zipmoe.runtime.engine.experts_hook import FAST_IMPLEMENTATION, IMPLEMENTATION, SwitchExperts, register
from zipmoe.runtime.engine.families import Family, family_for
from zipmoe.runtime.engine.settings import EngineSettings

__all__ = ["load", "requirements", "resolve_device", "params_on_meta"]

_NP = {"BF16": np.int16, "F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8,
       "I16": np.int16, "I32": np.int32, "I64": np.int64, "U8": np.uint8, "BOOL": np.bool_}
_TORCH = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
          "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "U8": torch.uint8,
          "BOOL": torch.bool}


def resolve_device(device) -> torch.device:
    """:func:`zipmoe.machine.resolve_device` as a ``torch.device``."""
    return torch.device(machine.resolve_device(device))


_META = threading.local()  # .on: this thread's parameters go to the meta device (params_on_meta)


def _param_to_meta(module, name, param):
    """PyTorch's parameter-registration hook: on the loading thread only, the parameter's meta copy."""
    if not getattr(_META, "on", False) or param is None or param.device.type == "meta":
        return None
    p = type(param)(param.to("meta"), requires_grad=param.requires_grad)
    p.__dict__.update(param.__dict__)
    return p


@contextlib.contextmanager
def params_on_meta():
    """Every parameter this thread registers inside the block lands on the meta device; buffers
    stay real (the rotary ``inv_freq`` computed in ``__init__``). Through PyTorch's own hook
    (``register_module_parameter_registration_hook``, removed on exit) and limited to the calling
    thread: nothing is patched, and modules other threads build meanwhile are untouched."""
    from torch.nn.modules.module import register_module_parameter_registration_hook

    handle = register_module_parameter_registration_hook(_param_to_meta)
    prev = getattr(_META, "on", False)
    _META.on = True
    try:
        yield
    finally:
        _META.on = prev
        handle.remove()


def _tensor_of(reader, entry) -> torch.Tensor:
    raw = reader.decode_entry(entry)
    if entry.dtype not in _TORCH:
        raise ModelError(f"dense tensor {entry.name} has dtype {entry.dtype}, which the runtime cannot load")
    arr = raw.view(_NP[entry.dtype]).reshape(tuple(entry.shape))
    t = torch.from_numpy(arr)
    if entry.dtype == "BF16":
        t = t.view(torch.bfloat16)
    return t


def _renamer(model):
    """checkpoint name -> model state_dict name, with transformers' own conversion mapping."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        transforms = get_model_conversion_mapping(model)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
    except Exception:  # pragma: no cover - older/newer transformers
        renamings, converters, rename_source_key = [], [], None
    keys = set(model.state_dict().keys())
    prefix = getattr(model, "base_model_prefix", None)

    def rename(name: str) -> str:
        if name in keys:
            return name
        if rename_source_key is not None:
            try:
                new, _ = rename_source_key(name, renamings, converters, prefix, {k: True for k in keys})
                if new in keys:
                    return new
            except Exception:  # pragma: no cover
                pass
        if prefix and f"{prefix}.{name}" in keys:
            return f"{prefix}.{name}"
        return name

    return rename


def _fp32_keep(model) -> list[str]:
    keep = []
    for attr in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"):
        v = getattr(model, attr, None)
        if v:
            keep.extend(v)
    return keep


def _experts_modules(model, family: Family, config: dict):
    """[(qualified name, module, layer number)] of the sparse layers' experts modules."""
    from zipmoe.codecs.naming import classify

    found = []
    for name, mod in model.named_modules():
        if family.kind == "fused":
            ok = name.endswith("experts") and hasattr(mod, "gate_up_proj") and hasattr(mod, "down_proj")
        else:
            ok = type(mod).__name__ == "SwitchTransformersExperts"
        if not ok:
            continue
        probe = f"{name}.0.down_proj.weight" if family.kind == "fused" else f"{name}.expert_0.wo.weight"
        role = classify(probe, (1, 1), config)
        if role.layer is None:
            raise ModelError(f"cannot tell the layer number of {name}")
        found.append((name, mod, role.layer))
    if not found:
        raise ModelError(f"found no experts modules in the {family.name} model")
    return found


def load(path, budget="8G", device="auto", plan=None, *, workers: int | None = None, threads: int | None = None,
         direct_io: bool | None = None, warm: bool = False, trace=None, dtype="bfloat16", slots=None,
         kernels: str | None = None, cache_age: int | None = None, readers: int | None = None,
         prefetch: bool | None = None, force: bool | None = None, attention: str | None = None,
         settings: EngineSettings | None = None):
    """Load ``path`` (.zmoe) as ``(model, tokenizer)`` with experts served under ``budget``.

    ``budget``: bytes or a size string ("8G"); it bounds every weight byte the runtime holds
    (dense weights, cache pools, in-flight buffers). ``device``: ``auto`` | ``cpu`` | ``cuda``.
    ``plan``: a plan.json path (or dict) from ``zipmoe plan``: pool sizes. ``threads``: when
    given, ``torch.set_num_threads(threads)`` (the CLI always passes one; the library leaves the
    caller's setting alone otherwise). ``warm``: fill the full pool before returning. ``trace``:
    start an activation trace file. ``dtype``: the dtype the model computes in: ``"bfloat16"``
    (default; the bit-identity reference is ``from_pretrained(..., dtype=torch.bfloat16)``),
    ``"float32"``, or ``"auto"`` (config.json's ``dtype``, as ``from_pretrained(dtype="auto")``).
    Weights stay bf16 in the container and the cache's compressed pools; float32 experts are
    converted (exactly) after the merge, and the full pool holds them as float32.

    The engine's switches are an :class:`~zipmoe.runtime.engine.settings.EngineSettings`
    (``settings``; every field documented there): ``workers`` (decode threads), ``readers``
    (queue depth of expert reads), ``direct_io``, ``prefetch`` (None: on for CUDA, off on the
    CPU), ``slots`` (None: on CUDA), ``kernels`` (``"exact"``: the experts as transformers'
    eager loop computes them, bit for bit; ``"fast"``: transformers' grouped_mm over the slots,
    every expert resident), ``cache_age``, ``force`` (load even when the process's memory limit
    is below its baseline + the budget + the KV cache; otherwise BudgetError says so with the
    figures), ``graphs`` and ``batched_sparse`` (the decode loop's CUDA graphs), ``attention``
    (``"reproducible"``: on CUDA, no cuDNN attention kernel, whose bits change from run to run;
    ``"pytorch"``: PyTorch's own choice). The keyword
    arguments of the same names override the fields of ``settings``. Nothing here reads the
    environment: the command line does (docs/architecture.md, "Environment variables").
    The tokenizer is None when the container has no tokenizer files.
    """
    from zipmoe.codecs.reader import ContainerReader

    base = settings if settings is not None else EngineSettings()
    st = base.with_(workers=workers, readers=readers, direct_io=direct_io, prefetch=prefetch, slots=slots,
                    kernels=kernels, cache_age=cache_age, force=force, attention=attention)
    if st.kernels == "fast":
        st = st.with_(slots=True)
        warm = True
    budget_bytes = parse_size(budget) if isinstance(budget, str) else int(budget)
    dev = resolve_device(device)
    if st.workers is None:
        st = st.with_(workers=machine.decode_workers())
    if threads is not None:
        if int(threads) < 1:
            raise UsageError("--threads must be at least 1")
        torch.set_num_threads(int(threads))
    path = Path(path)
    if not path.exists():
        raise ContainerError(f"{path}: no such file")
    reader = ContainerReader(path)
    try:
        return _load(reader, path, budget_bytes, dev, plan, st, warm, trace, dtype)
    finally:
        reader.close()


def requirements(path, *, workers: int | None = None, device="cpu", dtype="bfloat16") -> dict:
    """What serving ``path`` needs, without loading it: bytes of dense weights, of all experts
    (bf16 and stored), of the working set, the smallest budget, and a helper for budgets.

    Returns ``{"dense_bytes", "expert_bytes_full", "expert_bytes_stored", "min_budget",
    "working_bytes" (at the default window), "num_expert_tensors", "budget_for": fn(fraction)}``
    where ``budget_for(f)`` is the budget whose pools hold the fraction ``f`` of the experts'
    bf16 bytes (on top of dense weights and the default working set).
    """
    from zipmoe.codecs.reader import ContainerReader

    st = EngineSettings(workers=machine.decode_workers() if workers is None else int(workers))
    with ContainerReader(path) as reader:
        return _load(reader, Path(path), 1 << 62, resolve_device(device), None, st, False, None, dtype, dry=True)


def resolve_dtype(dtype, cfg: dict) -> torch.dtype:
    """:func:`zipmoe.runtime.engine.dtypes.compute_dtype` as a torch dtype (a torch dtype passes through)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    return getattr(torch, dtypes.compute_dtype(dtype, cfg))


def _load(reader, path, budget_bytes, dev, plan, st: EngineSettings, warm, trace, dtype="bfloat16", dry=False):
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer, GenerationConfig

    cfg_dict = reader.config
    if not cfg_dict:
        raise ModelError(f"{path} has no config.json: it cannot be served")
    family = family_for(cfg_dict, reader.meta)
    register()

    with tempfile.TemporaryDirectory(prefix="zipmoe-") as tmp:
        for name in reader.files:
            Path(tmp, name).write_bytes(reader.read_file(name))
        try:
            config = AutoConfig.from_pretrained(tmp)
        except Exception as exc:
            raise ModelError(f"transformers cannot read this model's config.json: {exc}") from None
        tokenizer = None
        if any(n.startswith(("tokenizer", "vocab", "spiece", "merges")) for n in reader.files):
            try:
                tokenizer = AutoTokenizer.from_pretrained(tmp)
            except Exception as exc:  # a model without a usable tokenizer still serves ids
                tokenizer = None
                transformers.logging.get_logger(__name__).warning(f"tokenizer not loaded: {exc}")
        gen_config = None
        if "generation_config.json" in reader.files:
            try:
                gen_config = GenerationConfig.from_pretrained(tmp)
            except Exception:
                gen_config = None

    auto = AutoModelForSeq2SeqLM if family.auto == "seq2seq" else AutoModelForCausalLM
    compute_dtype = resolve_dtype(dtype, cfg_dict)
    kwargs = {"dtype": compute_dtype}
    if family.kind == "fused":
        kwargs["experts_implementation"] = FAST_IMPLEMENTATION if st.kernels == "fast" else IMPLEMENTATION
    elif st.kernels == "fast":
        raise UsageError(f"--kernels fast serves the fused families only, not {family.name}")
    with params_on_meta():
        model = auto.from_config(config, **kwargs)
    # parameters keep requires_grad=True, as from_pretrained leaves them: aten's linear picks
    # its kernel path (folding a 3-D input into one GEMM or not) partly by requires_grad, so
    # a frozen copy can differ from the reference in the last bit (seen on fp32 lm_head)
    model.eval()
    if gen_config is not None:
        model.generation_config = gen_config

    # --- dense weights
    rename = _renamer(model)
    sd_meta = model.state_dict(keep_vars=True)
    keep32 = _fp32_keep(model)
    experts = _experts_modules(model, family, cfg_dict)
    expert_prefixes = tuple(f"{name}." for name, _, _ in experts)
    to_load = []
    for entry in reader.dense_entries():
        key = rename(entry.name)
        target = sd_meta.get(key)
        if target is None:
            continue  # e.g. rotary inv_freq saved by old exporters; transformers ignores these too
        if tuple(entry.shape) != tuple(target.shape):  # before anything is decoded
            raise ModelError(f"tensor {entry.name} has shape {list(entry.shape)}; the model expects {list(target.shape)}")
        to_load.append((entry, key, target))
    from zipmoe.runtime.engine.staging import cuda_block_bytes

    dense_bytes = 0
    seen = set()
    for entry, key, target in to_load:
        dtype = target.dtype
        if any(k in key for k in keep32) and dtype.is_floating_point:
            dtype = torch.float32
        if key not in seen:
            nbytes = target.numel() * torch.empty((), dtype=dtype).element_size()
            dense_bytes += cuda_block_bytes(nbytes) if dev.type == "cuda" else nbytes  # as allocated
            seen.add(key)

    # --- expert tensors and the budget check, before decoding anything large
    from zipmoe.runtime.engine.core import Runtime
    from zipmoe.runtime.engine.tensors import build_expert_tensors

    expected = {}
    for name, mod, layer in experts:
        if family.kind == "fused":
            expected[layer] = {"gate_up": tuple(mod.gate_up_proj.shape[1:]), "down": tuple(mod.down_proj.shape[1:])}
        else:
            e0 = mod["expert_0"]
            expected[layer] = {"up": tuple(e0.wi.weight.shape), "down": tuple(e0.wo.weight.shape)}
    if family.kind == "fused":
        expert_dtype = experts[0][1].gate_up_proj.dtype
    else:
        expert_dtype = experts[0][1]["expert_0"].wi.weight.dtype
    itemsize = torch.empty((), dtype=expert_dtype).element_size()
    expert_tensors = build_expert_tensors(reader.entries, family, expected, compute_itemsize=itemsize)
    num_experts = experts[0][1].num_experts if hasattr(experts[0][1], "num_experts") else len(experts[0][1])
    for name, mod, layer in experts:
        for e in range(num_experts):
            if (layer, e) not in expert_tensors:
                raise ModelError(f"the container has no weights for layer {layer} expert {e}")
    meta_model = reader.meta.get("model") or {}
    if dry:
        from zipmoe.runtime.engine.core import dry_requirements

        return dry_requirements(expert_tensors, dense_bytes, st.workers, dev.type == "cuda")
    from zipmoe.runtime.engine.memlimit import check as check_memory, kv_cache_bytes

    kv = kv_cache_bytes(cfg_dict, torch.empty((), dtype=compute_dtype).element_size())
    memory = check_memory(budget_bytes, kv, force=st.force)
    rt = Runtime(
        path=path, container_id=reader.container_id, meta=reader.meta, family=family, device=dev,
        expert_tensors=expert_tensors, sparse_layers=[layer for _, _, layer in experts], num_experts=num_experts,
        top_k=int(meta_model.get("top_k") or _top_k(cfg_dict)),
        num_layers=int(meta_model.get("num_layers") or len(experts)), dense_bytes=dense_bytes,
        budget=budget_bytes, plan=plan, compute_dtype=expert_dtype, settings=st,
    )
    rt.memory_limit = memory
    if st.kernels == "fast" and rt.pools["full"] < rt.expert_bytes_full:
        from zipmoe.units import format_size

        need = budget_bytes + rt.expert_bytes_full - rt.pools["full"]
        rt.close()
        raise UsageError(f"--kernels fast needs every expert resident: a budget of at least {format_size(need)} "
                         f"({need} bytes), {format_size(budget_bytes)} was given")
    try:
        state = {}
        for entry, key, target in to_load:
            t = _tensor_of(reader, entry)
            dtype = target.dtype
            if any(k in key for k in keep32) and dtype.is_floating_point:
                dtype = torch.float32
            if tuple(t.shape) != tuple(target.shape):
                raise ModelError(f"tensor {entry.name} has shape {list(t.shape)}; the model expects {list(target.shape)}")
            state[key] = t if (t.dtype == dtype and dev.type == "cpu") else t.to(device=dev, dtype=dtype)
        model.load_state_dict(state, strict=False, assign=True)
        del state
        model.tie_weights()
        # buffers computed in __init__ go to the device too
        if dev.type != "cpu":
            for mod in model.modules():
                for bname, buf in list(mod._buffers.items()):
                    if buf is not None and buf.device != dev:
                        mod._buffers[bname] = buf.to(dev)
        # attach the runtime
        for name, mod, layer in experts:
            if family.kind == "fused":
                mod._zipmoe_runtime = rt
                mod._zipmoe_layer = layer
            else:
                parent_name, _, child = name.rpartition(".")
                parent = model.get_submodule(parent_name)
                e0 = mod["expert_0"]
                setattr(parent, child, SwitchExperts(rt, layer, len(mod), e0.wi.weight.shape[1], e0.act, e0.dropout.p))
        for n, p in model.named_parameters():
            if p.device.type != "meta" and p.is_floating_point():
                p.requires_grad_(True)
        missing = [
            n for n, p in model.named_parameters(remove_duplicate=False)
            if p.device.type == "meta" and not (family.kind == "fused" and n.startswith(expert_prefixes))
        ]
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise ModelError(f"the container lacks dense weights the model needs: {', '.join(missing[:3])}{more}")
        model.eval()  # the replacement modules too (SwitchExperts has a dropout)
        _attach_predictor(model, rt, experts, num_experts)
        model.zipmoe = rt
        model.register_forward_pre_hook(lambda _m, args, kwargs: rt.begin_step(_input_shape(args, kwargs)), with_kwargs=True)
        model.register_forward_hook(lambda *_: rt.end_step())
        if warm:
            rt.warm()
        if trace is not None:
            rt.start_trace(trace)
    except BaseException:
        rt.close()
        raise
    return model, tokenizer


def _attach_predictor(model, rt, experts, num_experts: int) -> None:
    """The prefetch predictor from the sparse layers' routers (``serve.prefetch``); none when
    every expert fits whole in the full pool (nothing to prefetch) or a router is not found."""
    from zipmoe.runtime.engine.prefetch import RouterPredictor, find_router

    if rt.pools.get("full", 0) >= rt.expert_bytes_full:
        return
    routers = {}
    for name, _mod, layer in experts:
        w = find_router(name, model, num_experts)
        if w is not None:
            routers[layer] = w
    if routers:
        rt.predictor = RouterPredictor(routers, [layer for _, _, layer in experts], rt.top_k)


def _input_shape(args, kwargs) -> list | None:
    """``[batch, sequence]`` of a forward call's input ids (or embeddings; for an encoder-decoder
    generating, the decoder's), for the trace."""
    x = None
    for key in ("input_ids", "inputs_embeds", "decoder_input_ids"):
        if kwargs.get(key) is not None:
            x = kwargs[key]
            break
    if x is None and args:
        x = args[0]
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) < 2:
        return None
    return [int(shape[0]), int(shape[1])]


def _top_k(cfg: dict) -> int:
    for k in ("num_experts_per_tok", "top_k", "moe_topk"):
        v = cfg.get(k)
        if isinstance(v, int):
            return v
    return 1
