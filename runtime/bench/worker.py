"""One engine's process in `zipmoe bench`: load, decode the case's workload, measure, report JSON.

Run as ``python -m zipmoe.runtime.bench.worker`` with the spec (JSON) on stdin. It joins the
memory cgroup the parent made (``ZIPMOE_BENCH_CGROUP``) before importing torch, loads the
engine (runtime/bench/engines.py), then for every case (batch, new tokens) and run:

- cold runs empty the page cache first (runtime/bench/cold.py; the mode is recorded);
- decoding of a fixed number of new tokens (EOS suppressed with ``min_new_tokens``) as the
  case's ``workload`` says (runtime/plan/workload.py): ``corpus`` teacher-forces the case's
  ``forced`` ids (``ForcedTokens``), ``sample`` samples after ``torch.manual_seed``, ``greedy``;
  zipmoe runs also record their routing and hits per token (:class:`RunDiagnostics`):
  the zipmoe engines run zipmoe's decode loop (runtime/engine/loop.py, a static KV cache of
  ``spec["context"]`` positions, default 4096, allocated once per batch size; on the CPU its
  bytes are added to the cgroup's limit, see :func:`kv_allowance`), the others
  ``model.generate``; a streamer stamps the time of every token and snapshots the bytes
  read (``/proc/self/io`` ``read_bytes`` and the engine's counters) at the first token, so that
  prefill and decode are measured apart;
- a stopping criterion ends a run early once ``time_limit_s`` has passed and at least
  ``min_tokens`` were generated: a baseline needing seconds per token makes fewer tokens
  (the comparison is per token);
- a sampler thread records the peak RSS (every 10 ms) next to ``ru_maxrss``.

Each finished run is appended as one JSON line to ``spec["result_path"]`` (kept if the process
is killed later, e.g. by the cgroup's OOM killer) and reported on stderr as ``@@progress``;
the final document goes to stdout as the last line. Metric names: ``ttft_s`` (prompt in → first
token out), ``tpot_s`` (mean time between later tokens), ``e2e_s``, ``tokens_per_s`` (all rows,
whole run), ``decode_tokens_per_s``, ``bytes_read_io`` / ``decode_bytes_read_io`` (disk reads
of this process), ``bytes_read_engine`` (runtime counters, zipmoe engines).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import threading
import time
import traceback

from zipmoe.runtime.bench.cgroup import join_from_env, set_own_limit


def preload_model_code(spec: dict) -> list[str]:
    """Import, before the process's baseline is measured, what loading the model imports anyway,
    so that it counts in that baseline (as torch does) and not against the margin on top of the
    budget: the family's transformers modeling module (about 165 MiB for Mixtral with transformers
    5) and, for zipmoe's engines on the CPU, the numba merge kernel (about 105 MiB once loaded
    from numba's cache). Without it the built-in demo in float32 at 800M was killed by its cgroup
    with the default 256M margin. Returns what it imported (the worker's JSON says so)."""
    import importlib

    from zipmoe.runtime.bench.engines import engine

    kind = engine(spec["engine"]).kind  # "zipmoe" (zipmoe.load), "hf", "deepspeed", "llama.cpp", ...
    done = []
    mt = spec.get("model_type")
    if kind != "llama.cpp" and isinstance(mt, str) and mt.isidentifier():  # llama.cpp builds no transformers model
        name = f"transformers.models.{mt}.modeling_{mt}"
        try:
            importlib.import_module(name)
            done.append(name)
        except Exception:  # noqa: BLE001 - a model transformers has no module for: loading says so itself
            pass
    if spec.get("device") == "cpu" and kind == "zipmoe":
        import numpy as np

        from zipmoe.kernels.cpu import merge_into

        merge_into(np.zeros(8, np.uint8), np.zeros(8, np.uint8), np.zeros(8, np.uint16))
        done.append("zipmoe.kernels.cpu")
    if spec.get("device") == "cuda":
        done += _warm_cuda(kind == "zipmoe")
    return done


def _warm_cuda(zipmoe_engine: bool) -> list[str]:
    """The host memory CUDA's libraries take on their first use (cuBLAS and cuBLASLt with their
    workspaces and GEMM modules, the attention kernels; with zipmoe, Triton compiling its merge
    kernel): on the H200 the first forward of a process added about 0.76 GiB of host RSS, which
    every engine pays and which was otherwise charged to the margin over the budget."""
    import torch
    import torch.nn.functional as F

    done = []
    dev = torch.device("cuda", torch.cuda.current_device())
    for dt in (torch.bfloat16, torch.float32):
        x = torch.ones(16, 256, dtype=dt, device=dev)
        F.linear(x, torch.ones(128, 256, dtype=dt, device=dev))
        torch.bmm(x.view(4, 4, 256), torch.ones(4, 256, 8, dtype=dt, device=dev))
    done.append("cuda: cublas")
    q = torch.ones(1, 4, 8, 64, dtype=torch.bfloat16, device=dev)
    F.scaled_dot_product_attention(q, q, q, is_causal=True)
    done.append("cuda: attention")
    if zipmoe_engine:
        from zipmoe import kernels

        if kernels.triton_available():
            from zipmoe.kernels.triton_merge import BLOCK, merge_triton

            n = 2 * BLOCK + 3  # both of the kernel's specialisations (whole blocks and the tail)
            try:
                merge_triton(torch.zeros(n, dtype=torch.uint8, device=dev), torch.zeros(n, dtype=torch.uint8, device=dev),
                             torch.empty(n, dtype=torch.bfloat16, device=dev))
                done.append("cuda: triton merge")
            except Exception:  # noqa: BLE001 - a warm-up only: the engine meets (and reports) a real failure itself
                pass
    torch.cuda.synchronize(dev)
    return done


def read_io() -> dict:
    """``/proc/self/io`` as a dict (read_bytes: bytes this process caused to be fetched from storage)."""
    out = {}
    try:
        with open("/proc/self/io") as f:
            for line in f:
                k, _, v = line.partition(":")
                out[k.strip()] = int(v)
    except (OSError, ValueError):
        pass
    return out


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def ru_maxrss_bytes() -> int:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


class RssSampler:
    """Peak RSS by sampling; ``reset()`` starts a new window."""

    def __init__(self, interval: float = 0.01):
        self.interval = interval
        self.peak = rss_bytes()
        self.window_peak = self.peak
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True, name="rss-sampler")
        self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            r = rss_bytes()
            if r > self.peak:
                self.peak = r
            if r > self.window_peak:
                self.window_peak = r

    def reset(self) -> None:
        self.window_peak = rss_bytes()

    def stop(self) -> None:
        self._stop.set()
        self._t.join(timeout=1)


def snapshot_counters(runtime) -> dict | None:
    """The runtime's counters as plain JSON-able data, whatever shape they come in."""
    if runtime is None:
        return None
    c = getattr(runtime, "counters", None)
    if c is None:
        return None
    for meth in ("snapshot", "to_dict", "as_dict", "asdict"):
        fn = getattr(c, meth, None)
        if callable(fn):
            try:
                return _jsonable(fn())
            except Exception:
                pass
    try:
        import dataclasses

        if dataclasses.is_dataclass(c):
            return _jsonable(dataclasses.asdict(c))
    except Exception:
        pass
    if isinstance(c, dict):
        return _jsonable(c)
    return _jsonable({k: v for k, v in vars(c).items() if not k.startswith("_")}) if hasattr(c, "__dict__") else None


def _jsonable(x, depth: int = 0):
    if depth > 6:
        return None
    if isinstance(x, (int, float, str, bool)) or x is None:
        return x
    if isinstance(x, dict):
        return {str(k): _jsonable(v, depth + 1) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        if len(x) > 4096:
            return None
        return [_jsonable(v, depth + 1) for v in x]
    try:
        import numpy as np

        if isinstance(x, np.generic):
            return x.item()
        if isinstance(x, np.ndarray) and x.size <= 4096:
            return x.tolist()
    except Exception:
        pass
    if hasattr(x, "item"):
        try:
            return x.item()
        except Exception:
            pass
    if hasattr(x, "__dict__"):
        return _jsonable({k: v for k, v in vars(x).items() if not k.startswith("_")}, depth + 1)
    return str(x)


BYTES_KEYS = ("bytes_read", "read_bytes", "disk_bytes", "bytes_from_disk", "io_bytes")


def counter_bytes(counters) -> int | None:
    """Bytes read from disk according to the runtime's counters (first matching key, any depth)."""
    if not isinstance(counters, dict):
        return None
    for k in BYTES_KEYS:
        v = counters.get(k)
        if isinstance(v, (int, float)):
            return int(v)
        if isinstance(v, dict):  # e.g. {"sm": .., "e": ..}
            nums = [x for x in v.values() if isinstance(x, (int, float))]
            if nums:
                return int(sum(nums))
    for v in counters.values():
        if isinstance(v, dict):
            got = counter_bytes(v)
            if got is not None:
                return got
    return None


def counter_diff(a, b):
    """b - a for numeric leaves (counters are cumulative; a run's share is the difference).
    Uses the runtime's own ``counters.delta`` when it has one."""
    if a is None:
        return b
    try:
        from zipmoe.runtime.engine.counters import delta

        return delta(b, a)
    except Exception:
        return _diff(a, b)


def _diff(a, b):
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: _diff(a.get(k), v) for k, v in b.items()}
    if isinstance(b, bool):
        return b
    if isinstance(b, (int, float)) and isinstance(a, (int, float)):
        return b - a
    return b


def _make_streamer_and_stop(torch, device: str, time_limit_s: float | None, min_tokens: int, on_first_token, on_each=None):
    from transformers.generation.stopping_criteria import StoppingCriteria
    from transformers.generation.streamers import BaseStreamer

    cuda = device == "cuda"

    class TimingStreamer(BaseStreamer):
        def __init__(self):
            self.times: list[float] = []
            self.prompt_seen = False

        def put(self, value):
            if not self.prompt_seen:  # generate() first puts the prompt
                self.prompt_seen = True
                return
            if cuda:
                torch.cuda.synchronize()
            self.times.append(time.perf_counter())
            if len(self.times) == 1:
                on_first_token()
            if on_each is not None:
                on_each()

        def end(self):
            pass

    class TimeLimit(StoppingCriteria):
        def __init__(self, streamer):
            self.streamer = streamer
            self.start = None
            self.hit = False

        def __call__(self, input_ids, scores, **kwargs):
            stop = False
            if time_limit_s is not None and self.start is not None and len(self.streamer.times) >= min_tokens:
                stop = (time.perf_counter() - self.start) > time_limit_s
            self.hit = self.hit or stop
            return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)

    s = TimingStreamer()
    return s, TimeLimit(s)


DEFAULT_CONTEXT = 4096
_LOOP: dict = {}


def kv_allowance(spec: dict) -> int:
    """Host bytes of the zipmoe engines' KV cache (the largest batch's), which comes on top of
    the budget: 0 for other engines and on CUDA (the cache is in GPU memory there)."""
    from zipmoe.runtime.bench import engines as bench_engines

    try:
        es = bench_engines.engine(spec["engine"])
    except Exception:
        return 0
    if es.kind != "zipmoe" or spec.get("device") != "cpu":
        return 0
    from zipmoe.codecs.reader import ContainerReader
    from zipmoe.runtime.engine.kvsize import kv_cache_bytes_upper

    path = spec.get("raw_container") if es.needs == "raw_container" else spec.get("container")
    if not path:
        return 0
    try:
        with ContainerReader(path) as r:
            cfg = r.config or {}
    except Exception:
        return 0
    from zipmoe.runtime.engine.dtypes import ITEMSIZE, compute_dtype
    from zipmoe.runtime.engine.kvsize import growth_peak, max_context

    batch = max([len(c.get("input_ids") or [[0]]) for c in spec.get("cases") or [{}]] or [1])
    itemsize = ITEMSIZE[compute_dtype(bench_engines.BENCH_DTYPE, cfg)]  # the KV cache is in the compute dtype
    context = int(spec.get("context") or DEFAULT_CONTEXT)
    limit = max_context(cfg)
    context = min(context, limit) if limit else context
    # the loop's cache grows to the run (kv="grow"): at its last growth the old and the new cache are both alive
    return kv_cache_bytes_upper(cfg, batch=batch, context=growth_peak(context), itemsize=itemsize, clamp=False)


def _loop_for(model, runtime, torch, spec: dict, batch: int):
    """The decode loop of this batch size (one at a time: a new size frees the old cache)."""
    if runtime is None or getattr(model.config, "is_encoder_decoder", False):
        return None
    cur = _LOOP.get("loop")
    if cur is not None and cur.batch == batch:
        return cur
    _LOOP.clear()
    from zipmoe.runtime.engine.loop import DecodeLoop

    _LOOP["loop"] = DecodeLoop(model, context=int(spec.get("context") or DEFAULT_CONTEXT), batch=batch)
    return _LOOP["loop"]


class RunDiagnostics:
    """A zipmoe run's routing and hits, token by token (runtime/bench/diagnostics.py turns them
    into ``distinct_experts``, the quarter hit rates and Belady's MIN).

    The routing comes from the runtime's counters' log of layer calls (``counters.log_uses``)
    where the runtime has it (CUDA graphs keep working), else from an activation trace written
    to a temporary file for the run (``start_trace``; not when CUDA graphs replay the decode
    steps, nor while the engine records a trace for ``--trace-out``: then no routing figures).
    Hits: the ``hits`` counters at every token boundary."""

    def __init__(self, runtime, graphed: bool) -> None:
        self.rt = runtime
        self.c = runtime.counters
        self.mode = None
        self.path = None
        self.marks: list = []  # per token: (layer calls logged so far, hits so far)
        self.note = None
        if callable(getattr(self.c, "log_uses", None)):
            self.c.log_uses(True)
            self.mode = "counters"
        elif graphed:
            self.note = "CUDA graphs replay the decode steps: no routing trace"
        elif getattr(runtime, "_trace", None) is not None:
            self.note = "the engine records --trace-out: no per-run routing trace"
        elif callable(getattr(runtime, "start_trace", None)):
            import tempfile

            fd, self.path = tempfile.mkstemp(prefix="zipmoe-bench-run-", suffix=".jsonl")
            os.close(fd)
            runtime.start_trace(self.path)
            self.mode = "trace"

    def on_token(self) -> None:
        log = getattr(self.c, "uses_log", None) if self.mode == "counters" else None
        self.marks.append((len(log) if log is not None else None, dict(self.c.hits)))

    def _steps(self) -> list | None:
        if self.mode == "counters":
            log = self.c.log_uses(False) or []
            steps, prev = [], 0
            for n, _ in self.marks:
                steps.append([(layer, experts) for layer, experts in log[prev:n]])
                prev = n
            return steps
        if self.mode == "trace":
            from zipmoe.runtime.engine.trace import read_trace

            self.rt.stop_trace()
            try:
                _, raw = read_trace(self.path)
            finally:
                try:
                    os.unlink(self.path)
                except OSError:
                    pass
            steps = []
            for st in raw:
                calls = []
                for layer, rows in st.items():
                    calls.append((int(layer), sorted({int(e) for r in rows for e in r})))
                steps.append(calls)
            return steps[: len(self.marks)]
        return None

    def abort(self) -> None:
        """The run failed: stop logging (or tracing) and remove the trace file."""
        try:
            if self.mode == "counters":
                self.c.log_uses(False)
            elif self.mode == "trace":
                self.rt.stop_trace()
                os.unlink(self.path)
        except Exception:
            pass

    def finish(self, tokens, spec: dict | None = None, batch: int = 1) -> dict:
        from zipmoe.runtime.bench import diagnostics

        try:
            steps = self._steps()
        except Exception as exc:  # diagnostics never fail a run
            steps, self.note = None, f"routing not read: {type(exc).__name__}: {exc}"
        cap, upper = capacity_in_experts(self.rt)
        out = diagnostics.summarize_run(tokens, steps, [h for _, h in self.marks], cap, upper)
        out["diagnostics_source"] = {"counters": "the runtime's counters", "trace": "an activation trace"}.get(self.mode)
        if self.note:
            out["diagnostics_note"] = self.note
        if spec is not None:
            out.update(predictions(self.rt, spec, steps, list(_ROUTING), batch=batch))
        from zipmoe.runtime.plan.replay import layer_calls_from_steps

        _ROUTING.extend(layer_calls_from_steps(steps or []))  # what the next run's cache starts from
        return out


#: every layer call the runtime of this process served in its runs (the warm-up's too), in order:
#: a run's cache starts from them (``predictions`` replays them first)
_ROUTING: list = []


def predictions(runtime, spec: dict, steps, before: list | None = None, batch: int = 1) -> dict:
    """What the planner said of this run beforehand and what its cost model says of it after:
    ``predicted_tpot_s`` (and ``predicted_hits``), the prediction of the plan the engine loaded
    (``--plan``'s, for zipmoe-basic its ``full only`` alternative, zipmoe-default's fitted one);
    ``model_tpot_s``, ``model_hits``: the profile's served state costs charged for this run's own
    routing replayed through a cache with its pools (runtime/plan/replay.py ``model_run``), after
    ``before`` (the layer calls earlier runs of this process served: the cache the run started
    with). Nothing where there is no plan, profile or routing; never fails the run.
    At ``batch`` rows both are per step of ``batch`` tokens: the plan's prediction only when it
    was made for that batch (plan.json ``batch``: ``zipmoe plan --batch N``), the cost model with
    the profile's costs served at that batch (runtime/plan/batched.py ``step_costs_at``); a
    batch-1 figure is never set against a step of several rows (a note says what is missing)."""
    out: dict = {}
    batch, notes = int(batch), []
    try:
        doc = (getattr(runtime, "plan", None) or {}).get("raw") or {}
        plan = doc
        if spec.get("engine") == "zipmoe-basic" and spec.get("plan"):
            with open(spec["plan"], encoding="utf-8") as f:
                doc = json.load(f)
            plan = (doc.get("alternatives") or {}).get("full only") or {}
        planned = int(doc.get("batch") or 1)
        if plan.get("expected_tpot_s") and planned == batch:
            out["predicted_tpot_s"] = float(plan["expected_tpot_s"])
            out["predicted_hits"] = plan.get("expected_hits")
            out["predicted_by"] = plan.get("hit_model") or "rank model"
        elif plan.get("expected_tpot_s"):
            notes.append(f"the plan predicts batch {planned}; this run has batch {batch}")
        if steps:
            from zipmoe.runtime.plan.batched import step_costs_at
            from zipmoe.runtime.plan.default import find_profile
            from zipmoe.runtime.plan.replay import model_run

            dtype = str(runtime.compute_dtype).replace("torch.", "")
            prof = find_profile(runtime.path, runtime.container_id, str(runtime.device.type), dtype, spec.get("cache_dir"),
                                profile_path=spec.get("profile"))
            sc = step_costs_at(prof, batch) if prof is not None else None
            if prof is not None and sc is None:
                notes.append(f"the profile has no costs served at batch {batch} (zipmoe plan --batch {batch} measures them)")
            m = model_run(steps, runtime, dict(prof, step_costs=sc), before=before) if sc is not None else None
            if m is not None:
                out.update(m)
    except Exception as exc:  # noqa: BLE001 - a diagnostic, never the run's failure
        notes.append(f"{type(exc).__name__}: {exc}")
    if notes:
        out["prediction_note"] = "; ".join(notes)
    return out


def capacity_in_experts(runtime) -> tuple[int | None, bool]:
    """The runtime's cache capacity in experts: the plan's slot counts when it has them (per
    sparse layer x layers), else each pool's bytes // one expert's bytes in that pool's form;
    ``True`` beside it when several pools hold experts (the total is then an upper bound)."""
    from zipmoe.runtime.bench.diagnostics import expert_capacity

    try:
        pools = dict(runtime.pools)
        ets = list(runtime.expert_tensors.values())
        if not ets:
            return None, False
        mean = lambda f: sum(sum(f(t) for t in ts) for ts in ets) // len(ets)  # noqa: E731
        per = {"full": mean(lambda t: t.compute_bytes), "compressed": mean(lambda t: t.stored_bytes),
               "sm_only": mean(lambda t: t.sm_bytes), "e_only": mean(lambda t: t.e_bytes)}
        slots = None
        plan = getattr(runtime, "plan", None)
        ps = (plan or {}).get("slots") if isinstance(plan, dict) else None
        if isinstance(ps, dict) and isinstance(ps.get("per_layer"), dict) and ps.get("sparse_layers"):
            plan_pools = plan.get("pools") or {}
            if all(int(pools.get(k, 0)) >= int(v) for k, v in plan_pools.items()):  # not scaled down
                slots = {k: int(float(v) * int(ps["sparse_layers"]) + 1e-6) for k, v in ps["per_layer"].items()}
        return expert_capacity(pools, per, slots)
    except Exception:
        return None, False


RSS_EVERY = 16  # tokens between two samples of ``rss_by_token``


def run_case(model, runtime, torch, case: dict, spec: dict, sampler: RssSampler, cold_mode: str | None) -> dict:
    """One measured generation; returns its record."""
    from transformers.generation.stopping_criteria import StoppingCriteriaList

    device = spec["device"]
    dev = model.device if hasattr(model, "device") and str(getattr(model, "device", "meta")) != "meta" else torch.device(device)
    if spec.get("engine") == "accelerate" and device == "cuda":
        dev = torch.device("cuda", 0)
    ids = torch.tensor(case["input_ids"], dtype=torch.long, device=dev)
    mask = torch.tensor(case["attention_mask"], dtype=torch.long, device=dev)
    n = int(case["new_tokens"])
    workload = case.get("workload") or "greedy"
    sample = workload == "sample"
    forced = None
    if case.get("forced"):
        from zipmoe.runtime.engine.sampling import ForcedTokens

        forced = ForcedTokens(torch.tensor([r[:n] for r in case["forced"]], dtype=torch.long), keep_argmax=True)
    first: dict = {}

    def on_first_token():
        first["io"] = read_io().get("read_bytes", 0)
        first["counters"] = snapshot_counters(runtime)

    holder: dict = {}  # the run's RunDiagnostics, once the loop is made
    # the process's RSS (and on CUDA the allocator's bytes) every RSS_EVERY tokens: whether the
    # host memory grows through a run (docs/benchmarks.md §22k: a mixed plan's did on the H100)
    rss_trace: list = []
    cuda = device == "cuda"

    def on_each():
        d = holder.get("diag")
        if d is not None:
            d.on_token()
        k = len(streamer.times)  # (the streamer, made below, has just timed this token)
        if k % RSS_EVERY == 1:
            rss_trace.append([k, rss_bytes(), int(torch.cuda.memory_allocated()) if cuda else None])

    streamer, limit = _make_streamer_and_stop(torch, device, spec.get("time_limit_s"), int(spec.get("min_tokens", 2)), on_first_token,
                                              on_each=on_each)
    gen_kw = dict(
        attention_mask=mask,
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=sample,
        num_beams=1,
        streamer=streamer,
        stopping_criteria=StoppingCriteriaList([limit]),
        pad_token_id=int(case.get("pad_token_id", 0)),
    )
    if sample:
        gen_kw["temperature"] = float(case.get("temperature") or 1.0)
    else:
        for k in ("temperature", "top_p", "top_k"):  # silence "generation flags are not valid" from sampling configs
            gen_kw[k] = None
    if forced is not None:
        from transformers import LogitsProcessorList

        gen_kw["logits_processor"] = LogitsProcessorList([forced])
    seed = int(case.get("seed") or 0)
    sampler.reset()
    io0 = read_io().get("read_bytes", 0)
    c0 = snapshot_counters(runtime)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    loop = _loop_for(model, runtime, torch, spec, int(ids.shape[0]))
    diag = None
    if runtime is not None and spec.get("diagnostics", True) and getattr(runtime, "counters", None) is not None:
        diag = holder["diag"] = RunDiagnostics(runtime, graphed=loop is not None and getattr(loop, "graphed", None) is not None)
    if sample:
        torch.manual_seed(seed)
    t0 = time.perf_counter()
    limit.start = t0
    try:
        with torch.inference_mode():
            if loop is not None:
                streamer.prompt_seen = True
                res = loop.generate(ids, mask, max_new_tokens=n, min_new_tokens=n, do_sample=sample,
                                    generation_kwargs={k: v for k, v in gen_kw.items()
                                                       if k in ("pad_token_id", "num_beams", "temperature", "top_p", "top_k")},
                                    on_token=lambda _ids: streamer.put(None),
                                    stop_when=lambda _n: bool(limit(ids, None)[0]), forced=forced)
                gen = res.tokens
            else:
                out = model.generate(ids, **gen_kw)
                # decoder-only: the prompt, then the new tokens; encoder-decoder (SwitchTransformers):
                # the decoder's start token, then the new tokens (the prompt went to the encoder once)
                skip = 1 if getattr(model.config, "is_encoder_decoder", False) else ids.shape[1]
                gen = out[:, skip:].tolist()
        if device == "cuda":
            torch.cuda.synchronize()
    except BaseException:
        if diag is not None:
            diag.abort()
        raise
    t_end = time.perf_counter()
    io1 = read_io().get("read_bytes", 0)
    c1 = snapshot_counters(runtime)
    times = streamer.times
    ntok = len(gen[0]) if gen else 0
    ttft = (times[0] - t0) if times else None
    tpot = ((times[-1] - times[0]) / (len(times) - 1)) if len(times) >= 2 else None
    batch = ids.shape[0]
    e2e = t_end - t0
    rec = {
        "batch": batch,
        "new_tokens": n,
        "generated": ntok,
        "stopped_by_time_limit": bool(limit.hit) and ntok < n,
        "ttft_s": ttft,
        "tpot_s": tpot,
        "e2e_s": e2e,
        "tokens_per_s": batch * ntok / e2e if e2e > 0 else None,
        "decode_tokens_per_s": (batch * (len(times) - 1) / (times[-1] - times[0])) if len(times) >= 2 and times[-1] > times[0] else None,
        "bytes_read_io": io1 - io0,
        "decode_bytes_read_io": (io1 - first["io"]) if "io" in first else None,
        "peak_rss_run_bytes": sampler.window_peak,
        "rss_by_token": rss_trace,
        "cold_mode": cold_mode,
        "tokens": gen,
        "decode_loop": loop is not None,
    }
    from zipmoe.runtime.bench.diagnostics import workload_record

    rec.update(workload_record(case, gen, forced))
    if loop is not None:
        # kv_bytes: what the cache may reach (the whole context: the cgroup's allowance);
        # kv_columns: the positions it had grown to by the run's end
        rec.update(context=loop.context, kv_bytes=loop.kv_bytes_limit, kv_columns=loop.columns, stop=res.stop)
    if runtime is not None:
        diff = counter_diff(c0, c1) if c0 is not None else c1
        rec["counters"] = diff
        b = counter_bytes(diff)
        rec["bytes_read_engine"] = b
        if "counters" in first and first["counters"] is not None:
            rec["decode_bytes_read_engine"] = counter_bytes(counter_diff(first["counters"], c1))
    if diag is not None:
        rec.update(diag.finish(gen, spec, batch))
    if device == "cuda":
        rec["cuda_peak_bytes"] = int(torch.cuda.max_memory_allocated())
        from zipmoe.machine import gpu_used_bytes

        rec["gpu_used_bytes"] = gpu_used_bytes(torch)
    if runtime is not None and hasattr(runtime, "memory"):
        rec["memory"] = runtime.memory()  # counted (allocator rounding included) beside the allocator's figures
    return rec


def _emit(path: str | None, rec: dict) -> None:
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")


def main() -> int:
    cgroup = join_from_env()  # before torch: everything this process touches is charged
    spec = json.loads(sys.stdin.read())
    global _hard_exit
    _hard_exit = spec.get("engine") in HARD_EXIT_ENGINES
    result_path = spec.get("result_path")
    # keep stdout for the final JSON: libraries print to fd 1 (C code too)
    real_stdout = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    doc = {"engine": spec["engine"], "budget": spec.get("budget"), "ok": False, "cgroup": cgroup, "runs": []}
    sampler = RssSampler()
    try:
        import torch

        threads = spec.get("threads")
        if threads:
            torch.set_num_threads(int(threads))
        device = spec["device"]
        if device == "cuda":
            from zipmoe.machine import resolve_device

            resolve_device(device)  # DeviceError when this process sees no CUDA device
            doc["gpu"] = torch.cuda.get_device_name(0)
            doc["gpu_memory_bytes"] = int(torch.cuda.get_device_properties(0).total_memory)
        from zipmoe.runtime.bench import cold, engines

        if engines.engine(spec["engine"]).kind == "zipmoe":
            from zipmoe.runtime.engine import loader  # noqa: F401  (its imports belong to the baseline, not to the budget)
        else:
            import transformers  # noqa: F401
        if device == "cuda":
            torch.zeros(1, device="cuda")  # the CUDA context's host memory belongs to the baseline too
        doc["preloaded"] = preload_model_code(spec)
        spec["before_load"] = pre = engines.before_load(spec)  # baselines import their packages here (part of the baseline)
        if pre:
            doc["before_load"] = pre
        if pre.get("budget_broken"):  # the engine cannot keep the budget: it runs outside it, its peak is recorded
            doc["budget_broken"] = pre["budget_broken"]
            if cgroup:
                import psutil

                set_own_limit(cgroup, int(psutil.virtual_memory().total))
        elif cgroup and spec.get("budget") is not None and spec.get("cgroup_margin") is not None:
            # the limit becomes budget + what this process needs before any weight + a margin,
            # measured, so that the slack cannot hold a small model in page cache
            base = rss_bytes()
            kv = kv_allowance(spec)  # the KV cache comes on top of the budget
            limit = int(spec["budget"]) + base + int(spec["cgroup_margin"]) + kv
            doc["process_base_rss_bytes"] = base
            doc["kv_allowance_bytes"] = kv
            if pre.get("cgroup_after_load"):  # the engine's loading needs more (said in load_note): the limit applies once loaded
                doc["load_note"] = pre["cgroup_after_load"]
            else:
                doc["cgroup_limit_bytes"] = limit if set_own_limit(cgroup, limit) else None

        cold_paths = spec.get("cold_paths") or []
        # no cache drop before loading: it would also evict torch's own libraries and time
        # their re-reading; every measured run below starts cold
        io0 = read_io().get("read_bytes", 0)
        t0 = time.perf_counter()
        model, runtime, info = engines.load_engine(spec)
        doc["load_s"] = time.perf_counter() - t0
        if doc.get("load_note") and cgroup:
            doc["rss_before_limit_bytes"] = rss_bytes()
            doc["cgroup_limit_bytes"] = limit if set_own_limit(cgroup, limit) else None
            if doc["cgroup_limit_bytes"] is None:
                doc["budget_broken"] = f"after loading it still held more than budget + its baseline + margin ({limit} bytes), so the limit could not be applied"
        doc["load_bytes_read_io"] = read_io().get("read_bytes", 0) - io0
        doc["load_info"] = info
        doc["rss_after_load_bytes"] = rss_bytes()
        total = len(spec["cases"]) * int(spec.get("runs", 1))
        done = 0
        own = getattr(model, "bench_run_case", None)  # an engine that is not a transformers model measures itself

        def one(case, mode):
            if own is not None:
                return own(case, spec, sampler, mode, read_io)
            return run_case(model, runtime, torch, case, spec, sampler, mode)

        for case in spec["cases"]:
            if spec.get("warmup"):
                one(dict(case, new_tokens=min(2, int(case["new_tokens"]))), None)
            for r in range(int(spec.get("runs", 1))):
                mode = cold.make_cold(cold_paths, spec.get("allow_drop_caches", True)) if spec.get("cold") else "warm"
                rec = one(case, mode)
                rec.update(engine=spec["engine"], budget=spec.get("budget"), run=r, case=case.get("id"))
                if doc.get("budget_broken"):
                    rec["budget_broken"] = doc["budget_broken"]
                doc["runs"].append(rec)
                _emit(result_path, rec)
                done += 1
                sys.stderr.write(f"@@progress {done} {total}\n")
                sys.stderr.flush()
        doc["ok"] = True
        if runtime is not None and spec.get("trace") and hasattr(runtime, "stop_trace"):
            runtime.stop_trace()
    except BaseException as exc:  # report, never hang: the parent decides what it means
        name = type(exc).__name__
        from zipmoe.errors import ZipmoeError

        doc["error"] = str(exc).splitlines()[0] if str(exc) else name
        doc["error_type"] = name
        doc["user_error"] = isinstance(exc, ZipmoeError)
        if isinstance(exc, MemoryError) or "out of memory" in str(exc).lower():
            doc["error_type"] = "MemoryError"
        if not doc["user_error"]:
            traceback.print_exc(file=sys.stderr)
    finally:
        sampler.stop()
        doc["peak_rss_sampled_bytes"] = sampler.peak
        doc["ru_maxrss_bytes"] = ru_maxrss_bytes()
        try:
            import torch

            if torch.cuda.is_available() and spec.get("device") == "cuda":
                doc["cuda_max_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
        except Exception:
            pass
    real_stdout.write(json.dumps(doc) + "\n")
    real_stdout.flush()
    return 0 if doc["ok"] else 1


# Engines whose native threads can keep a finished process from exiting (MoE-Infinity's I/O and
# prefetch threads, joined in static destructors): their worker leaves with os._exit once its
# result line is written and flushed, so the parent never waits for a process that is done.
HARD_EXIT_ENGINES = ("moe-infinity",)
_hard_exit = False


if __name__ == "__main__":  # pragma: no cover
    code = main()
    if _hard_exit:
        sys.stderr.flush()
        os._exit(code)
    raise SystemExit(code)
