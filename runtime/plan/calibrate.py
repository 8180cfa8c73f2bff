"""Prompts the planner calibrates with, and the calibration itself: a trace of real routing.

What ``zipmoe plan --calibrate builtin`` (or ``corpus``) runs and what
``python -m zipmoe.runtime.plan.check --prompts builtin`` measures with (a plan is checked with
the workload it was made from) is a **workload** (runtime/plan/workload.py): by default
``corpus``, the bundled public-domain passages teacher-forced (each passage's first 32 tokens
are the prompt, every decode step is made to choose the passage's next token), because greedy
decoding of a random-weight model falls into a two-token loop whose routing repeats, and a
plan calibrated on it is a plan for a cache that hits 99%. ``greedy`` (the short
``BUILTIN_PROMPTS`` answered greedily, the behaviour before 2026-12) and ``sample``
(temperature 1.0, a fixed seed) stay available. :func:`read_prompts` reads ``builtin`` /
``corpus`` or a file of one prompt per line (with ``corpus``: the texts to teacher-force);
:func:`encode` is how the greedy and sample workloads turn a prompt into token ids (the chat
template where the tokenizer has one); :func:`calibration_inputs` gives every workload's
per-row ids and forced tokens; :func:`record_trace` serves them with a trace on.

The benchmark harness has its own prompts (``zipmoe.runtime.bench.inputs.DEFAULT_PROMPTS``:
completions, the same for every engine; docs/benchmarks.md's figures were measured with them).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from zipmoe.errors import UsageError

__all__ = ["BUILTIN_PROMPTS", "BUILTIN_NAMES", "read_prompts", "encode", "calibration_inputs", "record_trace", "read_recall",
           "prediction_path"]

BUILTIN_NAMES = ("builtin", "corpus")  # the built-in prompts: the corpus passages (corpus workload) or BUILTIN_PROMPTS

BUILTIN_PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain how a binary search works.",
    "List three uses of a paperclip.",
    "def fibonacci(n):",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
]


def read_prompts(arg: str, workload: str = "corpus") -> list[str]:
    """``builtin`` or ``corpus``: the built-in texts of ``workload`` (the corpus passages for
    ``corpus``, :data:`BUILTIN_PROMPTS` for ``greedy`` and ``sample``); else a file of prompts,
    one per line (blank lines skipped)."""
    from zipmoe.runtime.plan.workload import check_workload, corpus_passages

    check_workload(workload)
    if arg in BUILTIN_NAMES:
        return corpus_passages() if workload == "corpus" else list(BUILTIN_PROMPTS)
    p = Path(arg)
    try:
        prompts = [line.strip() for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
    except OSError as exc:
        raise UsageError(f"cannot read prompts {p}: {exc.strerror or exc} (one prompt per line, or `builtin`)") from None
    if not prompts:
        raise UsageError(f"{p} has no prompts (one per line)")
    return prompts


def encode(tok, prompt: str):
    """Token ids ``[1, n]`` of ``prompt`` as a user turn (the chat template where there is one);
    a model without a tokenizer gets the fixed ids 1..8."""
    import torch

    if tok is None:
        return torch.arange(1, 9).unsqueeze(0)
    if getattr(tok, "chat_template", None):
        return tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                       return_tensors="pt", return_dict=True)["input_ids"]
    return tok(prompt, return_tensors="pt")["input_ids"]


def load_kwargs(dtype: str) -> dict:
    """``load`` keywords for the compute dtype (omitted for the default, bfloat16)."""
    return {} if dtype in ("bfloat16", "bf16") else {"dtype": dtype}


def calibration_inputs(tok, config: dict, prompts: list[str], workload: str = "corpus", new_tokens: int = 32,
                       prompt_tokens: int = 32) -> list[tuple[list[int], list[int] | None]]:
    """One ``(prompt ids, forced ids or None)`` per row, served one after another at batch 1.

    ``corpus``: each text teacher-forced (runtime/plan/workload.py's ``teacher_forced``: the
    text's first ``prompt_tokens`` tokens, then the ``new_tokens`` that follow, continuing into
    the next text when one is short; hashed word ids when the model has no real tokenizer);
    ``greedy`` / ``sample``: each prompt as :func:`encode` gives it, nothing forced."""
    from zipmoe.runtime.plan.workload import check_workload, teacher_forced

    check_workload(workload)
    if workload == "corpus":
        ids, forced = teacher_forced(tok, config, rows=len(prompts), prompt_tokens=prompt_tokens, new_tokens=new_tokens,
                                     texts=prompts)
        return list(zip(ids, forced))
    return [(encode(tok, p)[0].tolist(), None) for p in prompts]


def record_trace(path, prompts: list[str], budget: int, device: str, workers: int, max_new_tokens: int = 32,
                 dtype: str = "bfloat16", load_options: dict | None = None, workload: str = "corpus", seed: int = 0,
                 temperature: float = 1.0, on_done=None) -> Path:
    """Serve ``prompts`` through the runtime with a trace on (``workload``: ``corpus``, teacher
    forcing of the texts, the default; ``greedy``; ``sample`` at ``temperature``, the seed set
    before each prompt); returns the trace path. ``load_options``: more keyword arguments of
    ``load`` (``readers``, ``prefetch``, ``force``). ``on_done(runtime)``: called once the prompts
    are served (``zipmoe plan`` adds the calibration's routing to the container's kept activation
    statistics with it, as a run of ``chat`` adds its own: the default plan is then fitted from it)."""
    import torch

    from zipmoe.machine import torch_threads
    from zipmoe.runtime.engine.loader import load
    from zipmoe.runtime.engine.loop import generate_ids

    model, tok = load(path, budget=budget, device=device, workers=workers, threads=torch_threads(workers),
                      **load_kwargs(dtype), **(load_options or {}))
    if tok is None and workload != "corpus":
        raise UsageError(f"{path} has no tokenizer: calibrate with the corpus workload (hashed word ids), or record a trace "
                         "with `zipmoe chat --trace-out` or `bench` instead of --calibrate")
    rows = calibration_inputs(tok, model.config.to_dict(), prompts, workload, max_new_tokens)
    pad = None if tok is None else (tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    fd, trace = tempfile.mkstemp(prefix="zipmoe-calib-", suffix=".jsonl")
    os.close(fd)
    rt = model.zipmoe
    rt.start_trace(trace)
    try:
        with torch.inference_mode():
            for i, (prompt, forced) in enumerate(rows):
                ids = torch.tensor([prompt], dtype=torch.long, device=model.device)
                kw = {}
                if workload == "sample":
                    torch.manual_seed(int(seed) + i)
                    kw = {"temperature": float(temperature)}
                generate_ids(model, ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens if forced is not None else 0, do_sample=workload == "sample",
                             pad_token_id=pad, forced=[forced] if forced is not None else None, **kw)
    finally:
        rt.stop_trace()
    _write_prediction(Path(trace), rt)
    if on_done is not None:
        on_done(rt)
    return Path(trace)


def prediction_path(trace) -> Path:
    """The side file of a calibration trace with its prefetch figures."""
    return Path(str(trace) + ".prefetch.json")


def _write_prediction(trace: Path, rt) -> None:
    """Next to the trace: whether prefetch ran and, if it did, its precision and recall over the
    calibration (the planner credits the fetch time prefetch hides with the recall)."""
    import json

    from zipmoe.runtime.engine.counters import prediction_quality

    on = bool(rt.prefetch and rt.predictor is not None)
    q = prediction_quality(rt.counters.snapshot()).get("all") or {}
    doc = {"prefetch": on, "precision": q.get("precision") if on else None, "recall": q.get("recall") if on else None}
    try:
        prediction_path(trace).write_text(json.dumps(doc), encoding="utf-8")
    except OSError:
        pass


def read_recall(traces) -> float | None:
    """The mean prefetch recall over the traces' side files (None when none has one)."""
    import json

    vals = []
    for t in traces:
        try:
            d = json.loads(prediction_path(t).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if d.get("prefetch") and isinstance(d.get("recall"), (int, float)):
            vals.append(float(d["recall"]))
    return sum(vals) / len(vals) if vals else None
