"""The run's tokenizer as files that ``transformers.AutoTokenizer.from_pretrained`` loads.

An export carries the tokenizer its config names (``tokenizer_type``, ``tokenizer_path``), so that
the Hugging Face folder encodes text into the ids the model was trained on:

- ``byte``: written as a fast tokenizer (``tokenizer.json`` built with the ``tokenizers``
  package): a BPE model with no merges over the 256 byte-level symbols at ids 3..258 in byte
  order, a byte-level pre-tokenizer (no prefix space, no regex split) and decoder, and ``<pad>``,
  ``<s>``, ``</s>`` at ids 0, 1, 2. ``split_special_tokens`` keeps ``"<s>"`` typed in a text as
  its bytes, as ``ByteTokenizer`` does, so the ids equal ``ByteTokenizer.encode``'s for any text.
  With ``add_bos`` it prepends ``<s>`` (pass ``add_special_tokens=False`` for the bare ids): the
  model saw every document start with it.
- ``huggingface``: the run's ``tokenizer.json`` copied, with the ``tokenizer_config.json`` and
  ``special_tokens_map.json`` beside it when present; without a ``tokenizer_config.json`` one is
  written naming BOS and EOS as ``MaxText.data.tokenizer`` resolves them.
- ``sentencepiece``: refused. transformers rebuilds a ``.model`` file as a Llama tokenizer with
  its own normalisation (a prefix space whatever the model says), which changes the ids; the
  export asks for a ``tokenizer.json`` instead.

``override`` replaces the run's tokenizer with a Hugging Face one (a ``tokenizer.json`` or a folder
holding one) whatever the run's type; ``"none"`` writes none. A converted checkpoint, whose
``config.yml`` names no tokenizer, gets none unless one is passed. Every check runs before anything
is written. The ids of BOS, EOS and padding go into ``config.json`` too (transformers derives the
generation config from them).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from MaxText.config import Config, ConfigError
from MaxText.data.tokenizer import ByteTokenizer, HuggingFaceTokenizer, make_tokenizer, special_from_config
from MaxText.hf import HFCheckpointError

NONE = "none"  # ``override`` value: write no tokenizer
SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json")  # copied from beside a tokenizer.json
BYTE_SPECIALS = ("<pad>", "<s>", "</s>")  # ByteTokenizer's ids 0, 1, 2
ASK = "pass --tokenizer PATH (a tokenizer.json or a folder holding one)"


@dataclass
class HFTokenizer:
    """What an export writes for its tokenizer: files (name -> text, or a path to copy) and the
    special ids for config.json; ``note`` says what was chosen, in one line."""

    note: str
    files: dict[str, str | Path] = field(default_factory=dict)
    ids: dict[str, int] = field(default_factory=dict)

    def write(self, output: Path) -> None:
        for name, content in self.files.items():
            if isinstance(content, Path):
                shutil.copyfile(content, output / name)
            else:
                (output / name).write_text(content)


def byte_level_symbols() -> list[str]:
    """The byte-level alphabet in byte order: byte b's symbol (GPT-2's printable mapping, which
    the ``tokenizers`` ByteLevel pre-tokenizer and decoder use)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


def byte_tokenizer_json(add_bos: bool) -> str:
    """ByteTokenizer as a ``tokenizers`` tokenizer.json (see the module docstring)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {token: i for i, token in enumerate(BYTE_SPECIALS)}
    vocab.update({symbol: b + ByteTokenizer.OFFSET for b, symbol in enumerate(byte_level_symbols())})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in BYTE_SPECIALS])
    if add_bos:
        bos = BYTE_SPECIALS[ByteTokenizer.bos_id]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, ByteTokenizer.bos_id)]
        )
    return tokenizer.to_str(pretty=True)


def _byte(config: Config, max_length: int) -> HFTokenizer:
    pad, bos, eos = BYTE_SPECIALS
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "split_special_tokens": True,  # "<s>" in a text is three bytes, as for ByteTokenizer
        "clean_up_tokenization_spaces": False,  # decoding gives back the text exactly
        "model_max_length": max_length,
    }
    return HFTokenizer(
        note="tokenizer: the byte tokenizer as a Hugging Face fast tokenizer (tokenizer.json, tokenizer_config.json)",
        files={
            "tokenizer.json": byte_tokenizer_json(config.add_bos),
            "tokenizer_config.json": json.dumps(tokenizer_config, indent=2) + "\n",
        },
        ids={
            "bos_token_id": ByteTokenizer.bos_id,
            "eos_token_id": ByteTokenizer.eos_id,
            "pad_token_id": ByteTokenizer.pad_id,
        },
    )


def _copied(tokenizer: HuggingFaceTokenizer) -> HFTokenizer:
    """A tokenizer.json and the files beside it, copied (a tokenizer_config.json written if none)."""
    path = tokenizer.path
    files: dict[str, str | Path] = {"tokenizer.json": path}
    files.update({name: path.parent / name for name in SIDE_FILES if (path.parent / name).is_file()})
    if "tokenizer_config.json" not in files:
        names = {"bos_token": tokenizer.bos_id, "eos_token": tokenizer.eos_id}
        written = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
        written.update({key: tokenizer.id_to_token(i) for key, i in names.items() if i is not None})
        files["tokenizer_config.json"] = json.dumps(written, indent=2) + "\n"
        pad_id, said = None, "; tokenizer_config.json written naming BOS and EOS"
    else:
        pad = special_from_config(path, "pad_token")
        pad_id, said = (tokenizer.token_to_id(pad) if pad else None), ""
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": pad_id}
    return HFTokenizer(
        note=f"tokenizer: {path} copied as {', '.join(n for n, f in files.items() if isinstance(f, Path))}{said}",
        files=files,
        ids={key: i for key, i in ids.items() if i is not None},
    )


def hf_tokenizer(config: Config, names_tokenizer: bool, override: str | Path | None, max_length: int) -> HFTokenizer:
    """The tokenizer an export writes (checked, nothing written yet). ``names_tokenizer``: whether
    the checkpoint's config names a tokenizer (a converted checkpoint's does not)."""
    if override is not None and str(override) == NONE:
        return HFTokenizer(note="tokenizer: none written (--tokenizer none)")
    if override is not None:
        # Checked as the run's would be, but for BOS and EOS: a tokenizer given here may lack them.
        update = {"tokenizer_type": "huggingface", "tokenizer_path": str(override), "add_bos": False, "add_eos": False}
        try:
            chosen = make_tokenizer(config.model_copy(update=update))
        except ConfigError as err:
            raise HFCheckpointError(f"--tokenizer {override}: {err}") from None
        return _copied(chosen)
    if not names_tokenizer:
        return HFTokenizer(note=f"tokenizer: none written (the checkpoint's config names none); to add one, {ASK}")
    if config.tokenizer_type == "sentencepiece":
        raise HFCheckpointError(
            f"the run's tokenizer is a SentencePiece model ({config.tokenizer_path}), which transformers does not "
            f"load with the same ids; {ASK} or --tokenizer none"
        )
    try:
        tokenizer = make_tokenizer(config)
    except ConfigError as err:
        raise HFCheckpointError(f"the run's tokenizer cannot be exported: {err}; {ASK} or --tokenizer none") from None
    if isinstance(tokenizer, ByteTokenizer):
        return _byte(config, max_length)
    return _copied(tokenizer)
