"""The tiny pipelines' text side (``_tiny``): tokenizers built in memory (a character-level
CLIP BPE, a character-level T5 Unigram, a byte-level Qwen2 BPE) and the configs of the
text encoders that match them. Nothing is downloaded.
"""

from __future__ import annotations

import string
from typing import Any

__all__ = [
    "QWEN_VOCAB_SIZE",
    "clip_config",
    "clip_tokenizer",
    "qwen_tokenizer",
    "t5_config",
    "t5_tokenizer",
]

CLIP_MAX_LENGTH = 32
"""Tokens per CLIP prompt (start and end tokens included); one token per character."""

T5_MAX_LENGTH = 512
"""The T5 tokenizer's limit; FluxPipeline pads to its ``max_sequence_length`` (512)."""


def _transformers() -> Any:
    """The transformers module, imported on first use and typed ``Any``."""
    import transformers

    return transformers


# ---------------------------------------------------------------------------- tokenizers


def byte_symbols() -> list[str]:
    """The 256 printable characters byte-level BPE maps bytes to (GPT-2's table)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\xa1"), ord("\xac") + 1),
        *range(ord("\xae"), ord("\xff") + 1),
    ]
    symbols: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def clip_tokenizer() -> Any:
    """A character-level CLIP tokenizer: 256 byte symbols, each also with ``</w>``.

    Ids 0-255 are the byte symbols, 256-511 the same with ``</w>`` (end of word), 512 is
    ``<|startoftext|>`` and 513 ``<|endoftext|>`` (also the padding), as in real CLIP
    where the two special tokens come last. No merges: one token per character.
    """
    transformers = _transformers()
    symbols = byte_symbols()
    vocab = {symbol: i for i, symbol in enumerate(symbols)}
    vocab.update({f"{symbol}</w>": 256 + i for i, symbol in enumerate(symbols)})
    vocab["<|startoftext|>"] = 512
    vocab["<|endoftext|>"] = 513
    return transformers.CLIPTokenizer(vocab=vocab, merges=[], model_max_length=CLIP_MAX_LENGTH)


CLIP_VOCAB_SIZE = 514
CLIP_BOS_ID = 512
CLIP_EOS_ID = 513


def t5_tokenizer() -> Any:
    """A character-level T5 (Unigram) tokenizer over printable ASCII, no sentinels."""
    transformers = _transformers()
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    vocab += [(char, -3.0) for char in string.printable if not char.isspace()]
    return transformers.T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=T5_MAX_LENGTH)


T5_VOCAB_SIZE = 128  # >= 4 + 94 printable characters

QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""Ids 256, 257, 258 of :func:`qwen_tokenizer`: the padding and the chat template's markers."""


def qwen_tokenizer() -> Any:
    """A byte-level Qwen2 tokenizer: ids 0-255 are the bytes, no merges; then the specials.

    The chat markers are special tokens, as in the real one, so QwenImagePipeline's
    prompt template splits the same way (one token per other byte: the template's
    system part is longer than the real 34 tokens, which only keeps more of it).
    """
    transformers = _transformers()
    vocab = {symbol: i for i, symbol in enumerate(byte_symbols())}
    for token in QWEN_SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    return transformers.Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        additional_special_tokens=list(QWEN_SPECIAL_TOKENS[1:]),
        model_max_length=2048,
    )


QWEN_VOCAB_SIZE = 256 + len(QWEN_SPECIAL_TOKENS)


# ------------------------------------------------------------------------ text encoders


def clip_config() -> Any:
    """A 2-layer CLIP text encoder config matching :func:`clip_tokenizer`.

    SD and SD3 read the penultimate hidden state; SD3 and Flux the pooled (end token)
    output, found by ``eos_token_id`` (its special value 2 would mean "argmax id").
    """
    transformers = _transformers()
    return transformers.CLIPTextConfig(
        vocab_size=CLIP_VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=64,
        projection_dim=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=CLIP_MAX_LENGTH,
        hidden_act="quick_gelu",
        bos_token_id=CLIP_BOS_ID,
        eos_token_id=CLIP_EOS_ID,
        pad_token_id=CLIP_EOS_ID,
    )


def t5_config(kind: str = "T5Config") -> Any:
    """A 2-layer T5-style encoder config matching :func:`t5_tokenizer` (``kind``: its class)."""
    return getattr(_transformers(), kind)(
        vocab_size=T5_VOCAB_SIZE,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        dropout_rate=0.0,
        feed_forward_proj="gated-gelu",
        is_encoder_decoder=False,
        use_cache=False,
        pad_token_id=0,
        eos_token_id=1,
    )
