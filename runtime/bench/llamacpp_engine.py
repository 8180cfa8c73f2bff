"""The ``llama.cpp`` engine of `zipmoe bench`: the model as a bf16 GGUF (written by llama.cpp's
own converter: runtime/bench/llamacpp_convert.py) served by llama-cpp-python, the file
memory-mapped (``use_mmap=True``: weights live in the page cache, which the engine's memory
cgroup caps at the budget like every other engine's memory).

Same token ids as every engine (the parent tokenises once), greedy: after each step the argmax
of the last logits, with the end-of-sequence ids masked as transformers' ``min_new_tokens``
masks them, so every engine makes the same number of tokens. llama-cpp-python's ``Llama``
serves one sequence: a batch of B prompts is served row after row, so ``tokens_per_s`` is what
a user of that API gets at batch B, ``ttft_s`` is the first row's and ``tpot_s`` the mean time
between tokens over all rows. llama.cpp computes with its own kernels (bf16 weights, float32
activations on the CPU): the same bits in, not the same arithmetic, so its tokens agreeing with
zipmoe's is a figure (``token_agreement`` in the report), not a check.

Workloads: teacher forcing (``corpus``) evaluates each step's forced token instead of the
argmax (the argmax is kept, ``argmax_tokens``, for the agreement figure); ``sample`` is not
supported: it decodes greedily and its record says ``greedy (sampling not supported)``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from zipmoe.errors import UsageError

EXTRA_LINE = "baseline 'llama.cpp' needs the llama-cpp-python package: pip install 'zipmoe[baselines]' (it compiles llama.cpp: many minutes)"


def import_llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        raise UsageError(EXTRA_LINE) from None
    except OSError as exc:  # the shared library failed to load
        raise UsageError(f"baseline 'llama.cpp': llama-cpp-python is installed but its library does not load ({exc})") from None
    return llama_cpp


def before_load(spec: dict) -> dict:
    """In the worker before its cgroup is tightened: load the library (part of the baseline)."""
    llama_cpp = import_llama_cpp()
    info = {"llama_cpp_python": getattr(llama_cpp, "__version__", "?")}
    if spec["device"] == "cuda":
        supports = getattr(llama_cpp, "llama_supports_gpu_offload", None)
        if supports is None or not supports():
            raise UsageError("baseline 'llama.cpp' on --device cuda needs a CUDA build of llama-cpp-python "
                             "(CMAKE_ARGS=-DGGML_CUDA=on pip install llama-cpp-python); this one is CPU only")
    return info


def _eos_ids(source: str | None) -> list[int]:
    """The end-of-sequence ids transformers masks for ``min_new_tokens``: generation_config.json's,
    else config.json's (engine/sampling.py's ``eos_ids``)."""
    from zipmoe.runtime.engine.sampling import eos_ids

    docs = []
    for name in ("generation_config.json", "config.json"):
        try:
            doc = json.loads(Path(source, name).read_text()) if source else None
        except (OSError, json.JSONDecodeError):
            doc = None
        docs.append(doc if isinstance(doc, dict) else None)
    return eos_ids(*docs)


class LlamaCppModel:
    """llama-cpp-python's ``Llama`` behind the bench worker's ``bench_run_case`` hook."""

    def __init__(self, spec: dict, info: dict):
        llama_cpp = import_llama_cpp()
        path = spec.get("gguf")
        if not path or not Path(path).is_file():
            raise UsageError(f"baseline 'llama.cpp': no GGUF file to serve ({path})")
        longest = max((len(r) for c in spec["cases"] for r in c["input_ids"]), default=1)
        most = max((int(c["new_tokens"]) for c in spec["cases"]), default=1)
        n_ctx = longest + most + 8
        threads = int(spec.get("threads") or os.cpu_count() or 1)
        kw = dict(model_path=str(path), n_ctx=n_ctx, n_batch=max(32, min(512, longest)), n_threads=threads,
                  n_threads_batch=threads, use_mmap=True, use_mlock=False, n_gpu_layers=-1 if spec["device"] == "cuda" else 0,
                  logits_all=False, verbose=False, seed=0)
        if spec.get("cold"):
            # the file out of the page cache *before* it is mapped: the pages the runs fault in are then
            # charged to this worker's cgroup (its budget), and cold runs read them from disk. Pages
            # left from the conversion (written by bench's process, charged to its cgroup) would
            # otherwise serve every run, and the per-run cold step cannot evict pages a process maps
            # (the H200 sitting of 4 Dec: 0 bytes read per token, RSS 9.1 GiB at a 5.31 GiB budget).
            from zipmoe.runtime.bench.cold import make_cold

            info["evicted_before_load"] = make_cold([path], allow_drop_caches=False) == "fadvise"
        self.llm = llama_cpp.Llama(**kw)
        self._lib = llama_cpp
        self.n_vocab = self.llm.n_vocab()
        self.eos = [e for e in _eos_ids(spec.get("source")) if 0 <= e < self.n_vocab]
        self.device = spec["device"]
        info.update(path=str(path), kwargs={k: str(v) for k, v in kw.items() if k != "model_path"}, n_vocab=self.llm.n_vocab(),
                    batch_mode="rows one after another (llama-cpp-python serves one sequence)")

    def _greedy_next(self) -> int:
        import numpy as np

        # the last evaluated token's logits, straight from llama.cpp (Llama.scores is only kept with logits_all)
        ptr = self._lib.llama_get_logits_ith(self.llm._ctx.ctx, -1)
        logits = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).astype(np.float32, copy=True)
        if self.eos:
            logits[self.eos] = -np.inf
        return int(np.argmax(logits))

    def bench_run_case(self, case: dict, spec: dict, sampler, cold_mode, read_io) -> dict:
        n = int(case["new_tokens"])
        time_limit = spec.get("time_limit_s")
        min_tokens = int(spec.get("min_tokens", 2))
        rows = [[t for t, m in zip(ids, mask) if m] for ids, mask in zip(case["input_ids"], case["attention_mask"])]
        forced = case.get("forced")
        argmax: list[list[int]] = []
        sampler.reset()
        io0 = read_io().get("read_bytes", 0)
        io_first = None
        t0 = time.perf_counter()
        gen: list[list[int]] = []
        first_times, decode_time, decode_steps = [], 0.0, 0
        stopped = False
        for r, row in enumerate(rows):
            self.llm.reset()
            r0 = time.perf_counter()
            self.llm.eval(row)
            toks, times, best = [], [], []
            argmax.append(best)
            while len(toks) < n:
                tok = self._greedy_next()
                best.append(tok)
                if forced:  # teacher forcing: the stream's token is the one fed on
                    tok = int(forced[r][len(toks)])
                times.append(time.perf_counter())
                toks.append(tok)
                if io_first is None:
                    io_first = read_io().get("read_bytes", 0)
                if len(toks) >= n:
                    break
                if time_limit is not None and len(toks) >= min_tokens and time.perf_counter() - t0 > time_limit:
                    stopped = True
                    break
                self.llm.eval([tok])
            first_times.append(times[0] - r0)
            if len(times) >= 2:
                decode_time += times[-1] - times[0]
                decode_steps += len(times) - 1
            gen.append(toks)
            if stopped:
                break
        t_end = time.perf_counter()
        io1 = read_io().get("read_bytes", 0)
        batch = len(rows)
        ntok = min(len(g) for g in gen) if len(gen) == batch else 0
        total = sum(len(g) for g in gen)
        e2e = t_end - t0
        from zipmoe.runtime.bench.diagnostics import workload_record

        wl = workload_record(case, gen, argmax if forced else None)
        if wl["workload"] == "sample":
            wl = dict(wl, workload="greedy (sampling not supported)")
        return {
            **wl,
            "batch": batch,
            "new_tokens": n,
            "generated": ntok if len(gen) == batch else min(len(g) for g in gen),
            "stopped_by_time_limit": stopped,
            "ttft_s": first_times[0] if first_times else None,
            "tpot_s": decode_time / decode_steps if decode_steps else None,
            "e2e_s": e2e,
            "tokens_per_s": total / e2e if e2e > 0 else None,
            "decode_tokens_per_s": decode_steps / decode_time if decode_time > 0 else None,
            "bytes_read_io": io1 - io0,
            "decode_bytes_read_io": (io1 - io_first) if io_first is not None else None,
            "peak_rss_run_bytes": sampler.window_peak,
            "cold_mode": cold_mode,
            "tokens": gen,
            "rows_served": "one after another",
        }


def load(spec: dict, info: dict):
    return LlamaCppModel(spec, info), info
