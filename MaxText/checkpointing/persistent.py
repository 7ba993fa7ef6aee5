"""Orbax checkpoints of a run: async saves, restore of the newest good one, resharding, warm start.

Layout: ``<base_output_directory>/<run_name>/checkpoints/<step>/`` with three items:
``state`` (step, parameters, MoE correction biases, optimizer state), ``data`` (the data
iterator's state, JSON) and ``config`` (the resolved config, JSON). Orbax writes each step into a
temporary directory and renames it when complete, so a save killed midway leaves no step behind
to restore; a step that fails to read (truncated or corrupted files) is reported with its path and
the previous one is used. With several processes every process restores the same step: the newest
that all of them read (a process reads only its own shards, so one can fail where others succeed).

Restores go straight into the target shardings of the current mesh (Orbax reads each shard's
slice), so a checkpoint saved on one mesh restores onto another. The run's parameters are
checked against the checkpoint's shapes first; a mismatch names the first differing parameter.

This is the persistent tier; the node-local one is ``local.py``, and ``tiers.py`` chooses
between them at a restore.
"""

import logging
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from orbax.checkpoint._src.metadata import array_metadata_store  # no public path in 0.12.8

from MaxText.config import Config

# Orbax's replica-parallel save splits every replicated array between its replicas, compiling one
# slicing program per array shape: on the tiny model over 8 devices (88 shapes) that made the first
# save 2.9 s instead of 0.9. Arrays whose share per replica is under this size (norm scales,
# router biases, the step) are written whole by one replica; large ones are still split.
MIN_REPLICA_SLICE_BYTES = 1 << 20


def _register_array_handler() -> None:
    """Orbax's handler for ``jax.Array`` with ``MIN_REPLICA_SLICE_BYTES``, in place of its default
    (quietly: Orbax warns on stderr whenever a handler is replaced)."""
    handler = ocp.type_handlers.ArrayHandler(
        min_slice_bytes_for_replica_parallel=MIN_REPLICA_SLICE_BYTES,
        array_metadata_store=array_metadata_store.Store(),  # as in Orbax's default handler
    )
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)
    try:
        ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)
    finally:
        absl_logger.setLevel(level)


_register_array_handler()


class CheckpointError(Exception):
    """A checkpoint that must not be used: the message says which and why (exit code 2)."""


class Restored(NamedTuple):
    step: int
    state: Any
    data_state: dict | None
    path: Path


def _key(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def first_shape_mismatch(stored: Any, target: Any) -> str | None:
    """The first leaf (by path) missing from ``stored`` or with another shape, described; None if all match."""
    stored_leaves = {_key(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(stored)[0]}
    for path, leaf in jax.tree_util.tree_flatten_with_path(target)[0]:
        name = _key(path)
        if name not in stored_leaves:
            return f"{name} is missing from the checkpoint"
        stored_shape = tuple(getattr(stored_leaves[name], "shape", ()))
        if stored_shape != tuple(leaf.shape):
            return f"{name} has shape {stored_shape} in the checkpoint but {tuple(leaf.shape)} in the config"
    extra = set(stored_leaves) - {_key(p) for p, _ in jax.tree_util.tree_flatten_with_path(target)[0]}
    return f"{sorted(extra)[0]} is in the checkpoint but not in the model" if extra else None


def warn(message: str, everywhere: bool = False) -> None:
    """Print on process 0; ``everywhere``: on every process, naming it (what only one process saw)."""
    if everywhere and jax.process_count() > 1:
        print(f"warning: process {jax.process_index()}: {message}", file=sys.stderr, flush=True)
    elif jax.process_index() == 0:
        print(f"warning: {message}", file=sys.stderr, flush=True)


# One compiled copy of the whole tree (one dispatch, new buffers: XLA keeps explicit copies).
_device_copy = jax.jit(lambda tree: jax.tree.map(lambda x: x.copy(), tree))


class Checkpoints:
    """The run's checkpoint manager (one per run directory)."""

    def __init__(self, directory: Path, config: Config):
        self.directory = Path(directory).absolute()  # Orbax takes absolute paths only
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if config.max_num_checkpoints_to_keep == -1 else config.max_num_checkpoints_to_keep,
            enable_async_checkpointing=config.async_checkpointing,
            create=True,
            cleanup_tmp_directories=True,  # leftovers of a save that was killed midway
        )
        handlers = {
            "state": ocp.StandardCheckpointHandler(),
            "data": ocp.JsonCheckpointHandler(),
            "config": ocp.JsonCheckpointHandler(),
        }
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        self.state_handler, self.data_handler = ocp.StandardCheckpointHandler(), ocp.JsonCheckpointHandler()
        # Orbax's save synchronises the processes with a device collective: from a second thread of
        # a multi-process run it would interleave with the training step's collectives (gloo then
        # fails with mismatched sizes, NCCL may hang). Such runs save from the training thread, and
        # Orbax still writes in the background.
        self.in_background = config.async_checkpointing and config.checkpoint_device_copy and jax.process_count() == 1
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint") if self.in_background else None
        self.pending: Future | None = None

    def save(self, step: int, state: Any, data_state: dict | None, config: Config) -> None:
        """Start writing ``step`` (returns before the write finishes when saving asynchronously)."""
        if self.in_background:
            self.wait()  # one save at a time
            snapshot = _device_copy(state)  # the next step donates ``state``'s buffers
            self.pending = self.worker.submit(self._save, step, snapshot, data_state, config)
        else:
            self._save(step, state, data_state, config)

    def _save(self, step: int, state: Any, data_state: dict | None, config: Config) -> None:
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave(data_state or {}),
            config=ocp.args.JsonSave(config.model_dump(mode="json")),
        )
        self.manager.save(step, args=args, force=True)

    def wait(self) -> None:
        """Block until every started save is complete on disk."""
        if self.pending is not None:
            self.pending.result()
            self.pending = None
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.wait()
        if self.worker is not None:
            self.worker.shutdown()
        self.manager.close()
        self.state_handler.close()

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def step_path(self, step: int) -> Path:
        return self.directory / str(step)

    def restore_latest(self, abstract_state: Any) -> Restored | None:
        """The newest checkpoint that every process reads back, restored into ``abstract_state``'s
        shardings; None when there is none. Unreadable steps are skipped with a warning naming
        them; a step whose shapes differ from the model raises ``CheckpointError``.

        Each process reads only its own shards, so one process can fail on a step that the others
        read (a damaged file only it touches, a node-local view of the directory). The processes
        agree by descending minimum: each proposes the newest step it has restored at or below
        the bound, the minimum of the proposals becomes the bound, and a process holding a newer
        step restores again below it, until every proposal is the same step (one round when all
        is well). Restores call Orbax's handlers directly: ``CheckpointManager.restore`` ends in a
        barrier that a process whose read failed never reaches."""
        bound, held = None, None
        while True:
            if held is None or (bound is not None and held.step > bound):
                held = self._newest_readable(abstract_state, bound)
            proposals = all_processes(held.step if held is not None else -1)
            if proposals.min() == proposals.max():
                return held
            bound = int(proposals.min())
            if bound == -1:
                warn("no checkpoint is readable on every process; starting from scratch")
                return None
            warn(
                f"checkpoint {self.step_path(int(proposals.max()))} is not readable on every process; trying step {bound}"
            )

    def _newest_readable(self, abstract_state: Any, bound: int | None) -> Restored | None:
        """This process's newest step at or below ``bound`` that restores, restored; None if none."""
        for step in reversed([s for s in self.steps() if bound is None or s <= bound]):
            path = self.step_path(step)
            try:
                stored = self.manager.item_metadata(step)["state"]
            except Exception as err:  # unreadable metadata: a damaged step
                warn(f"checkpoint {path} is unreadable ({type(err).__name__}); using the previous one", everywhere=True)
                continue
            if stored is not None and (mismatch := first_shape_mismatch(stored, abstract_state)):
                raise CheckpointError(f"checkpoint {path} does not match the config: {mismatch}")
            try:
                state = self.state_handler.restore(path / "state", args=ocp.args.StandardRestore(abstract_state))
                data = self.data_handler.restore(path / "data", args=ocp.args.JsonRestore())
            except Exception as err:
                reason = (str(err).strip().splitlines() or [type(err).__name__])[0].split(". See full")[0]
                warn(f"checkpoint {path} is unreadable ({reason[:200]}); using the previous one", everywhere=True)
                continue
            return Restored(step, state, data or None, path)
        return None


def all_processes(value: int) -> np.ndarray:
    """``value`` from every process, in process order (a collective: every process must call it)."""
    if jax.process_count() == 1:
        return np.array([value])
    return np.asarray(multihost_utils.process_allgather(np.int32(value))).reshape(-1)


def _stored_item(path: str) -> tuple[Path, Any]:
    """(the Orbax item directory, its stored tree metadata) of a warm-start checkpoint."""
    root = Path(path).absolute()
    item = root / "state" if (root / "state").is_dir() else root
    if not item.is_dir():
        raise CheckpointError(f"config key 'load_parameters_path': {path} is not a checkpoint directory")
    try:
        return item, ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).metadata(item).item_metadata.tree
    except Exception as err:
        raise CheckpointError(f"config key 'load_parameters_path': cannot read a checkpoint at {item} ({err})") from err


def _restore(item: Path, target: Any) -> Any:
    """The part of the stored tree that ``target`` (abstract arrays with shardings) names."""
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).restore(
        item, args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True)
    )


def load_parameters(path: str, abstract_params: Any) -> Any:
    """Parameters only, into the given shardings, from a checkpoint step directory
    (``.../checkpoints/<step>``), its ``state`` item, or a checkpoint of a parameters tree (such
    as a converted one)."""
    item, stored = _stored_item(path)
    nested = isinstance(stored, dict) and "params" in stored  # a whole train state, or parameters alone
    if mismatch := first_shape_mismatch(stored["params"] if nested else stored, abstract_params):
        raise CheckpointError(f"checkpoint {item} does not match the config: {mismatch}")
    return _restore(item, {"params": abstract_params})["params"] if nested else _restore(item, abstract_params)


def load_moe_bias(path: str, abstract_bias: Any) -> Any | None:
    """The MoE correction biases of a warm-start checkpoint (a train state's, or a converted
    checkpoint's ``moe_bias``), into the given shardings; None when it has none (a parameters tree)."""
    item, stored = _stored_item(path)
    if not (isinstance(stored, dict) and "moe_bias" in stored) or not jax.tree.leaves(abstract_bias):
        return None
    if mismatch := first_shape_mismatch(stored["moe_bias"], abstract_bias):
        raise CheckpointError(f"checkpoint {item} does not match the config: moe_bias/{mismatch}")
    return _restore(item, {"moe_bias": abstract_bias})["moe_bias"]
