"""The restore of a run with both tiers: the newest step that a complete set of shards exists for,
from the fastest tier that holds it.

The node-local tier wins when its newest complete step (own saves, copies on other nodes) is at
least the persistent tier's newest; a local restore that fails on any process falls back, on
every process, to the persistent tier's own agreed restore (``Checkpoints.restore_latest``).
"""

from typing import Any

import numpy as np

from MaxText.checkpointing.local import LocalCheckpoints
from MaxText.checkpointing.persistent import Checkpoints, Restored, all_processes


def restore_newest(persistent: Checkpoints, local: LocalCheckpoints | None, abstract_state: Any) -> Restored | None:
    """The newest complete state of the run on any tier, or None (a collective)."""
    if local is not None and (newest := local.newest()) is not None:
        step, chosen = newest
        newest_persistent = int(np.max(all_processes(max(persistent.steps(), default=-1))))
        if step >= newest_persistent:
            restored = local.restore(step, chosen, abstract_state)
            if restored is not None:
                return restored
    return persistent.restore_latest(abstract_state)
