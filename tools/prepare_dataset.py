"""Turn text files into a TFDS ArrayRecord dataset that training reads with ``dataset_type=tfds``.

    python tools/prepare_dataset.py --input my_corpus/ --output data/ --name my_corpus
    python tools/prepare_dataset.py --input 'shards/*.jsonl' --output data/ --name web --text-field content
    python -m MaxText.train dataset_type=tfds dataset_name=my_corpus dataset_path=data/

``--input`` is a file, a folder (searched recursively) or a glob. ``.jsonl`` and ``.parquet``
files give one document per record (``--text-field``); every other file is one UTF-8 document,
with undecodable bytes replaced and counted. Documents are split into ``train`` and
``validation`` (``--val-fraction``) and written as sharded ArrayRecord files under
``<output>/<name>/1.0.0/``. Bad input (a missing path, no documents, a record without the text
field) stops with one line and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from MaxText.data.text_dataset import (  # noqa: E402
    TEXT_FEATURE,
    VERSION,
    Corpus,
    DatasetInputError,
    build_text_dataset,
    find_files,
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="A file, a folder (searched recursively) or a glob.")
    parser.add_argument("--output", required=True, help="The TFDS data dir to write into (training's dataset_path).")
    parser.add_argument("--name", required=True, help="The dataset's name (training's dataset_name), lower_snake_case.")
    parser.add_argument(
        "--text-field",
        default=TEXT_FEATURE,
        help="The text column of .jsonl and .parquet records (default: %(default)s).",
    )
    parser.add_argument(
        "--val-fraction",
        type=float,
        default=0.01,
        help="Share of documents held out for validation (default: %(default)s).",
    )
    parser.add_argument(
        "--num-shards", type=int, default=None, help="ArrayRecord files per split (default: chosen by size)."
    )
    parser.add_argument("--overwrite", action="store_true", help="Replace an existing dataset of this name.")
    args = parser.parse_args(argv)
    if not 0 <= args.val_fraction < 1:
        parser.error("--val-fraction must be in [0, 1)")
    if args.num_shards is not None and args.num_shards < 1:
        parser.error("--num-shards must be >= 1")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    output = Path(args.output).expanduser()
    target = output / args.name / VERSION
    try:
        if target.exists() and not args.overwrite:
            raise DatasetInputError(f"{target} already exists; pass --overwrite to replace it")
        files = find_files(args.input)
        root = Path(os.path.commonpath([f.parent for f in files]))  # record keys relative to the inputs
        if target.exists():
            shutil.rmtree(target)
        summary = build_text_dataset(
            Corpus(files, text_field=args.text_field, root=root, source=args.input),
            output,
            args.name,
            args.val_fraction,
            args.num_shards,
        )
    except DatasetInputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    shards = sorted(p.name for p in summary.path.glob("*.array_record-*"))
    print(
        f"{args.name}: {summary.train_documents} train and {summary.validation_documents} validation documents "
        f"from {len(files)} files in {summary.path} ({len(shards)} ArrayRecord files)"
    )
    if summary.replaced_bytes:
        print(f"replaced {summary.replaced_bytes} undecodable bytes in {summary.files_with_replacements} files")
    print(f"train with: dataset_type=tfds dataset_name={args.name} dataset_path={output}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
