"""The ``deepspeed`` engine of `zipmoe bench`: DeepSpeed ZeRO-Inference (ZeRO stage 3 with the
parameters offloaded), the same transformers model, greedy decoding.

One process, no launcher and no MPI: :func:`single_process_env` sets what ``deepspeed.init_distributed``
reads for a world of one (``RANK=0``, ``WORLD_SIZE=1``, ``MASTER_ADDR``/``MASTER_PORT`` on
localhost, a free port). On a machine without CUDA DeepSpeed needs its CPU accelerator
(``DS_ACCELERATOR=cpu``, set here before deepspeed is imported); its gloo process group of one
then needs no shared-memory all-reduce op, so the JIT build of ``deepspeed_shm_comm`` (a minute
of g++ on two cores) is skipped.

Where the parameters go (``zero_optimization.offload_param``):

- ``nvme``: DeepSpeed's async-I/O op (``AsyncIOBuilder``: libaio, ``apt install libaio-dev``, or
  one built into a folder of its own by benchmarks/libaio_build.sh: ``zipmoe bench
  --deepspeed-libaio PREFIX`` calls :func:`use_libaio`, whose variables the build process and the
  worker inherit;
  JIT-compiled once into ~/.cache/torch_extensions; bench builds it with :func:`prepare` in a
  process of its own, outside every memory cgroup and under a time limit, before the worker
  starts: g++ inside the budgeted worker was killed by the cgroup, and a build killed while it
  holds torch's extension lock leaves every later load waiting on that lock) swaps every
  parameter to a folder (the engine's offload folder) and reads each module's parameters back
  into a pool of ``buffer_count`` buffers just before it runs. The buffers (largest parameter × count) and the
  live parameters are sized from the budget (:func:`ds_config`); no parameter stays resident.
  Loading is not budgeted: ZeRO-3's ``from_pretrained`` (zero.Init) reads checkpoint shards into
  host memory while it partitions them into the swap folder, and the demo model at 400M and
  800M was killed by the memory cgroup while loading. The worker therefore tightens this
  engine's cgroup to budget + baseline + margin once the model is loaded (``load_note`` in the
  result; ``deepspeed_load_in_budget`` in the worker spec, ``zipmoe bench --deepspeed-load-in-budget``,
  keeps the budget during loading too).
- ``cpu`` when the async-I/O op cannot be built here (or ``deepspeed_offload="cpu"`` in the spec,
  ``--deepspeed-offload cpu``; ``nvme`` insists on NVMe and fails with one line where it cannot be
  built): every parameter stays in host memory,
  which **breaks the budget**. The engine still runs, outside the budget (its memory cgroup is
  lifted to what the machine has, its peak is recorded) and the report marks it.

No zipmoe environment variable is read here: the worker spec carries the choices (from
:class:`~zipmoe.runtime.bench.run.BenchConfig`, which ``zipmoe bench`` fills from its options and
the ``ZIPMOE_BENCH_DEEPSPEED_*`` variables).
"""

from __future__ import annotations

import os
import socket

from zipmoe.errors import BudgetError, UsageError

EXTRA_LINE = "baseline 'deepspeed' needs the deepspeed package: pip install 'zipmoe[baselines]'"
BUDGET_BROKEN = "DeepSpeed kept every parameter in CPU memory (offload_param cpu: {why}), so it ran outside the budget"


LOAD_NOTE = ("DeepSpeed's ZeRO-3 from_pretrained holds checkpoint shards in host memory while it partitions them "
             "into the NVMe offload, so its memory cgroup is tightened to the budget once the model is loaded")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_process_env(device: str) -> dict:
    """The environment variables DeepSpeed needs for a world of one process (set if unset)."""
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_SIZE": "1", "CROSS_RANK": "0", "CROSS_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    env["DS_ACCELERATOR"] = "cuda" if device == "cuda" else "cpu"
    for k, v in env.items():
        os.environ.setdefault(k, v)
    return {k: os.environ[k] for k in env}


def import_deepspeed(device: str):
    """deepspeed, imported with the right accelerator; a missing package is one line naming the extra."""
    single_process_env(device)
    try:
        import deepspeed
    except ImportError:
        raise UsageError(EXTRA_LINE) from None
    except Exception as exc:  # noqa: BLE001  (deepspeed's import probes the machine; say what failed)
        raise UsageError(f"baseline 'deepspeed' cannot be imported here: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None
    from deepspeed.accelerator import get_accelerator

    want = "cuda" if device == "cuda" else "cpu"
    got = get_accelerator().device_name()
    if got != want:
        raise UsageError(f"baseline 'deepspeed' picked accelerator {got!r} instead of {want!r} (DS_ACCELERATOR={os.environ.get('DS_ACCELERATOR')})")
    return deepspeed


def aio_available() -> tuple[bool, str]:
    """(True, "") when DeepSpeed's async-I/O op can be built or is installed; else (False, why)."""
    try:
        from deepspeed.accelerator import get_accelerator

        builder = get_accelerator().create_op_builder("AsyncIOBuilder")
    except Exception as exc:  # noqa: BLE001
        return False, f"no AsyncIOBuilder ({type(exc).__name__})"
    if builder is None:
        return False, "this accelerator has no async_io op"
    try:
        ok = builder.is_compatible(verbose=False)
    except TypeError:
        ok = builder.is_compatible()
    except Exception as exc:  # noqa: BLE001
        return False, f"{type(exc).__name__}: {exc}"
    if not ok:
        return False, ("its NVMe offload needs the async_io op, which needs libaio (apt install libaio-dev, or one built "
                       "into a folder: benchmarks/libaio_build.sh, then --deepspeed-libaio PREFIX)")
    return True, ""


LIBAIO_FILES = ("include/libaio.h", "lib/libaio.so")


def check_libaio(prefix, what: str = "--deepspeed-libaio ") -> str | None:
    """The folder libaio was installed into (``make prefix=PREFIX install``, as
    benchmarks/libaio_build.sh does), absolute; None when unset. A folder without
    include/libaio.h or lib/libaio.so is one :class:`UsageError` line. Torch-free."""
    if prefix is None or str(prefix) == "":
        return None
    path = os.path.abspath(os.path.expanduser(str(prefix)))
    missing = [f for f in LIBAIO_FILES if not os.path.exists(os.path.join(path, f))]
    if missing:
        raise UsageError(f"{what}{str(prefix)!r}: no {' or '.join(missing)} there (a libaio prefix: "
                         f"benchmarks/libaio_build.sh build TARBALL PREFIX makes one)")
    return path


def libaio_env(prefix: str, environ=None) -> dict:
    """The environment variables with which DeepSpeed's async_io op builds and loads against the
    libaio under ``prefix`` (each in front of what ``environ``, default ``os.environ``, has):
    ``CFLAGS``/``LDFLAGS`` for ``is_compatible``'s test program (``has_function`` passes them to the
    compiler and linker), ``CPATH``/``LIBRARY_PATH`` for the op's JIT build (torch's ninja build
    reads neither CFLAGS nor LDFLAGS; gcc reads these), ``LD_RUN_PATH`` (the op's RUNPATH, so it
    finds libaio.so.1 in any process) and ``LD_LIBRARY_PATH``. Where ``prefix/cuda-lib`` exists
    (the build script's libcuda.so link for DeepSpeed's CUDA op's ``-lcuda``) it is on
    ``LIBRARY_PATH`` too. benchmarks/libaio_build.sh env prints the same."""
    environ = os.environ if environ is None else environ
    inc, lib = os.path.join(prefix, "include"), os.path.join(prefix, "lib")
    libs = [lib] + ([os.path.join(prefix, "cuda-lib")] if os.path.isdir(os.path.join(prefix, "cuda-lib")) else [])
    ahead = {"CFLAGS": (f"-I{inc}", " "), "LDFLAGS": (f"-L{lib} -Wl,-rpath,{lib}", " "), "CPATH": (inc, ":"),
             "LIBRARY_PATH": (":".join(libs), ":"), "LD_RUN_PATH": (lib, ":"), "LD_LIBRARY_PATH": (lib, ":")}
    return {k: v + (sep + environ[k] if environ.get(k) else "") for k, (v, sep) in ahead.items()}


def use_libaio(prefix) -> dict:
    """Put :func:`libaio_env` into this process's environment, which the op's build process
    (:func:`prepare`) and the engines' workers inherit; the variables set. ``zipmoe bench
    --deepspeed-libaio PREFIX`` calls it before anything runs."""
    env = libaio_env(check_libaio(prefix))
    os.environ.update(env)
    return env


def loaded_libaio() -> list[str]:
    """The libaio files mapped into this process (the one the loaded async_io op uses)."""
    try:
        with open("/proc/self/maps") as f:
            return sorted({ln.split()[-1] for ln in f if "libaio.so" in ln})
    except OSError:
        return []


OPS = ("AsyncIOBuilder", "PinMemoryBuilder")  # what the NVMe offload loads (the pinned buffers' op where the accelerator has one)
OP_DIRS = ("async_io", "pin_memory")  # their build folders (the builders' names)
BUILD_TIMEOUT_S = 1800.0


OFFLOADS = ("nvme", "cpu")


def check_offload(value, what: str = "--deepspeed-offload ") -> str | None:
    """Where the parameters go as asked: ``"nvme"``, ``"cpu"``, or None (``"auto"``, unset: NVMe
    where the async-I/O op can be built, else cpu); anything else is one :class:`UsageError` line."""
    if value is None or value == "" or value == "auto":
        return None
    if value not in OFFLOADS:
        raise UsageError(f"{what}{value!r}: use nvme or cpu, or auto (or leave it unset)")
    return value


def build_ops(device: str, offload: str | None = None) -> list[str]:
    """Build (or find built) the ops the NVMe offload loads; the names built. Nothing when the
    async-I/O op cannot be built here (the worker then says why) or ``offload`` is ``"cpu"``."""
    if check_offload(offload) == "cpu":
        return []
    import_deepspeed(device)
    if not aio_available()[0]:
        return []
    from deepspeed.accelerator import get_accelerator

    built = []
    for name in OPS:
        try:
            builder = get_accelerator().create_op_builder(name)
        except Exception:  # noqa: BLE001  (an accelerator without this op)
            builder = None
        if builder is not None and builder.is_compatible():
            builder.load(verbose=False)
            built.append(name)
    return built


def deepspeed_arch_list(value: str | None) -> str | None:
    """``TORCH_CUDA_ARCH_LIST`` as DeepSpeed 0.19's op builder can read it: it parses each entry
    as numbers (``int("0a")`` fails), so the architecture-specific suffixes CUDA 12+ images use
    (``9.0a``, ``10.0f``) become the plain compute capability (``9.0``: the op is plain C++ and
    CUDA runtime calls, nothing Hopper-specific); ``+PTX`` is kept. None when nothing changes."""
    if not value:
        return None
    out = []
    for cc in value.replace(" ", ";").split(";"):
        cc = cc.strip()
        if not cc:
            continue
        ptx = cc.endswith("+PTX")
        base = cc[:-4] if ptx else cc
        base = ".".join("".join(ch for ch in part if ch.isdigit()) or "0" for part in base.split("."))
        out.append(base + ("+PTX" if ptx else ""))
    fixed = ";".join(dict.fromkeys(out))
    return fixed if fixed != value else None


def prepare(device: str, log, timeout_s: float | None = None, offload: str | None = None) -> None:
    """Build DeepSpeed's NVMe ops in a process of its own (outside the memory cgroups), once per
    machine (torch caches them under ``TORCH_EXTENSIONS_DIR``, by default ~/.cache/torch_extensions).
    A build that fails or outlives ``timeout_s`` (default :data:`BUILD_TIMEOUT_S`) is one line; a
    build cut off by the time limit is killed with its compilers and its lock files are removed,
    so that no later load waits on them. Nothing to build when ``offload`` is ``"cpu"``."""
    import importlib.util
    import subprocess
    import sys

    from zipmoe.runtime.bench.procs import kill_tree

    if importlib.util.find_spec("deepspeed") is None:
        return  # the worker says which extra is missing
    if check_offload(offload) == "cpu":
        return
    timeout_s = timeout_s or BUILD_TIMEOUT_S
    fixed = deepspeed_arch_list(os.environ.get("TORCH_CUDA_ARCH_LIST"))
    if fixed is not None:  # inherited by the build process and every worker (their JIT load computes the same flags)
        log(f"deepspeed: TORCH_CUDA_ARCH_LIST {os.environ['TORCH_CUDA_ARCH_LIST']!r} read as {fixed!r} (DeepSpeed cannot parse suffixes)")
        os.environ["TORCH_CUDA_ARCH_LIST"] = fixed
    log("deepspeed: building its async-I/O ops (once per machine, cached by torch's extension builder)")
    proc = subprocess.Popen([sys.executable, "-m", __name__, device] + ([offload] if offload else []),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)  # the compilers too: ninja gives each a process group of its own
        proc.communicate()
        removed = _remove_build_locks()
        raise UsageError(f"baseline 'deepspeed': building its async_io op did not finish in {timeout_s:.0f} s"
                         f"{' (its lock files removed)' if removed else ''}; --deepspeed-build-timeout "
                         f"(ZIPMOE_BENCH_DEEPSPEED_BUILD_TIMEOUT) sets the limit") from None
    if proc.returncode != 0:
        tail = [x for x in (err or "").strip().splitlines() if x.strip()]
        raise UsageError(f"baseline 'deepspeed': building its async_io op failed: {tail[-1] if tail else f'exit {proc.returncode}'}")


def _remove_build_locks() -> list[str]:
    """Remove the lock files torch's extension builder left in the ops' build folders (their
    builder was killed: a later load would wait on them for ever); the paths removed."""
    from pathlib import Path

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    # torch's rule (cpp_extension._get_build_directory, private): TORCH_EXTENSIONS_DIR/<op>, else
    # ~/.cache/torch_extensions/<python and accelerator tag>/<op>
    roots = [Path(root)] if root else list((Path.home() / ".cache" / "torch_extensions").glob("*"))
    removed = []
    for base in roots:
        for name in OP_DIRS:
            lock = base / name / "lock"
            if lock.exists():
                lock.unlink()
                removed.append(str(lock))
    return removed


def before_load(spec: dict) -> dict:
    """In the worker, before its cgroup is tightened: import deepspeed (its memory is part of the
    process's own baseline, like torch's) and decide where the parameters go: ``spec["deepspeed_offload"]``
    (``"nvme"``, ``"cpu"``, None: NVMe where it can be built), ``spec["deepspeed_load_in_budget"]``."""
    forced = check_offload(spec.get("deepspeed_offload"))
    deepspeed = import_deepspeed(spec["device"])
    ok, why = aio_available() if forced != "cpu" else (False, "asked for with --deepspeed-offload cpu")
    if forced == "nvme" and not ok:
        raise UsageError(f"--deepspeed-offload nvme, but DeepSpeed's async_io op cannot be built here: {why}")
    info = {"deepspeed": deepspeed.__version__, "offload_param": "nvme" if ok else "cpu", "ds_env": single_process_env(spec["device"])}
    if ok and not spec.get("deepspeed_load_in_budget"):
        info["cgroup_after_load"] = LOAD_NOTE
    if not ok:
        info["budget_broken"] = BUDGET_BROKEN.format(why=why)
    return info


# DeepSpeed's default buffer_count. With fewer, ZeRO-3 inference on the demo model either stopped
# ("Not enough buffers 0 for swapping 1") or, with 2-3 buffers, decoded wrong tokens from the first one.
MIN_BUFFERS = 5


def _param_numels(source) -> tuple[int, int, int]:
    """(largest parameter, total parameters, count) of the checkpoint, in elements, from its headers
    (fused expert tensors counted as transformers builds them)."""
    from pathlib import Path

    from safetensors import safe_open

    from zipmoe.codecs.naming import classify

    largest = total = count = 0
    fused: dict[tuple, int] = {}
    for f in sorted(Path(source).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                shape = st.get_slice(name).get_shape()
                n = 1
                for d in shape:
                    n *= int(d)
                total += n
                role = classify(name, tuple(shape), None)
                if role.role == "expert" and not role.fused:  # transformers 5 fuses per-expert tensors per layer
                    key = (role.layer, "gate_up" if role.proj in ("gate", "up") else role.proj)
                    fused[key] = fused.get(key, 0) + n
                    continue
                count += 1
                largest = max(largest, n)
    for n in fused.values():
        largest = max(largest, n)
        count += 1
    return largest, total, count


def ds_config(budget: int, offload: str, nvme_path: str | None, source, bytes_per_param: int = 2) -> dict:
    """The ZeRO-3 inference config for a budget (bytes).

    NVMe: ``buffer_count`` buffers of the largest parameter's size (at least :data:`MIN_BUFFERS`;
    up to 8 while they fit half the budget), ``max_in_cpu`` 0, no persistent parameters, live
    parameters the rest. Raises
    :class:`BudgetError` when :data:`MIN_BUFFERS` buffers of the largest parameter do not fit the budget.
    """
    largest, _total, _count = _param_numels(source)
    largest = max(largest, 1)
    buf_bytes = largest * bytes_per_param
    zero: dict = {"stage": 3, "overlap_comm": False, "contiguous_gradients": False, "stage3_prefetch_bucket_size": 0}
    if offload == "nvme":
        if MIN_BUFFERS * buf_bytes > budget:
            from zipmoe.units import format_size

            raise BudgetError(f"engine deepspeed cannot run in budget {format_size(budget)}: its NVMe offload needs {MIN_BUFFERS} swap buffers "
                              f"of the largest parameter ({format_size(buf_bytes)} each)")
        count = max(MIN_BUFFERS, min(8, (budget // 2) // buf_bytes))
        rest = max(budget - count * buf_bytes, 0)
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme_path, "pin_memory": False, "buffer_count": int(count),
                                 "buffer_size": int(largest), "max_in_cpu": 0}
        # no persistent parameters and DeepSpeed's default reuse distance: with norms kept resident
        # (a persistence threshold) and stage3_max_reuse_distance 0, the demo decoded a wrong third token
        zero["stage3_param_persistence_threshold"] = 0
        zero["stage3_max_live_parameters"] = int(max(rest // bytes_per_param, largest))
    else:
        zero["offload_param"] = {"device": "cpu", "pin_memory": False}
        zero["stage3_param_persistence_threshold"] = 0
        zero["stage3_max_live_parameters"] = int(max(budget // bytes_per_param, largest))
    return {
        "zero_optimization": zero,
        "aio": {"block_size": 1 << 20, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False, "overlap_events": True},
        "train_micro_batch_size_per_gpu": 1,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def load(spec: dict, from_pretrained, info: dict):
    """The transformers model under ZeRO-3 inference; returns (model, info)."""
    import sys

    import torch

    device = spec["device"]
    deepspeed = import_deepspeed(device)
    # a world of one needs no shared-memory all-reduce: skip the op's JIT build
    dct = sys.modules.get("deepspeed.comm.torch")
    if dct is not None and hasattr(dct, "build_shm_op"):
        dct.build_shm_op = lambda: None
    from transformers.integrations import HfDeepSpeedConfig

    offload = info.get("offload_param") or ("nvme" if aio_available()[0] else "cpu")
    nvme = None
    if offload == "nvme":
        nvme = os.path.join(spec["offload_folder"], "deepspeed-nvme")
        os.makedirs(nvme, exist_ok=True)
    dtype = _checkpoint_dtype(spec["source"], torch)
    config = ds_config(int(spec["budget"]), offload, nvme, spec["source"], bytes_per_param=torch.tensor([], dtype=dtype).element_size())
    if dtype == torch.bfloat16:
        config["bf16"] = {"enabled": True}
    elif dtype == torch.float16:
        config["fp16"] = {"enabled": True}
    hf_ds = HfDeepSpeedConfig(config)  # noqa: F841  (keeps zero.Init on for from_pretrained: the weights go straight to the offload)
    model = from_pretrained()
    eng = deepspeed.initialize(model=model, config_params=config)[0]
    eng.module.eval()
    info.update(offload_param=offload, ds_config=config, nvme_path=nvme, dtype=str(dtype))
    if offload == "nvme":
        info["libaio"] = loaded_libaio()
    model = eng.module
    routers = keep_router_dtype(model)
    if routers:
        info["routers_cast_at_call"] = routers
    model._zipmoe_ds_engine = eng  # keep the engine (and its swapper) alive
    model._zipmoe_hf_ds = hf_ds
    return model, info


def keep_router_dtype(model) -> int:
    """SwitchTransformers' router computes in its own dtype (``config.router_dtype``, float32): it
    casts its input and its classifier to it before the matmul. Under ZeRO-3 the classifier's
    weight is gathered in the engine's bf16 at every call, whatever the module was cast to, so the
    matmul met a float32 input and a bf16 weight and stopped (§27). Each such classifier now
    casts its gathered weight (and bias) to the input's dtype at the call: the float32 product
    transformers computes from the same bf16 weights. Returns how many routers were changed."""
    import torch
    import torch.nn.functional as F

    n = 0
    for m in model.modules():
        lin = getattr(m, "classifier", None)
        if (type(m).__name__.endswith("Router") and isinstance(getattr(m, "dtype", None), torch.dtype)
                and isinstance(lin, torch.nn.Linear)):
            def forward(x, lin=lin):
                bias = lin.bias.to(x.dtype) if lin.bias is not None else None
                return F.linear(x, lin.weight.to(x.dtype), bias)

            lin.forward = forward
            n += 1
    return n


def _checkpoint_dtype(source, torch):
    import json
    from pathlib import Path

    cfg = json.loads(Path(source, "config.json").read_text())
    name = cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(str(name), torch.bfloat16)


if __name__ == "__main__":  # bench's op build (prepare): python -m zipmoe.runtime.bench.deepspeed_engine DEVICE [OFFLOAD]
    import sys

    print(" ".join(build_ops(sys.argv[1] if len(sys.argv) > 1 else "cpu", sys.argv[2] if len(sys.argv) > 2 else None))
          or "nothing to build")
