"""Text files -> a TFDS dataset in ArrayRecord format, readable with ``dataset_type: tfds``.

Used by ``tools/prepare_dataset.py`` and by the built-in corpus. The input is a file, a folder
(searched recursively, hidden entries skipped) or a glob. ``.jsonl`` and ``.parquet`` files give
one document per record (the ``text_field`` column); every other file is one UTF-8 document, and
undecodable bytes are replaced by U+FFFD and counted rather than failing a whole corpus.

ArrayRecord is chosen over TFRecord because it allows random access: grain can then shuffle the
whole dataset by index and resume at any record without reading what came before, and TFDS
builds and reads it without TensorFlow. Documents are assigned to the validation split by their
ordinal (evenly spaced, ``val_fraction`` of them, at least one when there are two or more), so a
split does not depend on hashing and a rebuild gives the same splits.
"""

from __future__ import annotations

import glob
import json
import re
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from MaxText.config import ConfigError

TEXT_FEATURE = "text"  # the feature name every prepared dataset stores its documents under
VERSION = "1.0.0"
RECORD_SUFFIXES = (".jsonl", ".parquet")
NAME_PATTERN = re.compile(r"^[a-z][a-z0-9_]*$")


class DatasetInputError(ConfigError):
    """Bad input to a dataset build (a missing path, no documents, a missing text field)."""


def find_files(path: str) -> list[Path]:
    """The input files named by ``path``: a file, every file under a folder, or a glob's matches."""
    if any(ch in path for ch in "*?["):
        files = [Path(p) for p in glob.glob(path, recursive=True)]
        files = [f for f in files if f.is_file()]
    else:
        root = Path(path).expanduser()
        if not root.exists():
            raise DatasetInputError(f"input not found: {path}")
        if root.is_file():
            files = [root]
        else:
            files = [
                f
                for f in root.rglob("*")
                if f.is_file() and not any(part.startswith(".") for part in f.relative_to(root).parts)
            ]
    if not files:
        raise DatasetInputError(f"no input files in {path}")
    return sorted(files)


def decode_text(data: bytes) -> tuple[str, int]:
    """UTF-8 text and the number of undecodable bytes replaced by U+FFFD."""
    try:
        return data.decode("utf-8"), 0
    except UnicodeDecodeError:
        text = data.decode("utf-8", errors="replace")
        return text, text.count("\ufffd") - data.count("\ufffd".encode())


@dataclass
class Corpus:
    """The documents of a set of input files, read lazily and in a fixed order."""

    files: list[Path]
    text_field: str = TEXT_FEATURE
    root: Path | None = None  # keys are paths relative to this, so a build does not depend on where it ran
    source: str = ""  # the input as the user named it, for messages
    replaced_bytes: int = field(default=0, init=False)
    files_with_replacements: int = field(default=0, init=False)

    def _key(self, path: Path) -> str:
        if self.root is not None:
            try:
                return str(path.relative_to(self.root))
            except ValueError:
                pass
        return str(path)

    def documents(self) -> Iterator[tuple[str, str]]:
        """(unique key, text) of every non-empty document."""
        self.replaced_bytes = self.files_with_replacements = 0
        for path in self.files:
            key = self._key(path)
            if path.suffix == ".jsonl":
                yield from self._jsonl(path, key)
            elif path.suffix == ".parquet":
                yield from self._parquet(path, key)
            else:
                text, replaced = decode_text(path.read_bytes())
                self.replaced_bytes += replaced
                self.files_with_replacements += replaced > 0
                if text.strip():
                    yield key, text

    def _jsonl(self, path: Path, key: str) -> Iterator[tuple[str, str]]:
        text, replaced = decode_text(path.read_bytes())
        self.replaced_bytes += replaced
        self.files_with_replacements += replaced > 0
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DatasetInputError(f"{path}:{number}: not valid JSON ({err.msg})") from None
            if not isinstance(record, dict) or self.text_field not in record:
                raise DatasetInputError(f"{path}:{number}: text field '{self.text_field}' missing")
            value = record[self.text_field]
            if isinstance(value, str) and value.strip():
                yield f"{key}:{number}", value

    def _parquet(self, path: Path, key: str) -> Iterator[tuple[str, str]]:
        import pyarrow.parquet as pq

        table = pq.ParquetFile(path)
        columns = table.schema_arrow.names
        if self.text_field not in columns:
            raise DatasetInputError(f"{path}: text field '{self.text_field}' missing (columns: {', '.join(columns)})")
        row = 0
        for batch in table.iter_batches(columns=[self.text_field]):
            for value in batch.column(0).to_pylist():
                row += 1
                if isinstance(value, str) and value.strip():
                    yield f"{key}:{row}", value

    def count(self) -> int:
        return sum(1 for _ in self.documents())


def is_validation(ordinal: int, num_documents: int, num_validation: int) -> bool:
    """Evenly spaced choice of ``num_validation`` of ``num_documents`` ordinals."""
    return (ordinal + 1) * num_validation // num_documents > ordinal * num_validation // num_documents


def validation_count(num_documents: int, val_fraction: float) -> int:
    if val_fraction <= 0 or num_documents < 2:
        return 0
    return min(max(1, round(num_documents * val_fraction)), num_documents - 1)


def _builder_class(name: str):
    """A GeneratorBasedBuilder subclass named ``name``, made on demand (TFDS names a dataset by
    its builder class) and kept out of TFDS's global registry so any name can be built twice."""
    import tensorflow_datasets as tfds

    class TextBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        VERSION = tfds.core.Version(VERSION)

        def __init__(self, *, corpus: Corpus, num_documents: int, num_validation: int, **kwargs):
            self.corpus, self.num_documents, self.num_validation = corpus, num_documents, num_validation
            super().__init__(**kwargs)

        def _info(self):
            return tfds.core.DatasetInfo(
                builder=self,
                description="Plain-text documents, one per record.",
                features=tfds.features.FeaturesDict({TEXT_FEATURE: tfds.features.Text()}),
            )

        def _split_generators(self, dl_manager):
            splits = {"train": self._generate_examples(validation=False)}
            if self.num_validation:
                splits["validation"] = self._generate_examples(validation=True)
            return splits

        def _generate_examples(self, validation: bool):
            for ordinal, (key, text) in enumerate(self.corpus.documents()):
                if is_validation(ordinal, self.num_documents, self.num_validation) == validation:
                    yield key, {TEXT_FEATURE: text}

    return types.new_class(name, (TextBuilder,), {"skip_registration": True}, lambda ns: ns.update(name=name))


@dataclass
class BuildSummary:
    path: Path  # the dataset's version folder
    train_documents: int
    validation_documents: int
    replaced_bytes: int
    files_with_replacements: int


def build_text_dataset(
    corpus: Corpus, output_dir: Path, name: str, val_fraction: float, num_shards: int | None = None
) -> BuildSummary:
    """Write ``corpus`` as the TFDS dataset ``name`` under ``output_dir`` (train and validation
    splits, ArrayRecord shards). Raises DatasetInputError when there is nothing to write."""
    if not NAME_PATTERN.match(name):
        raise DatasetInputError(f"dataset name '{name}' must be lower_snake_case (letters, digits, _)")
    num_documents = corpus.count()
    if num_documents == 0:
        raise DatasetInputError(f"no non-empty documents in {corpus.source or corpus.root or corpus.files[0]}")
    num_validation = validation_count(num_documents, val_fraction)

    import tensorflow_datasets as tfds

    builder = _builder_class(name)(
        corpus=corpus,
        num_documents=num_documents,
        num_validation=num_validation,
        data_dir=str(output_dir),
        file_format="array_record",
    )
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(try_download_gcs=False, num_shards=num_shards)
    )
    return BuildSummary(
        Path(builder.data_dir),
        num_documents - num_validation,
        num_validation,
        corpus.replaced_bytes,
        corpus.files_with_replacements,
    )
