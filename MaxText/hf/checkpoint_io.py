"""Reading our checkpoints for the tools: the config saved with one, its variables, slot by slot reads.

A checkpoint directory is either a converted one (``config.yml`` + ``state/``) or a training
step (``<run>/checkpoints/<step>/`` with ``state/`` and the resolved config in ``config/``).
``resolve_checkpoint`` also takes a run folder or its ``checkpoints/`` folder: the newest step
that Orbax finished writing (a save killed midway leaves a temporary directory, never a step).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
import yaml
from etils import epath

from MaxText.checkpointing import load_moe_bias, load_parameters
from MaxText.config import Config, ConfigError, load_config
from MaxText.hf import HFCheckpointError
from MaxText.moe.block import BIAS

KINDS = "a run folder, its checkpoints/ folder, a step directory or a converted checkpoint"


def resolve_checkpoint(path: str | Path) -> tuple[Path, str | None]:
    """(the checkpoint directory, a line saying which step was taken, or None when ``path`` is one
    already). A run folder or a checkpoints/ folder gives its newest complete step."""
    root = Path(path)
    if (root / "state").is_dir():
        return root, None
    if not root.is_dir():
        raise HFCheckpointError(f"--checkpoint {root}: no such folder (expected {KINDS})")
    folder = root / "checkpoints" if (root / "checkpoints").is_dir() else root
    # The steps the run's CheckpointManager sees as finalized (not temporary), with a state item.
    finalized = ocp.path.step.standard_name_format().find_all(epath.Path(folder.absolute()))
    steps = sorted(m.step for m in finalized if (folder / str(m.step) / "state").is_dir())
    if steps:
        step = folder / str(steps[-1])
        count = f"{len(steps)} complete steps" if len(steps) > 1 else "1 complete step"
        return step, f"checkpoint: {step} (the newest of {count} in {folder})"
    if folder != root or root.name == "checkpoints":
        raise HFCheckpointError(f"--checkpoint {root}: {folder} holds no complete checkpoint step")
    if (root / "metrics.jsonl").is_file():
        raise HFCheckpointError(f"--checkpoint {root}: the run saved no checkpoint (it has no checkpoints/ folder)")
    raise HFCheckpointError(f"--checkpoint {root} is not a checkpoint (no state/, no checkpoints/; expected {KINDS})")


def names_tokenizer(directory: str | Path) -> bool:
    """Whether the checkpoint's saved config names its tokenizer: a training step's always does
    (the whole resolved config); a converted checkpoint's config.yml only if it was given one."""
    overlay = Path(directory) / "config.yml"
    return not overlay.is_file() or "tokenizer_type" in (yaml.safe_load(overlay.read_text()) or {})


def checkpoint_config(directory: str | Path, *overrides: str) -> Config:
    """The config saved with the checkpoint (``config.yml``, or a training step's ``config`` item)."""
    root = Path(directory)
    if not (root / "state").is_dir():
        raise HFCheckpointError(f"--checkpoint {root} is not a checkpoint directory (no state/)")
    try:
        if (root / "config.yml").is_file():
            return load_config([str(root / "config.yml"), "run_name=tool", *overrides])
        saved = root / "config" / "metadata"
        if not saved.is_file():
            raise HFCheckpointError(f"--checkpoint {root} has neither config.yml nor a saved config (config/metadata)")
        data = json.loads(saved.read_text())
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "config.yml"
            path.write_text(yaml.safe_dump(data))
            return load_config([str(path), "run_name=tool", *overrides])
    except ConfigError as err:
        raise HFCheckpointError(str(err)) from None


def restore_variables(directory: str | Path, config: Config, abstract: dict[str, Any]) -> dict[str, Any]:
    """{"params", "moe_bias"} on the default device (biases zero when the checkpoint has none)."""
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    placed = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), abstract)
    params = load_parameters(str(directory), placed["params"])
    bias = load_moe_bias(str(directory), placed[BIAS])
    if bias is None:
        bias = jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype), placed[BIAS])
    return {"params": params, BIAS: bias}


class LeafReader:
    """Slices of a checkpoint's leaves, read straight from its tensorstore arrays (OCDBT or not),
    so an export holds one HF tensor at a time, never a stacked leaf. The arrays are opened with
    the spec Orbax itself reads them with (``get_json_tspec_read``)."""

    def __init__(self, directory: str | Path):
        root = Path(directory)
        self.item = (root / "state" if (root / "state").is_dir() else root).absolute()
        try:
            layout = json.loads((self.item / "_METADATA").read_text())
            # The item's own metadata: a Checkpointer would also look for a step's metadata file
            # inside the item and warn that a training step has none there.
            stored = ocp.PyTreeCheckpointHandler().metadata(epath.Path(self.item)).tree
        except Exception as err:
            raise HFCheckpointError(f"cannot read a checkpoint at {self.item} ({err})") from None
        self.use_ocdbt, self.use_zarr3 = bool(layout.get("use_ocdbt")), bool(layout.get("use_zarr3"))
        self.nested = isinstance(stored, dict) and "params" in stored  # else a bare parameters tree
        self.stored = stored
        self.context = ocp.type_handlers.get_ts_context(use_ocdbt=self.use_ocdbt)
        self.stores: dict[tuple[str, ...], Any] = {}

    def _metadata(self, leaf: tuple[str, ...]) -> Any:
        node = self.stored
        for key in leaf if self.nested else leaf[1:]:
            if not isinstance(node, dict) or key not in node:
                return None
            node = node[key]
        return node

    def has(self, leaf: tuple[str, ...]) -> bool:
        return self._metadata(leaf) is not None

    def read(self, leaf: tuple[str, ...], index: tuple[int, ...] = ()) -> np.ndarray:
        """``leaf[index]`` as float32 (the whole leaf for ``index=()``)."""
        if leaf not in self.stores:
            info = ocp.type_handlers.ParamInfo(
                name=self._metadata(leaf).name,
                parent_dir=self.item,
                is_ocdbt_checkpoint=self.use_ocdbt,
                use_zarr3=self.use_zarr3,
                ts_context=self.context,  # one shared context (Orbax warns once per leaf without it)
            )
            spec = ocp.type_handlers.get_json_tspec_read(info, self.use_ocdbt)
            self.stores[leaf] = ts.open(spec, context=self.context).result()
        return np.asarray(self.stores[leaf][index].read().result()).astype(np.float32, copy=False)
