"""Deterministic synthetic sequences with learnable structure, for runs that need no files.

Each sequence follows a fixed random permutation of the first ``synthetic_vocab_size`` ids
(token t is followed by perm[t]), except that with probability ``synthetic_noise`` a token is
drawn uniformly instead. A model that learns the rule reaches a loss near the noise entropy,
so a falling loss is visible within tens of steps. Batch n depends only on (seed, n), so any
number of processes or devices sees the same global batch, and resuming at step n is exact.
"""

from collections.abc import Iterator

import numpy as np

from MaxText.config import Config
from MaxText.data.types import Batch


class SyntheticSource:
    def __init__(self, config: Config, global_batch_size: int, process_index: int, process_count: int):
        self.config = config
        self.global_batch_size = global_batch_size
        rows = global_batch_size // process_count
        self.rows = slice(process_index * rows, (process_index + 1) * rows)
        self.permutation = np.random.default_rng([config.seed, 0xDA7A]).permutation(config.synthetic_vocab_size)
        self.step = 0

    def global_batch(self, step: int) -> np.ndarray:
        """[global_batch_size, max_target_length + 1] token ids of batch ``step``."""
        c = self.config
        rng = np.random.default_rng([c.seed, step])
        shape = (self.global_batch_size, c.max_target_length + 1)
        noise = rng.random(shape) < c.synthetic_noise
        random_tokens = rng.integers(0, c.synthetic_vocab_size, shape)
        tokens = np.empty(shape, np.int32)
        tokens[:, 0] = random_tokens[:, 0]
        for i in range(1, shape[1]):
            tokens[:, i] = np.where(noise[:, i], random_tokens[:, i], self.permutation[tokens[:, i - 1]])
        return tokens

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        tokens = self.global_batch(self.step)[self.rows]
        self.step += 1
        length = tokens.shape[1] - 1
        ones = np.ones((tokens.shape[0], length), np.int32)
        return {
            "inputs": tokens[:, :-1],
            "targets": tokens[:, 1:],
            "inputs_position": np.broadcast_to(np.arange(length, dtype=np.int32), ones.shape).copy(),
            "inputs_segmentation": ones,
            "targets_segmentation": ones.copy(),
        }

    def get_state(self) -> dict:
        return {"step": self.step}

    def set_state(self, state: dict) -> None:
        self.step = int(state["step"])
