"""The interface between input pipelines and the training loop.

A data source yields this process's rows of each global batch as numpy arrays:

    inputs, targets                 [rows, max_target_length] int32 token ids
    inputs_position                 [rows, max_target_length] int32 position of each token in its document
    inputs_segmentation             [rows, max_target_length] int32 document id (0 = padding)
    targets_segmentation            [rows, max_target_length] int32 document id of each target (0 = no loss)

``rows`` is the global batch size divided by the number of processes; the training loop
assembles the global array with the mesh's batch sharding.
"""

from collections.abc import Iterator
from typing import Protocol

import numpy as np

from MaxText.config import Config, ConfigError

Batch = dict[str, np.ndarray]


class DataSource(Protocol):
    def __iter__(self) -> Iterator[Batch]: ...


def make_data_source(config: Config, global_batch_size: int, process_index: int, process_count: int) -> DataSource:
    """The source chosen by ``dataset_type``."""
    if global_batch_size % process_count:
        raise ConfigError(
            f"config key 'per_device_batch_size': global batch {global_batch_size} does not split over {process_count} processes"
        )
    if config.dataset_type == "synthetic":
        from MaxText.data.synthetic import SyntheticSource

        return SyntheticSource(config, global_batch_size, process_index, process_count)
    raise ConfigError(f"config key 'dataset_type': unknown dataset type '{config.dataset_type}'")
