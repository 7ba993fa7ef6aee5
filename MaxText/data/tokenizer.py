"""Tokenizers behind one small interface, chosen by ``tokenizer_type``.

- ``byte``: UTF-8 bytes, no file needed. Ids 0, 1, 2 are pad, BOS and EOS and byte b is b + 3
  (the ByT5 layout), so the vocabulary is 259 and fits the tiny model's 512 rows.
- ``huggingface``: a ``tokenizer.json`` read by the ``tokenizers`` package; this is how the real
  DeepSeek-V3 tokenizer is used. BOS and EOS come from the ``tokenizer_config.json`` beside it
  when there is one (the Hugging Face layout), else from the usual special-token names.
- ``sentencepiece``: a SentencePiece ``.model`` file.

Documents are encoded without special tokens; the pipeline adds BOS/EOS itself (``add_bos``,
``add_eos``), so every tokenizer behaves alike. A tokenizer holds only its path until first used,
so grain can hand it to worker processes cheaply. ``vocab_size`` may exceed the tokenizer's
vocabulary (the extra embedding rows are never produced); a smaller one is a ConfigError.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

import numpy as np

from MaxText.config import Config, ConfigError

# Special-token spellings tried, in order, when a tokenizer.json comes without tokenizer_config.json.
BOS_NAMES = ("<｜begin▁of▁sentence｜>", "<|begin_of_text|>", "<s>", "<bos>", "[BOS]", "<|startoftext|>")
EOS_NAMES = ("<｜end▁of▁sentence｜>", "<|end_of_text|>", "</s>", "<eos>", "[EOS]", "<|endoftext|>")


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int | None
    eos_id: int | None

    def encode(self, text: str) -> np.ndarray: ...  # int32 ids, no special tokens

    def decode(self, ids: np.ndarray | list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes shifted by the three special ids."""

    OFFSET = 3
    vocab_size = 256 + OFFSET
    pad_id, bos_id, eos_id = 0, 1, 2

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32) + self.OFFSET

    def decode(self, ids: np.ndarray | list[int]) -> str:
        ids = np.asarray(ids, np.int64)
        ids = ids[ids >= self.OFFSET] - self.OFFSET
        return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


def special_from_config(path: Path, key: str) -> str | None:
    """The special token ``key`` names in the ``tokenizer_config.json`` beside ``path``, if any."""
    config_path = path.parent / "tokenizer_config.json"
    if not config_path.is_file():
        return None
    value = json.loads(config_path.read_text()).get(key)
    return value.get("content") if isinstance(value, dict) else value


class HuggingFaceTokenizer:
    """A ``tokenizer.json`` (or a folder holding one) through the ``tokenizers`` package."""

    def __init__(self, path: Path):
        self.path = path / "tokenizer.json" if path.is_dir() else path
        if not self.path.is_file():
            raise ConfigError(f"config key 'tokenizer_path': no tokenizer.json at {path}")
        self._tokenizer = None
        tokenizer = self._load()
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_id = self._special(tokenizer, "bos_token", BOS_NAMES)
        self.eos_id = self._special(tokenizer, "eos_token", EOS_NAMES)

    def _load(self):
        if self._tokenizer is None:
            from tokenizers import Tokenizer as HFTokenizer

            try:
                self._tokenizer = HFTokenizer.from_file(str(self.path))
            except Exception as err:  # the package raises a bare Exception for malformed files
                raise ConfigError(f"config key 'tokenizer_path': cannot read {self.path}: {err}") from None
        return self._tokenizer

    def _special(self, tokenizer, key: str, names: tuple[str, ...]) -> int | None:
        named = special_from_config(self.path, key)
        for name in (named,) if named else names:
            token_id = tokenizer.token_to_id(name)
            if token_id is not None:
                return token_id
        return None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokenizer": None}

    def token_to_id(self, token: str) -> int | None:
        return self._load().token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._load().id_to_token(token_id)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._load().encode(text, add_special_tokens=False).ids, np.int32)

    def decode(self, ids: np.ndarray | list[int]) -> str:
        return self._load().decode([int(i) for i in ids], skip_special_tokens=True)


class SentencePieceTokenizer:
    """A SentencePiece ``.model`` file."""

    def __init__(self, path: Path):
        if not path.is_file():
            raise ConfigError(f"config key 'tokenizer_path': no SentencePiece model at {path}")
        self.path = path
        self._processor = None
        processor = self._load()
        self.vocab_size = processor.vocab_size()
        self.bos_id = processor.bos_id() if processor.bos_id() >= 0 else None
        self.eos_id = processor.eos_id() if processor.eos_id() >= 0 else None

    def _load(self):
        if self._processor is None:
            import sentencepiece

            processor = sentencepiece.SentencePieceProcessor()
            try:
                processor.Load(str(self.path))
            except (OSError, RuntimeError) as err:
                raise ConfigError(f"config key 'tokenizer_path': cannot read {self.path}: {err}") from None
            self._processor = processor
        return self._processor

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_processor": None}

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._load().EncodeAsIds(text), np.int32)

    def decode(self, ids: np.ndarray | list[int]) -> str:
        return self._load().DecodeIds([int(i) for i in ids])


def make_tokenizer(config: Config) -> Tokenizer:
    """The tokenizer named by ``tokenizer_type``, checked against the config."""
    if config.tokenizer_type == "byte":
        tokenizer: Tokenizer = ByteTokenizer()
    else:
        if not config.tokenizer_path:
            raise ConfigError(f"config key 'tokenizer_path': required for tokenizer_type={config.tokenizer_type}")
        path = Path(config.tokenizer_path).expanduser()
        if not path.exists():
            raise ConfigError(f"config key 'tokenizer_path': no such file or folder: {path}")
        cls = HuggingFaceTokenizer if config.tokenizer_type == "huggingface" else SentencePieceTokenizer
        tokenizer = cls(path)
    if tokenizer.vocab_size > config.vocab_size:
        raise ConfigError(
            f"config key 'vocab_size': {config.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({tokenizer.vocab_size})"
        )
    for flag, token_id, what in ((config.add_bos, tokenizer.bos_id, "BOS"), (config.add_eos, tokenizer.eos_id, "EOS")):
        if flag and token_id is None:
            key = "add_bos" if what == "BOS" else "add_eos"
            raise ConfigError(f"config key '{key}': the tokenizer has no {what} token; set {key}=false")
    return tokenizer
