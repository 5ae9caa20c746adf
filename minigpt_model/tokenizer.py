"""Tokenizers: bytes (built in, the default) and GPT-2 BPE through tiktoken when its files are local."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

END_OF_TEXT = "<|endoftext|>"


def pad_vocab(size: int, multiple: int = 64) -> int:
    """Round a vocabulary up so tensor-parallel sizes up to `multiple` divide it (257 -> 320, 50257 -> 50304)."""
    return -(-size // multiple) * multiple


class ByteTokenizer:
    """UTF-8 bytes 0..255, then <|endoftext|> = 256; the vocabulary is padded to 320 (a multiple of 64)."""

    name = "bytes"
    eot = 256
    vocab_size = pad_vocab(257)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class TokenizerUnavailable(Exception):
    """The requested tokenizer cannot be used on this machine (message says why and what to do)."""


class GPT2Tokenizer:
    """GPT-2 BPE (50257 tokens, padded to 50304) via tiktoken, only from files already on disk."""

    name = "gpt2"
    _FILES = (
        "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
        "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
    )

    def __init__(self):
        try:
            import tiktoken
        except ImportError:
            raise TokenizerUnavailable("--tokenizer gpt2 needs tiktoken: pip install -e '.[bpe]'") from None
        cache = Path(
            os.environ.get("TIKTOKEN_CACHE_DIR")
            or os.environ.get("DATA_GYM_CACHE_DIR")
            or Path(tempfile.gettempdir()) / "data-gym-cache"
        )
        missing = [url for url in self._FILES if not (cache / hashlib.sha1(url.encode()).hexdigest()).exists()]
        if missing:
            raise TokenizerUnavailable(
                f"the GPT-2 BPE files are not in tiktoken's cache ({cache}) and are never downloaded at run time; "
                "copy them there (or set TIKTOKEN_CACHE_DIR), or use --tokenizer bytes"
            )
        self._encoding = tiktoken.get_encoding("gpt2")
        self.eot = self._encoding.eot_token
        self.vocab_size = pad_vocab(self._encoding.n_vocab)

    def encode(self, text: str) -> list[int]:
        return self._encoding.encode_ordinary(text)

    def decode(self, ids) -> str:
        return self._encoding.decode([int(i) for i in ids if int(i) < self._encoding.n_vocab])


def get_tokenizer(name: str):
    if name == "bytes":
        return ByteTokenizer()
    if name == "gpt2":
        return GPT2Tokenizer()
    raise TokenizerUnavailable(f"--tokenizer requires 'bytes' or 'gpt2', but got {name!r}")
