"""What every engine of a benchmark reads, prepared once by the driver (runtime/bench/run.py).

* the prompts (:data:`DEFAULT_PROMPTS`, or ``--prompts FILE``: plain lines or JSON lines) and
  their token ids, tokenised here so that every engine gets exactly the same ids, left padded
  into one case per (batch, new tokens); with the ``corpus`` workload (the default,
  runtime/plan/workload.py) each row is a passage of the bundled corpus (or a ``--prompts``
  line) instead: its first tokens are the prompt and the next ``new_tokens`` the ``forced``
  stream every engine is made to decode (:func:`corpus_ids`);
* the source safetensors folder for the Hugging Face engines (``--source``, else the container
  unpacked once into the work folder) and the codec-raw container of the ``uncompressed``
  engine (packed once from the source). ``cfg`` is the driver's ``BenchConfig``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from zipmoe.errors import UsageError

__all__ = ["DEFAULT_PROMPTS", "CORPUS_PROMPT_TOKENS", "read_prompts", "load_tokenizer", "tokenize", "pad_id", "corpus_ids",
           "make_cases", "run_context", "prepare_source", "prepare_raw_container"]

CORPUS_PROMPT_TOKENS = 32  # the corpus workload's prompt: a passage's first 32 tokens

DEFAULT_PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "Explain in one paragraph why the sky is blue.",
    "def fibonacci(n):",
    "List three facts about the Moon:",
    "Translate to German: The weather is nice today.",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics are",
]



def read_prompts(path: Path | None) -> list[str]:
    if path is None:
        return list(DEFAULT_PROMPTS)
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"--prompts {p}: no such file")
    text = p.read_text(encoding="utf-8", errors="replace")
    prompts = []
    if p.suffix in (".jsonl", ".json"):
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                raise UsageError(f"--prompts {p}: line {n} is not JSON (use one JSON object per line, or plain text lines)") from None
            prompts.append(obj if isinstance(obj, str) else str(obj.get("prompt") or obj.get("text") or ""))
    else:
        prompts = [line for line in text.splitlines() if line.strip()]
    prompts = [x for x in prompts if x.strip()]
    if not prompts:
        raise UsageError(f"--prompts {p}: no prompts in the file (one per line)")
    return prompts


def load_tokenizer(folder: Path | None):
    """The model's tokenizer from a folder, or None when it has no tokenizer files."""
    if folder is None or not any((folder / n).exists() for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")):
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(folder))
    except Exception:
        return None


def pad_id(tokenizer, config: dict) -> int:
    """The pad id :func:`tokenize` uses: the tokenizer's pad (else its EOS), else the config's pad, EOS, 0."""
    pad = config.get("pad_token_id")
    eos = config.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if tokenizer is not None:
        tpad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if tpad is not None:
            return int(tpad)
    return int(pad if pad is not None else (eos if eos is not None else 0))


def corpus_ids(tokenizer, config: dict, batches: list[int], new_tokens: list[int], texts: list[str] | None = None,
               prompt_tokens: int = CORPUS_PROMPT_TOKENS) -> tuple[list[list[int]], list[list[int]], int, str]:
    """The corpus workload's ``(prompt ids, forced ids, pad, origin)`` for the largest batch and
    token count (a smaller case takes the first rows and tokens): runtime/plan/workload.py's
    :func:`~zipmoe.runtime.plan.workload.teacher_forced`, ``texts`` being the bundled passages or
    the ``--prompts`` lines."""
    from zipmoe.runtime.plan.workload import ids_origin, teacher_forced

    prompts, forced = teacher_forced(tokenizer, config, rows=max(batches), prompt_tokens=prompt_tokens,
                                     new_tokens=max(new_tokens), texts=texts)
    origin = ids_origin(tokenizer) + (", teacher-forced --prompts texts" if texts is not None else ", teacher-forced corpus")
    return prompts, forced, pad_id(tokenizer, config), origin


def tokenize(prompts: list[str], tokenizer, config: dict, max_tokens: int, seed: int) -> tuple[list[list[int]], int, str]:
    """Token ids per prompt, the pad id, and where the ids came from."""
    pad = config.get("pad_token_id")
    eos = config.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if tokenizer is not None:
        ids = [tokenizer(p, add_special_tokens=True)["input_ids"][:max_tokens] for p in prompts]
        tpad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        pad = tpad if tpad is not None else (pad if pad is not None else (eos if eos is not None else 0))
        ids = [x if x else [pad] for x in ids]
        return ids, int(pad), "tokenizer"
    vocab = int(config.get("vocab_size") or 1000)
    rng = random.Random(seed)
    ids = []
    for i, p in enumerate(prompts):  # deterministic ids of varying length (no tokenizer in the model)
        n = max(4, min(max_tokens, 8 + (len(p) % 17)))
        ids.append([rng.randrange(min(vocab, 32000) if vocab > 2 else vocab) for _ in range(n)])
    return ids, int(pad if pad is not None else (eos if eos is not None else 0)), "synthetic ids (the model has no tokenizer)"


def make_cases(prompt_ids: list[list[int]], pad: int, batches: list[int], new_tokens: list[int], *, workload: str = "greedy",
               forced: list[list[int]] | None = None, temperature: float = 1.0, seed: int = 0) -> list[dict]:
    """One case per (batch, new tokens): rows are prompts taken in order (cycling), left padded.
    Each case names its ``workload``; ``forced`` (the corpus workload): each row's forced ids, cut
    to the case's new tokens; the sample workload's cases carry ``temperature`` and ``seed``."""
    cases = []
    for b in batches:
        rows = [prompt_ids[i % len(prompt_ids)] for i in range(b)]
        width = max(len(r) for r in rows)
        ids = [[pad] * (width - len(r)) + r for r in rows]
        mask = [[0] * (width - len(r)) + [1] * len(r) for r in rows]
        for n in new_tokens:
            case = {"id": f"b{b}-n{n}", "batch": b, "new_tokens": n, "input_ids": ids, "attention_mask": mask, "pad_token_id": pad,
                    "workload": workload}
            if forced is not None:
                rows_f = [forced[i % len(forced)] for i in range(b)]
                if any(len(r) < n for r in rows_f):
                    raise UsageError(f"the forced stream has fewer than {n} tokens")
                case["forced"] = [r[:n] for r in rows_f]
            if workload == "sample":
                case.update(temperature=float(temperature), seed=int(seed))
            cases.append(case)
    return cases


def run_context(cases: list[dict]) -> int:
    """The zipmoe engines' KV cache when --context is not given: the longest prompt plus its new
    tokens, rounded up to 64 positions (a static cache longer than the run costs memory, on the
    CPU inside the cgroup, and attention time over the unused positions)."""
    need = max((len((c.get("input_ids") or [[]])[0]) + max(int(c.get("new_tokens") or 0), len((c.get("forced") or [[]])[0])) + 1
                for c in cases), default=64)
    return -(-need // 64) * 64


def prepare_source(cfg, work: Path, log) -> Path:
    """The safetensors folder the Hugging Face engines load: --source, or the container unpacked."""
    if cfg.source is not None:
        src = Path(cfg.source)
        if not (src / "config.json").is_file():
            raise UsageError(f"--source {src}: not a model folder (no config.json)")
        return src
    if cfg.container is None:
        raise UsageError("the Hugging Face engines need --source DIR or a container to unpack")
    out = work / "source"
    stamp = out / ".zipmoe-bench-unpacked"
    if stamp.exists() and stamp.read_text().strip() == str(cfg.container.stat().st_mtime_ns):
        return out
    log(f"unpacking {cfg.container} to {out} for the Hugging Face engines (once)")
    from zipmoe.codecs.safetensors_out import unpack

    unpack(cfg.container, out, force=True)
    stamp.write_text(str(cfg.container.stat().st_mtime_ns))
    return out


def prepare_raw_container(cfg, work: Path, source: Path, log) -> Path:
    """A codec-raw container of the same model (the `uncompressed` engine), packed once."""
    if cfg.raw_container is not None:
        if not Path(cfg.raw_container).is_file():
            raise UsageError(f"--raw-container {cfg.raw_container}: no such file")
        return Path(cfg.raw_container)
    out = work / "raw.zmoe"
    stamp = work / "raw.zmoe.source"
    ident = f"{source.resolve()}:{max((p.stat().st_mtime_ns for p in source.glob('*.safetensors')), default=0)}"
    if out.exists() and stamp.exists() and stamp.read_text() == ident:
        return out
    log(f"packing {source} with codec raw to {out} for the 'uncompressed' engine (once)")
    from zipmoe.codecs.writer import pack

    pack(source, out, codec="raw", force=True)
    stamp.write_text(ident)
    return out
