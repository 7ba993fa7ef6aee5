"""Reading our checkpoints for the tools: the config saved with one, its variables, slot by slot reads.

A checkpoint directory is either a converted one (``config.yml`` + ``state/``) or a training
step (``<run>/checkpoints/<step>/`` with ``state/`` and the resolved config in ``config/``).
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

from MaxText.checkpointing import load_moe_bias, load_parameters
from MaxText.config import Config, ConfigError, load_config
from MaxText.hf import HFCheckpointError
from MaxText.moe.block import BIAS


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
            stored = ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).metadata(self.item).item_metadata.tree
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
            )
            spec = ocp.type_handlers.get_json_tspec_read(info, self.use_ocdbt)
            self.stores[leaf] = ts.open(spec, context=self.context).result()
        return np.asarray(self.stores[leaf][index].read().result()).astype(np.float32, copy=False)
