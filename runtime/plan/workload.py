"""What a benchmark or a calibration decodes: workloads that are not loops.

Greedy decoding of a random-weight model (every synthetic checkpoint) falls into a two-token
loop after a few tokens: its routing then repeats with the same period and any expert cache
hits almost always, which says nothing about serving real text. The workloads:

* ``corpus`` (the default): **teacher forcing** of natural English. Each row's prompt is the
  first ``prompt_tokens`` tokens of a passage of :func:`corpus_passages` and every decode step's
  token is the passage's next token (a logits processor,
  :class:`zipmoe.runtime.engine.sampling.ForcedTokens`, makes it the only choice), so every
  engine computes the same decode step on the same token stream, whatever its logits say.
* ``sample``: sampling at ``temperature`` (1.0) with a fixed seed, from the usual prompts.
* ``greedy``: the old behaviour (argmax), kept as an option.

Token ids (:func:`passage_ids`): a model with a real tokenizer (:data:`REAL_VOCAB` = 1000
tokens or more) gets its tokenizer's ids. zipmoe's synthetic byte-level tokenizer
(runtime/synth/tokenizer.py: 261 tokens, far fewer than the model's ``vocab_size``) or no
tokenizer at all gets **hashed word ids**: each word or punctuation mark of the text maps to a
stable id in ``[5, vocab_size)`` by BLAKE2b of the word (the specials ``pad``/``bos``/``eos``
of the config skipped), so the stream has natural text's statistics (Zipfian frequencies, about
40% distinct over 500 tokens) over the model's whole vocabulary instead of bytes.

This module needs no torch; the bench harness (runtime/bench) and the planner's calibration
(runtime/plan/calibrate.py, check.py) use it.
"""

from __future__ import annotations

import functools
import hashlib
import re
from importlib import resources

from zipmoe.errors import UsageError

__all__ = ["WORKLOADS", "DEFAULT_WORKLOAD", "REAL_VOCAB", "ROW_SHIFT", "corpus_passages", "corpus_sources", "check_workload",
           "uses_hashed_ids", "words", "hash_id", "passage_ids", "teacher_forced", "ids_origin"]

WORKLOADS = ("corpus", "sample", "greedy")
DEFAULT_WORKLOAD = "corpus"
REAL_VOCAB = 1000  # a tokenizer with fewer tokens is not a real one (zipmoe's byte-level tokenizer has 261)
FIRST_ID = 5  # hashed ids start here (0..4: the synthetic tokenizer's specials)
ROW_SHIFT = 97  # rows beyond the passage count start this many tokens further per round
SEPARATOR = "=== "

_WORD = re.compile(r"[A-Za-z0-9]+(?:['\u2019][A-Za-z]+)*|[^\sA-Za-z0-9]")


def check_workload(name: str) -> str:
    """``name`` when it is a workload, else a one-line UsageError."""
    if name not in WORKLOADS:
        raise UsageError(f"unknown workload {name!r}: choose from {', '.join(WORKLOADS)}")
    return name


@functools.lru_cache(maxsize=1)
def _corpus() -> tuple[tuple[str, str], ...]:
    text = resources.files("zipmoe.runtime").joinpath("data/corpus.txt").read_text(encoding="utf-8")
    out: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith(SEPARATOR):
            parts = [p.strip() for p in line[len(SEPARATOR):].split("|")]
            out.append((" | ".join(parts[1:]) if len(parts) > 1 else parts[0], []))
        elif out:
            out[-1][1].append(line)
        # lines before the first separator are the header
    return tuple((src, "\n".join(body).strip()) for src, body in out)


def corpus_passages() -> list[str]:
    """The bundled passages (runtime/data/corpus.txt), in order: eight public-domain English texts."""
    return [t for _, t in _corpus()]


def corpus_sources() -> list[str]:
    """Where each passage comes from (author, title, part, licence)."""
    return [s for s, _ in _corpus()]


def words(text: str) -> list[str]:
    """The text as words and punctuation marks (a word keeps its apostrophe: ``don't``)."""
    return _WORD.findall(text)


def _specials(config: dict) -> set[int]:
    out = set()
    for k in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
        v = config.get(k)
        for x in (v if isinstance(v, (list, tuple)) else [v]):
            if isinstance(x, int) and not isinstance(x, bool):
                out.add(x)
    return out


def hash_id(word: str, vocab_size: int, skip: frozenset | set = frozenset()) -> int:
    """The stable id of ``word`` in ``[5, vocab_size)``: BLAKE2b of the word (salted again while
    it lands on one of ``skip``, the config's special ids)."""
    span = int(vocab_size) - FIRST_ID
    if span <= 0:
        raise UsageError(f"the model's vocabulary ({vocab_size} tokens) is too small for hashed word ids")
    salt = 0
    while True:
        h = hashlib.blake2b(f"{salt}:{word}".encode("utf-8"), digest_size=8).digest()
        i = FIRST_ID + int.from_bytes(h, "little") % span
        if i not in skip or salt > 16:
            return i
        salt += 1


def uses_hashed_ids(tokenizer) -> bool:
    """True when the tokenizer is missing or not a real one (fewer than :data:`REAL_VOCAB` tokens)."""
    if tokenizer is None:
        return True
    try:
        return len(tokenizer) < REAL_VOCAB
    except TypeError:
        return int(getattr(tokenizer, "vocab_size", 0) or 0) < REAL_VOCAB


def ids_origin(tokenizer) -> str:
    """How :func:`passage_ids` makes ids for this tokenizer, in words (for the run record)."""
    if uses_hashed_ids(tokenizer):
        why = "no tokenizer" if tokenizer is None else f"its tokenizer has {len(tokenizer)} tokens"
        return f"hashed word ids in [{FIRST_ID}, vocab_size) ({why})"
    return "the model's tokenizer"


def passage_ids(tokenizer, config: dict, texts: list[str] | None = None) -> list[list[int]]:
    """Token ids of each text (default: :func:`corpus_passages`): the tokenizer's (no special
    tokens) for a real tokenizer, else hashed word ids (:func:`hash_id`)."""
    texts = corpus_passages() if texts is None else list(texts)
    if not texts:
        raise UsageError("no texts to teacher-force")
    if uses_hashed_ids(tokenizer):
        vocab = int(config.get("vocab_size") or 0)
        if vocab <= FIRST_ID:
            raise UsageError(f"the model's config gives no usable vocab_size ({config.get('vocab_size')!r}) for hashed word ids")
        skip = frozenset(_specials(config))
        return [[hash_id(w, vocab, skip) for w in words(t)] for t in texts]
    out = []
    for t in texts:
        out.append(list(tokenizer(t, add_special_tokens=False)["input_ids"]))
    return out


def _bos(tokenizer) -> list[int]:
    """The tokenizer's leading special token (BOS) when it adds one to a text, else []."""
    if uses_hashed_ids(tokenizer):
        return []
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return []
    try:
        ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    except Exception:
        return []
    return [int(bos)] if ids and ids[0] == bos else []


def teacher_forced(tokenizer, config: dict, *, rows: int, prompt_tokens: int, new_tokens: int,
                   texts: list[str] | None = None) -> tuple[list[list[int]], list[list[int]]]:
    """The ``corpus`` workload's ids: ``(prompt_ids, forced)`` of ``rows`` rows.

    Row ``i`` reads text ``i % len(texts)`` (the bundled passages by default; ``texts``: your
    own), starting :data:`ROW_SHIFT` tokens further for each time the rows wrap around the
    texts; when a text ends the row continues into the next one (cyclically). ``prompt_ids[i]``
    is the row's first ``prompt_tokens`` tokens (after the tokenizer's BOS, when it adds one),
    ``forced[i]`` the ``new_tokens`` that follow: the tokens each decode step is made to choose.
    Deterministic: the same tokenizer and config give the same ids, for every engine."""
    if rows < 1 or prompt_tokens < 1 or new_tokens < 1:
        raise UsageError("teacher forcing needs at least one row, one prompt token and one new token")
    per = passage_ids(tokenizer, config, texts)
    stream_len = sum(len(p) for p in per)
    if stream_len == 0:
        raise UsageError("the texts to teacher-force have no tokens")
    bos = _bos(tokenizer)[: prompt_tokens - 1]  # the prompt keeps at least one text token
    body = prompt_tokens - len(bos)
    need = body + new_tokens
    prompts, forced = [], []
    for i in range(rows):
        skip = (i // len(per)) * ROW_SHIFT
        out: list[int] = []
        j = i % len(per)
        while len(out) < skip + need:
            out.extend(per[j % len(per)])
            j += 1
        out = out[skip: skip + need]
        prompts.append(bos + out[:body])
        forced.append(out[body:])
    return prompts, forced
