"""A small byte-level tokenizer that transformers loads offline, built on the spot.

Ids: 0 ``<pad>``, 1 ``</s>`` (end of text), 2 ``<s>``, 3 ``<|im_start|>``, 4 ``<|im_end|>``, then
the 256 bytes (GPT-2's byte-to-unicode alphabet), no merges: any text round-trips, 261 tokens,
which fits every preset's vocabulary. The chat template is ChatML, as Qwen and SmolLM2 use.
"""

from __future__ import annotations

from pathlib import Path

SPECIALS = ["<pad>", "</s>", "<s>", "<|im_start|>", "<|im_end|>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def build_tokenizer():
    """A ``PreTrainedTokenizerFast`` with the byte alphabet, the specials and the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for b, ch in sorted(_bytes_to_unicode().items()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="</s>",
        bos_token="<s>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )


def save_tokenizer(out_dir: Path) -> None:
    build_tokenizer().save_pretrained(str(out_dir))
