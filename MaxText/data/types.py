"""The types every input pipeline and the training loop share (their own module, so that the
pipelines and the source that chooses among them do not import each other).

A data source yields this process's rows of each global batch as numpy arrays, under
``BATCH_KEYS``:

    inputs, targets                 [rows, max_target_length] int32 token ids
    inputs_position                 [rows, max_target_length] int32 position of each token in its document
    inputs_segmentation             [rows, max_target_length] int32 document id (0 = padding)
    targets_segmentation            [rows, max_target_length] int32 document id of each target (0 = no loss)

``rows`` is the global batch size divided by the number of processes; the training loop
assembles the global array with the mesh's batch sharding. ``get_state()`` returns a small
JSON-serialisable object and ``set_state()`` resumes from it exactly, so a checkpoint can hold
the data position next to the model.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np

BATCH_KEYS = ("inputs", "targets", "inputs_position", "inputs_segmentation", "targets_segmentation")

Batch = dict[str, np.ndarray]


class DataSource(Protocol):
    def __iter__(self) -> Iterator[Batch]: ...

    def __next__(self) -> Batch: ...

    def get_state(self) -> Any: ...

    def set_state(self, state: Any) -> None: ...
