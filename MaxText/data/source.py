"""Which input pipeline a run reads (``dataset_type``), for training and for evaluation.

The interface they share (``Batch``, ``DataSource``) is in ``data/types.py``.
"""

from __future__ import annotations

from MaxText.config import Config, ConfigError
from MaxText.data.types import DataSource


def _rows(global_batch_size: int, process_count: int) -> int:
    if global_batch_size % process_count:
        raise ConfigError(
            f"config key 'per_device_batch_size': global batch {global_batch_size} does not split over {process_count} processes"
        )
    return global_batch_size // process_count


def open_records(config: Config, split: str):
    """The random-access records of ``split`` for the tfds and builtin types."""
    from MaxText.data.tfds_reader import open_split

    if config.dataset_type == "builtin":
        from MaxText.data.builtin import builtin_dataset

        return open_split(config, split, builtin_dataset(config))
    return open_split(config, split)


def make_data_source(config: Config, global_batch_size: int, process_index: int, process_count: int) -> DataSource:
    """The training source chosen by ``dataset_type``; this process reads only its shard."""
    rows = _rows(global_batch_size, process_count)
    if config.dataset_type == "synthetic":
        from MaxText.data.synthetic import SyntheticSource

        return SyntheticSource(config, global_batch_size, process_index, process_count)
    if config.dataset_type in ("tfds", "builtin"):
        from MaxText.data.pipeline import GrainSource, make_dataset
        from MaxText.data.tokenizer import make_tokenizer

        tokenizer = make_tokenizer(config)
        records = open_records(config, config.train_split)
        dataset = make_dataset(
            config,
            records,
            tokenizer,
            rows,
            process_index,
            process_count,
            shuffle=config.enable_data_shuffling,
            num_epochs=None,
            worker_count=config.grain_worker_count,
        )
        return GrainSource(dataset)
    raise ConfigError(f"config key 'dataset_type': unknown dataset type '{config.dataset_type}'")


def make_eval_source(
    config: Config, global_batch_size: int, process_index: int, process_count: int
) -> DataSource | None:
    """The evaluation source over ``eval_split`` (unshuffled, in the training process), or None
    when evaluation is off or the data has no held-out split (synthetic)."""
    if config.eval_interval == 0 or config.dataset_type == "synthetic":
        return None
    from MaxText.data.pipeline import GrainSource, make_dataset
    from MaxText.data.tokenizer import make_tokenizer

    dataset = make_dataset(
        config,
        open_records(config, config.eval_split),
        make_tokenizer(config),
        _rows(global_batch_size, process_count),
        process_index,
        process_count,
        shuffle=False,
        num_epochs=None,
        worker_count=0,
    )
    return GrainSource(dataset)
