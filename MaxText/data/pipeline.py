"""The grain pipeline: records -> tokens -> packed sequences -> this process's rows of each batch.

    source[ArrayRecord] -> shuffle(seed) -> repeat -> [process_index::process_count]
      -> tokenize (+BOS/EOS) -> split into <= max_target_length pieces -> window shuffle
      -> first-fit packing -> batch(rows) -> worker processes and prefetch

Design notes:
- The shuffle is global (a permutation of every record index, different each epoch) and comes
  before the process slice, so in every epoch the processes read disjoint records that together
  cover the dataset, and no process reads another's records.
- A document of n tokens gives n - 1 (input, target) pairs. Longer documents are split into
  pieces of ``max_target_length`` pairs that overlap by one token, so no next-token pair is lost;
  each piece counts as its own document (its own segment id, positions from 0). Pieces are then
  shuffled within a window of ``shuffle_window_pieces``, so that a batch mixes documents rather
  than holding consecutive pieces of one long file.
- Packing is grain's first-fit: pieces fill ``rows`` bins in arrival order and the bins are
  emitted when a piece fits none. Each packed row carries per-document segment ids and positions,
  which attention (document mask) and RoPE use; ``packing_cross_document_attention`` gives every
  token of a row one segment and row positions instead (the loss still stays within documents).
- The iterator's state is grain's (a small JSON-serialisable dict of record indices and
  buffer offsets): restoring it re-reads only the records in flight, and the next batches are
  exactly those an uninterrupted iterator would have produced. With worker processes the
  state records what the training loop has consumed, not what the workers prefetched.

Shape legend: L max_target_length.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np

from MaxText.config import Config
from MaxText.data.tokenizer import Tokenizer
from MaxText.data.types import Batch

FIELDS = ("inputs", "targets")


class Tokenize:
    """Record -> int32 token ids of one document, with BOS/EOS as configured."""

    def __init__(self, tokenizer: Tokenizer, text_field: str, add_bos: bool, add_eos: bool):
        self.tokenizer, self.text_field = tokenizer, text_field
        self.bos = [tokenizer.bos_id] if add_bos else []
        self.eos = [tokenizer.eos_id] if add_eos else []

    def __call__(self, record: dict[str, Any]) -> np.ndarray:
        text = record[self.text_field]
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        ids = self.tokenizer.encode(text)
        return np.concatenate([np.asarray(self.bos, np.int32), ids, np.asarray(self.eos, np.int32)])


def split_document(tokens: np.ndarray, length: int) -> list[dict[str, np.ndarray]]:
    """Pieces of at most ``length`` (input, target) pairs; consecutive pieces overlap by one token."""
    pieces = []
    for start in range(0, len(tokens) - 1, length):
        window = tokens[start : start + length + 1]
        pieces.append({"inputs": window[:-1], "targets": window[1:]})
    return pieces


def pad_piece(piece: dict[str, np.ndarray], length: int) -> dict[str, np.ndarray]:
    """One piece per row (``packing: false``), in the packed layout's field names."""
    n = len(piece["inputs"])
    out = {}
    for name in FIELDS:
        out[name] = np.zeros(length, np.int32)
        out[name][:n] = piece[name]
        out[f"{name}_segment_ids"] = (np.arange(length) < n).astype(np.int32)
        out[f"{name}_positions"] = np.where(np.arange(length) < n, np.arange(length), 0).astype(np.int32)
    return out


def to_batch_fields(packed: dict[str, np.ndarray], cross_document: bool) -> dict[str, np.ndarray]:
    """grain's packed field names -> the training loop's (see ``MaxText/data/types.py``)."""
    segments = packed["inputs_segment_ids"].astype(np.int32)
    positions = packed["inputs_positions"].astype(np.int32)
    if cross_document:
        positions = np.where(segments > 0, np.arange(len(segments)), 0).astype(np.int32)
        segments = (segments > 0).astype(np.int32)
    return {
        "inputs": packed["inputs"].astype(np.int32),
        "targets": packed["targets"].astype(np.int32),
        "inputs_position": positions,
        "inputs_segmentation": segments,
        "targets_segmentation": packed["targets_segment_ids"].astype(np.int32),
    }


def make_dataset(
    config: Config,
    records: Sequence,
    tokenizer: Tokenizer,
    rows: int,
    process_index: int,
    process_count: int,
    *,
    shuffle: bool,
    num_epochs: int | None,
    worker_count: int,
):
    """The grain IterDataset yielding this process's batches of ``rows`` packed sequences.
    ``num_epochs=None`` repeats forever (training); a finite count ends with a partial batch."""
    import grain

    length = config.max_target_length
    ds = grain.MapDataset.source(records)
    if shuffle:
        ds = ds.shuffle(seed=config.seed)
    ds = ds.repeat(num_epochs)[process_index::process_count]
    ds = ds.map(Tokenize(tokenizer, config.dataset_text_field, config.add_bos, config.add_eos))
    it = ds.to_iter_dataset(grain.ReadOptions(num_threads=config.grain_read_threads, prefetch_buffer_size=rows * 4))
    it = grain.experimental.FlatMapIterDataset(it, SplitDocument(length))
    if shuffle and config.shuffle_window_pieces > 1:
        it = grain.experimental.WindowShuffleIterDataset(it, window_size=config.shuffle_window_pieces, seed=config.seed)
    if config.packing:
        it = grain.experimental.FirstFitPackIterDataset(
            it, length_struct=dict.fromkeys(FIELDS, length), num_packing_bins=rows, seed=config.seed
        )
    else:
        it = it.map(partial(pad_piece, length=length))
    it = it.map(partial(to_batch_fields, cross_document=config.packing_cross_document_attention))
    it = it.batch(rows, drop_remainder=num_epochs is None)
    if worker_count > 0:
        _use_default_flags()
        it = it.mp_prefetch(
            grain.MultiprocessingOptions(
                num_workers=worker_count, per_worker_buffer_size=config.grain_per_worker_buffer_size
            )
        )
    return it


def _use_default_flags() -> None:
    """grain's worker processes read absl flags, which only an absl ``app.run`` program has
    parsed; this entry point has none of its own, so their defaults stand."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


class SplitDocument:
    """grain FlatMap transform wrapping :func:`split_document`."""

    max_fan_out = 1 << 20  # only checked by the MapDataset variant; documents may be long

    def __init__(self, length: int):
        self.length = length

    def flat_map(self, tokens: np.ndarray) -> list[dict[str, np.ndarray]]:
        return split_document(tokens, self.length)


class GrainSource:
    """A data source over a grain pipeline; iterating yields :data:`Batch` dicts."""

    def __init__(self, dataset):
        self.dataset = dataset
        self.iterator = iter(dataset)

    def __iter__(self) -> GrainSource:
        return self

    def __next__(self) -> Batch:
        # Batches from worker processes live in shared memory; a plain copy (a few KB to MB) frees
        # it at once instead of whenever the device arrays made from it are collected.
        return {name: np.array(value) for name, value in next(self.iterator).items()}

    def get_state(self) -> dict[str, Any]:
        """Where the iterator stands: a small JSON-serialisable dict."""
        return self.iterator.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue exactly where ``state`` was taken."""
        self.iterator.set_state(state)

    def close(self) -> None:
        """Stop the worker processes and free their shared memory. The iterator is dropped here,
        while grain's modules still exist, rather than at interpreter exit."""
        if self.iterator is not None:
            self.iterator.close()
            self.iterator = None
            gc.collect()
