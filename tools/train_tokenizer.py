"""Train a byte-level BPE tokenizer on a prepared dataset's training split.

    python tools/train_tokenizer.py --vocab-size 4096 --output tokenizers/stdlib               # the built-in corpus
    python tools/train_tokenizer.py dataset_type=tfds dataset_name=my_corpus dataset_path=data/ --output tok/
    python -m MaxText.train tokenizer_type=huggingface tokenizer_path=tok/ vocab_size=4096

Arguments other than the flags are config arguments, as for training: they choose the dataset
(``dataset_type``, ``dataset_name``, ``dataset_path``, ``dataset_text_field``, ``train_split``).
Writes ``tokenizer.json`` (the Hugging Face format, read by ``tokenizer_type=huggingface``) and
``tokenizer_config.json`` naming BOS and EOS. Byte-level pre-tokenisation makes every text
encodable and decoding exact.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from MaxText.config import ConfigError, load_config_or_exit  # noqa: E402

SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>"}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "config",
        nargs="*",
        help="Config arguments as for training ([extra.yml ...] key=value ...), choosing the dataset.",
    )
    parser.add_argument(
        "--output", required=True, help="Folder to write tokenizer.json and tokenizer_config.json into."
    )
    parser.add_argument(
        "--vocab-size", type=int, default=4096, help="Vocabulary size, special tokens included (default: %(default)s)."
    )
    parser.add_argument(
        "--max-documents",
        type=int,
        default=0,
        help="Train on at most this many documents; 0 = all (default: %(default)s).",
    )
    args = parser.parse_args(argv)
    if args.vocab_size < 256 + len(SPECIAL_TOKENS):
        parser.error(f"--vocab-size must be at least {256 + len(SPECIAL_TOKENS)} (the bytes and special tokens)")
    return args


def train_bpe(texts, vocab_size: int, length: int | None = None):
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tokenizer.train_from_iterator(texts, trainer, length=length)
    return tokenizer


def save(tokenizer, output: Path) -> None:
    output.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(output / "tokenizer.json"))
    (output / "tokenizer_config.json").write_text(json.dumps(SPECIAL_TOKENS, indent=2) + "\n")


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    config = load_config_or_exit(args.config)
    from MaxText.data.source import open_records

    try:
        if config.dataset_type == "synthetic":
            raise ConfigError("config key 'dataset_type': a tokenizer needs text (builtin or tfds)")
        records = open_records(config, config.train_split)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    count = len(records) if args.max_documents <= 0 else min(args.max_documents, len(records))
    field = config.dataset_text_field

    def texts():
        for i in range(count):
            text = records[i][field]
            yield text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text

    tokenizer = train_bpe(texts(), args.vocab_size, count)
    output = Path(args.output)
    save(tokenizer, output)
    print(f"trained on {count} documents: {tokenizer.get_vocab_size()} tokens in {output / 'tokenizer.json'}")
    print(
        f"train with: tokenizer_type=huggingface tokenizer_path={output} (vocab_size >= {tokenizer.get_vocab_size()})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
