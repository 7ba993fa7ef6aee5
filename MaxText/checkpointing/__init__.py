"""Checkpoints of a run, in two tiers.

- ``persistent.py``: Orbax checkpoints in ``<run>/checkpoints/`` every ``checkpoint_period`` steps
  (the shared filesystem; resharding, warm starts).
- ``local.py``: with ``enable_emergency_checkpoint``, each process's own shards on node-local
  storage every ``local_checkpoint_period`` steps, with a copy of every shard on another node
  (``placement.py`` says where, ``transfer.py`` moves blocks between processes).
- ``tiers.py``: the restore: the newest step that a complete set of shards exists for, from the
  fastest tier that holds it.
"""

from MaxText.checkpointing.persistent import (
    CheckpointError,
    Checkpoints,
    Restored,
    first_shape_mismatch,
    load_moe_bias,
    load_parameters,
)

__all__ = ["CheckpointError", "Checkpoints", "Restored", "first_shape_mismatch", "load_moe_bias", "load_parameters"]
