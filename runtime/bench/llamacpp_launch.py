"""Runs llama.cpp's ``convert_hf_to_gguf.py`` (unmodified) with zipmoe synth's tokenizer known.

``python llamacpp_launch.py CONVERTER_DIR MODEL_DIR [converter arguments]`` puts ``CONVERTER_DIR``
and its ``gguf-py/`` first on the path (as the script does itself unless ``NO_LOCAL_GGUF`` is set;
runtime/bench/llamacpp_convert.py removes that variable), imports the script as a module and calls
its ``main()`` with ``MODEL_DIR`` and the arguments.

One thing is added before, in this process only: llama.cpp names a BPE tokenizer's pre-tokenizer
by the hash of the token ids it gives for a fixed text, and knows only the hashes of the hub
models ``convert_hf_to_gguf_update.py`` was run on (an unknown hash stops the conversion). zipmoe
synth's tokenizer (runtime/synth/tokenizer.py: 261 tokens, the 256 bytes in GPT-2's alphabet, no
merges) cannot give any known hash: the hash is over token ids, and its ids stop at 260. Its
pre-tokenizer is GPT-2's byte-level regex, so when the converter's lookup fails for exactly that
vocabulary, the answer is ``"gpt-2"``, the entry the update script would add. Every other tokenizer
gets the converter's own answer or its own error. No view of the checkpoint can do this (the
assertion that token ids are below ``vocab_size`` and llama.cpp's check that the vocabulary has as
many tokens as the embedding has rows rule out handing it a known tokenizer), which is why it is
done here and not in the view.
"""

from __future__ import annotations

import sys
from pathlib import Path

SYNTH_PRE = "gpt-2"


def _synth_vocab() -> dict | None:
    try:
        from zipmoe.runtime.synth.tokenizer import build_tokenizer
    except ImportError:
        return None
    return build_tokenizer().get_vocab()


def _register_synth_tokenizer(text_model) -> None:
    original = text_model.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer):
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            vocab = _synth_vocab()
            if vocab is None or tokenizer.get_vocab() != vocab:
                raise
            print(f"zipmoe: zipmoe synth's byte-level tokenizer: pre-tokenizer {SYNTH_PRE!r}", file=sys.stderr)
            return SYNTH_PRE

    text_model.get_vocab_base_pre = get_vocab_base_pre


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit("usage: llamacpp_launch.py CONVERTER_DIR MODEL_DIR [convert_hf_to_gguf.py arguments]")
    folder = Path(argv[0]).resolve()
    here = Path(__file__).resolve().parent  # runtime/bench: its modules must not shadow the converter's imports
    sys.path[:] = [str(folder), str(folder / "gguf-py")] + [p for p in sys.path if p and Path(p).resolve() != here]
    import convert_hf_to_gguf as script

    text_model = getattr(script, "TextModel", None)
    if text_model is None:  # newer llama.cpp: the model classes live in conversion/
        text_model = getattr(sys.modules.get("conversion.base"), "TextModel", None)
    if text_model is not None and hasattr(text_model, "get_vocab_base_pre"):
        _register_synth_tokenizer(text_model)
    sys.argv = [str(folder / "convert_hf_to_gguf.py"), *argv[1:]]
    script.main()


if __name__ == "__main__":
    main(sys.argv[1:])
