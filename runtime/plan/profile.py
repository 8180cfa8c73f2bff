"""The hardware profile the planner uses: measured on this machine, with this container.

This module is the profile file (what identifies a machine, :func:`measure` putting the figures
together, saving, loading, checking); the measurements live by job in plan/micro.py (each cost
alone), plan/passes.py (passes served through the runtime) and plan/fits.py (what serving adds,
fitted to those passes).

What is measured (each exactly what runtime.plan.simulate.Costs counts):

* **disk**: cold reads of the container's expert extents, one request at a time, with
  ``O_DIRECT`` into page-aligned buffers so that the page cache does not answer. Where the file
  system refuses ``O_DIRECT`` (tmpfs, some overlay file systems) the reads fall back to
  ``pread`` after ``posix_fadvise(POSIX_FADV_DONTNEED)`` on the range, and ``disk.method``
  says which was used (``"O_DIRECT"`` or ``"pread+fadvise(DONTNEED)"``; on tmpfs the latter
  measures memory, which is then what the disk is). Small (4 KiB) and expert-sized reads at
  random aligned offsets are fitted by least squares to ``t = latency + bytes / bw``
  (``disk.latency_s``, ``disk.bw``: queue depth 1). Then **at the runtime's queue depth**
  (``disk.readers`` threads: the ``readers`` the runtime will serve with, ``EngineSettings.readers``, sharing
  1 MiB pieces as serving reads them; ``disk.bw_readers``): the schedule model's one I/O
  channel stands for those readers together, so ``costs.disk_bw`` is the larger of the two
  rates and ``costs.disk_latency`` the queue-depth-1 latency divided by ``readers`` (that many
  requests overlap their latencies). Profiles cached before 1 Dec 2026 (no ``disk.readers``)
  are measured again.
* **decompression**: one thread (= one decode worker) decodes the E chunks of real expert
  tensors with the container's codec into a preallocated buffer, with the function serving runs
  (runtime.engine.decode.decode_exp_into, checksums checked): ``decomp_bw_per_worker`` counts
  **bf16 bytes** (2 x numel) per second.
* **merge**: ``zipmoe.kernels.merge`` (numba on the CPU, Triton on CUDA) of E and SM bytes into
  bf16 on the device, bf16 bytes per second.
* **admission**: the copy the serving thread makes when the SM-only or E-only pool keeps a
  fetched or demoted tensor's half: its parts out of the read buffer into arrays of their own
  (``device_side.own_parts``, as serving does), bytes per second (``costs.admit_bw``); the
  compressed pool keeps the read buffers themselves and copies nothing (engine/adopt.py). Where
  the runtime's passes ran, the rate is the served one (``runtime.states.admit``,
  passes.admit_pass: every fetch's SM half copied into a host pool while serving, less the
  all-miss pass's full-pool admissions); ``admit.source`` says which.
* **compute**: one expert's forward for one token on the device (bf16 ``F.linear`` of each of
  its compute tensors, plus the activation), with the torch threads the serving process will use
  (``zipmoe.machine.torch_threads(workers)``).
* **runtime** (not with ``quick``): a few greedy tokens served through the runtime's ``load`` give the
  expert compute as the runtime's hook does it (which replaces the micro-benchmark's
  ``compute_s_per_expert``: on small experts the Python around the matmuls dominates) and
  ``dense_s_per_token``, the time per token outside the sparse layers, and (when every expert
  fits in the budget used) ``layer_overhead_s``, a sparse layer's time beyond its experts'
  computes (the runtime's bookkeeping around them). Two timed passes of 16 decode steps; the
  one with the shorter median step is kept (the dense time is mostly the host launching
  kernels, which any other load on the machine slows). Where the runtime cannot
  load the model, ``runtime.error`` says why and the planner estimates the dense time from the
  GEMV throughput.
* ``runtime.serving`` (6 decode steps with every expert fetched; the faster of two passes) also gives
  ``costs.dense_s_per_token_fetching``, the time outside the sparse layers while experts are
  being fetched: on few cores the decode workers share them with the dense part. The planner
  takes the dense time of a plan between the two, by the share of chosen experts it fetches.
* ``runtime.serving_compressed`` (6 more decode steps, every chosen expert a compressed hit:
  decoded and merged, nothing read) and the all-miss pass above split what serving adds
  (``serving_overheads``): the compressed pass fits ``merge_overhead_s``, the runtime's own
  work per fetched tensor; the all-miss pass then fits ``disk_bw`` down to the rate reads
  reach while serving (the I/O thread shares the host with the decode workers and the serving
  thread). Without the compressed pass (older profiles), the all-miss pass alone sets both.
* Before measuring, ``os.sync()``: pending writes (a ``zipmoe pack`` just before leaves
  gigabytes of dirty pages) would share the disk and the cores with the measurement. On the
  H200 box a profile taken seconds after packing qwen1.5-moe-a2.7b measured 140 ms of dense time
  per token where serving then took about 80 ms (docs/benchmarks.md §7).
* ``costs.merge_on_workers``: true where the runtime merges on its decode workers (CPU device,
  or CUDA without Triton), false where the device merges.

Storage: JSON, ``{"format": "zipmoe-profile/1", "machine": {...}, "container": {...},
"costs": {Costs fields}, "disk": {...}, "decomp": {...}, "merge": {...}, "compute": {...}}``.
Cached in the folder :func:`get_profile` is given (``cache_dir``; the command line passes
``$ZIPMOE_CACHE_DIR`` or ``$XDG_CACHE_HOME/zipmoe`` or ``~/.cache/zipmoe``: zipmoe_cli/env.py), under
``profiles/<machine key>-<container id>.json``, where the machine key hashes the hostname, the
CPU model, the core count and the device. It is reused until the machine or the file changes
(container id, size or mtime): a cached profile that no longer matches is measured again; a
profile file given explicitly (``--profile FILE``) that does not match raises
:class:`~zipmoe.errors.UsageError` (stale profile) naming what changed.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import socket
import time
from pathlib import Path

from zipmoe.errors import UsageError
from zipmoe.machine import cores, cpu_model, decode_workers, torch_threads
from zipmoe.runtime.plan.fits import serving_overheads
from zipmoe.runtime.engine.settings import DEFAULT_READERS
from zipmoe.runtime.plan.micro import (measure_admit, measure_compute, measure_decomp, measure_disk, measure_disk_readers,
                                       measure_merge)
from zipmoe.runtime.plan.passes import measure_runtime
from zipmoe.runtime.plan.simulate import Costs

__all__ = ["PROFILE_FORMAT", "machine_info", "machine_key", "default_profile_path", "measure",
           "load_profile", "save_profile", "check_profile", "costs_of", "get_profile"]

PROFILE_FORMAT = "zipmoe-profile/1"
#: what a cached profile must have been measured by: 2 = the served passes teacher-force the
#: corpus and measure every cache state (``step_costs``, 2 Dec 2026); 3 = without CUDA graphs the
#: misses' costs are fitted to a served run at capacity (``step_costs["served_fit"]``, 5 Dec 2026);
#: 4 = the host pools' admission copy rate (``costs.admit_bw``, 6 Dec 2026); 5 = what a compressed hit adds
#: beside misses (``step_costs["compressed_beside_misses_s"]``, 7 Dec 2026); 6 = the compressed pool keeps the
#: read buffers, so ``admit_bw`` is the copy rate of the SM-only pool's admissions (engine/adopt.py, 7 Dec
#: 2026); 7 = β fitted to a served run of one compressed pool at capacity (``step_costs["beta_fit"]``, 7 Dec
#: 2026: the β pass measured 2.62 ms on an H100 where serving implied 0.7); 8 = the passes load at the
#: budget the runtime's own arithmetic gives for every expert whole (passes.resident_budget, 8 Dec 2026: on
#: CUDA DeepSeek-V2-Lite's "resident" passes had served compressed hits and misses); 9 = an encoder-decoder's
#: passes serve every state through ``model.generate`` (passes._generate_stream, 8 Dec 2026: before, its
#: profile had the resident step alone and no ``step_costs``); 10 = the served fit nets out the first touch of
#: fresh memory (passes.first_touch_s, 8 Dec 2026: it had scaled Switch's misses 3x on the CPU box); older ones
#: are measured again
PROFILE_REVISION = 10


# ---------------------------------------------------------------------------------- identity
def machine_info(device: str = "cpu") -> dict:
    """What identifies this machine for a profile: host, CPU, cores, device."""
    info = {"hostname": socket.gethostname(), "cpu_model": cpu_model(), "cores": cores(), "device": device}
    if device.startswith("cuda"):
        import torch

        info["device_name"] = torch.cuda.get_device_name(torch.device(device))
    return info


def machine_key(info: dict) -> str:
    blob = json.dumps({k: info.get(k) for k in ("hostname", "cpu_model", "cores", "device", "device_name")}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def container_info(path, container_id: str) -> dict:
    st = os.stat(path)
    return {"container_id": container_id, "path": str(Path(path).resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def default_profile_path(container_id: str, device: str = "cpu", dtype: str = "bfloat16", *, cache_dir) -> Path:
    """Where the profile cache in ``cache_dir`` keeps this machine's profile of a container."""
    suffix = "" if dtype in ("bfloat16", "bf16") else f"-{dtype}"
    return Path(cache_dir) / "profiles" / f"{machine_key(machine_info(device))}-{container_id}{suffix}.json"


# ---------------------------------------------------------------------------------- profile
def measure(path, device: str = "cpu", workers: int | None = None, quick: bool = False, dtype: str = "bfloat16",
            readers: int = DEFAULT_READERS, load_options: dict | None = None) -> dict:
    """Measure everything for ``path`` on ``device``; returns the profile dict (not saved).
    ``load_options``: more keyword arguments of ``runtime.engine.loader.load`` for the serving
    passes (``prefetch``, ``force``: what the command line was given); they load with ``readers``.
    ``load`` records the other processes' CPU use meanwhile (runtime/plan/busy.py)."""
    from zipmoe.runtime.plan.busy import OtherLoad

    with OtherLoad() as others:
        prof = _measure(path, device, workers, quick, dtype, readers, load_options)
    prof["load"] = others.result
    return prof


def _measure(path, device, workers, quick, dtype, readers, load_options) -> dict:
    from zipmoe.codecs.reader import ContainerReader
    from zipmoe.runtime.plan.layout import container_layout, expert_tensors

    workers = decode_workers() if workers is None else int(workers)
    scale = 0.3 if quick else 1.0
    # write back what is pending (a `zipmoe pack` just before leaves gigabytes of dirty pages):
    # the kernel's writeback would otherwise share the disk and the cores with what we measure
    if hasattr(os, "sync"):
        os.sync()
    with ContainerReader(path) as reader:
        layout = container_layout(reader, dtype, device)
        experts = [e for e in reader.entries if e.role == "expert" and e.dtype == "BF16"]
        tensors = [t for ts in expert_tensors(reader).values() for t in ts]
        sample = random.Random(1).sample(tensors, min(len(tensors), 24))
        extents = [tuple(e.extent) for e in experts]
        disk = measure_disk(path, extents, seconds=1.0 * scale)
        qd = measure_disk_readers(path, extents, readers, seconds=1.0 * scale)
        disk.update(readers=readers, bw_readers=qd["bw"], readers_method=qd["method"])
        decomp = measure_decomp(reader, sample, seconds=0.5 * scale)
        biggest = max(u[2] // 2 for u in layout.units)
        merge = measure_merge(biggest, device, seconds=0.3 * scale)
        compute = measure_compute([u[1] for u in layout.units], device, threads=torch_threads(workers),
                                  seconds=0.3 * scale, dtype=layout.dtype)
        admit = measure_admit(reader, sample, seconds=0.2 * scale)
        prof = {
            "format": PROFILE_FORMAT,
            "revision": PROFILE_REVISION,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": machine_info(device),
            "container": container_info(path, reader.container_id),
            "workers": workers,
            "dtype": layout.dtype,
            "disk": disk,
            "decomp": decomp,
            "merge": merge,
            "compute": compute,
            "admit": admit,
        }
    # where the runtime merges: on the CPU device the decode workers do it (runtime.engine.decoder);
    # on CUDA the device does, with the Triton kernel
    on_workers = not device.startswith("cuda") or merge["kernel"] != "triton"
    prof["merge"]["where"] = "workers" if on_workers else "device"
    compute_s = compute["s_per_expert"]
    dense_s = layer_overhead = None
    if not quick:
        try:
            rt = measure_runtime(path, layout, device, workers, load_options={**(load_options or {}), "readers": readers})
            prof["runtime"] = rt
            compute_s = rt["compute_s_per_expert"]
            dense_s = rt["dense_s_per_token"]
            layer_overhead = rt.get("layer_overhead_s")
        except Exception as exc:  # noqa: BLE001 - the runtime is optional for a profile
            prof["runtime"] = {"error": f"{type(exc).__name__}: {exc}"}
    prof["costs"] = {
        # the model's one I/O channel is the runtime's readers together (see the module docstring)
        "disk_bw": max(disk["bw"], disk["bw_readers"]),
        "disk_latency": disk["latency_s"] / readers,
        "decomp_bw_per_worker": decomp["bw_per_worker"],
        "merge_bw": merge["bw"],
        "compute_s_per_expert": compute_s,
        "merge_on_workers": on_workers,
        # bytes per second the serving thread admits into a host pool: as served (passes.admit_pass)
        # where the runtime ran, else the copy alone (micro.measure_admit)
        "admit_bw": admit["bw"],
    }
    served_admit = ((prof.get("runtime") or {}).get("states") or {}).get("admit") or {}
    if served_admit.get("admit_bw"):
        prof["costs"]["admit_bw"] = float(served_admit["admit_bw"])
        prof["admit"]["served_bw"] = float(served_admit["admit_bw"])
    prof["admit"]["source"] = "served" if served_admit.get("admit_bw") else "copy alone"
    if dense_s is not None:
        prof["costs"]["dense_s_per_token"] = dense_s
    if layer_overhead is not None:
        prof["costs"]["layer_overhead_s"] = layer_overhead
    if (prof.get("runtime") or {}).get("step_costs"):
        prof["step_costs"] = prof["runtime"]["step_costs"]  # the planner's measured-state cost model
    serving = (prof.get("runtime") or {}).get("serving")
    if serving and dense_s is not None and serving.get("dense_s_per_token") is not None:
        prof["costs"]["dense_s_per_token_fetching"] = max(dense_s, serving["dense_s_per_token"])
    if serving:
        prof["costs"].update(serving_overheads(costs_of(prof), layout.tensors, serving, workers,
                                               prof["runtime"].get("window"), layer_overhead or 0.0,
                                               prof["runtime"].get("serving_compressed")))
    return prof


def costs_of(profile: dict) -> Costs:
    c = profile["costs"]
    return Costs(float(c["disk_bw"]), float(c["disk_latency"]), float(c["decomp_bw_per_worker"]),
                 float(c["merge_bw"]), float(c["compute_s_per_expert"]),
                 float(c.get("decomp_overhead_s", 0.0)), float(c.get("merge_overhead_s", 0.0)),
                 bool(c.get("merge_on_workers", False)))


def save_profile(profile: dict, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(profile, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def load_profile(path) -> dict:
    path = Path(path)
    try:
        prof = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"profile {path} does not exist") from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"profile {path} is not a zipmoe profile: {exc}") from None
    if not isinstance(prof, dict) or prof.get("format") != PROFILE_FORMAT or "costs" not in prof:
        raise UsageError(f"profile {path} is not a {PROFILE_FORMAT} file")
    try:
        costs_of(prof)
    except (KeyError, TypeError, ValueError) as exc:
        raise UsageError(f"profile {path} has unusable costs: {exc}") from None
    return prof


def check_profile(profile: dict, container_path, container_id: str, device: str, dtype: str = "bfloat16") -> str | None:
    """None when ``profile`` fits this machine, file and dtype, else why it is stale (one phrase)."""
    m, mine = profile.get("machine", {}), machine_info(device)
    for k in ("hostname", "cpu_model", "cores", "device", "device_name"):
        if m.get(k) != mine.get(k):
            return f"it was measured on another machine ({k}: {m.get(k)!r}, here {mine.get(k)!r})"
    c = profile.get("container", {})
    if c.get("container_id") != container_id:
        return f"it was measured with another container ({c.get('container_id')}, this one is {container_id})"
    st = os.stat(container_path)
    if c.get("size") != st.st_size or c.get("mtime_ns") != st.st_mtime_ns:
        return "the container file changed since it was measured"
    if profile.get("dtype", "bfloat16") != dtype:
        return f"it was measured computing in {profile.get('dtype', 'bfloat16')}, not {dtype}"
    return None


def get_profile(container_path, container_id: str, device: str = "cpu", profile_path=None,
                workers: int | None = None, remeasure: bool = False, quick: bool = False,
                dtype: str = "bfloat16", readers: int = DEFAULT_READERS, cache_dir=None,
                load_options: dict | None = None) -> tuple[dict, str]:
    """The profile to plan with, and where it came from (``"measured"``, ``"cached"``, ``"file"``).
    ``readers``: the reader threads serving will use (the disk is measured at that queue depth;
    a cached profile of another one is measured again). ``load_options``: as :func:`measure`.

    ``profile_path`` given and existing: loaded and checked (stale -> UsageError). Given and
    missing: measured and written there. Not given: the per-machine cache in ``cache_dir``,
    re-measured when stale (``cache_dir`` None: no cache, measured every time).
    """
    if profile_path is not None:
        p = Path(profile_path)
        if p.exists() and not remeasure:
            prof = load_profile(p)
            why = check_profile(prof, container_path, container_id, device, dtype)
            if why:
                raise UsageError(f"profile {p} is stale: {why}; measure again with `zipmoe plan FILE --profile-only --profile {p}` after deleting it")
            return prof, "file"
        prof = measure(container_path, device, workers, quick=quick, dtype=dtype, readers=readers,
                       load_options=load_options)
        save_profile(prof, p)
        return prof, "measured"
    if cache_dir is None:
        return measure(container_path, device, workers, quick=quick, dtype=dtype, readers=readers,
                       load_options=load_options), "measured"

    p = default_profile_path(container_id, device, dtype, cache_dir=cache_dir)
    if p.exists() and not remeasure:
        try:
            prof = load_profile(p)
        except UsageError:
            prof = None
        if (prof is not None and check_profile(prof, container_path, container_id, device, dtype) is None
                and prof.get("disk", {}).get("readers") == readers  # measured at today's queue depth
                and (quick or prof.get("revision", 1) >= PROFILE_REVISION)):  # and with today's passes
            return prof, "cached"
    prof = measure(container_path, device, workers, quick=quick, dtype=dtype, readers=readers, load_options=load_options)
    try:
        save_profile(prof, p)
    except OSError:
        pass  # a read-only home: plan anyway
    return prof, "measured"
