"""The device mesh from ``ici_*`` and ``dcn_*`` parallelism.

Axes are ``MESH_AXES`` (stage, data, fsdp, expert, tensor). Each axis is ``dcn x ici`` ways: the dcn
part spans fast domains (NVL72 racks, hosts), the ici part stays inside one. Devices are ordered
by process, so consecutive processes (a rack, under Slurm's block topology) form one domain;
the dcn factor of every axis is outermost.
"""

import math

import jax
import numpy as np
from jax.sharding import Mesh

from MaxText.config import Config, ConfigError
from MaxText.parallel.axes import MESH_AXES, STAGE_AXIS


def _fill(values: list[int], total: int, kind: str) -> list[int]:
    """Replace a -1 with whatever makes the product equal ``total``."""
    known = math.prod(v for v in values if v != -1)
    if -1 in values:
        if total % known:
            raise ConfigError(f"config key '{kind}_*_parallelism': {total} devices cannot be split by {known}")
        values = [total // known if v == -1 else v for v in values]
    return values


def mesh_shape(config: Config, num_devices: int) -> tuple[list[int], list[int]]:
    """(dcn, ici) parallelism per mesh axis, with the -1 filled in for ``num_devices``."""
    ici, dcn = config.ici_parallelism(), config.dcn_parallelism()
    if -1 in dcn:
        dcn = _fill(dcn, num_devices // math.prod(ici), "dcn")
    ici = _fill(ici, num_devices // math.prod(dcn), "ici")
    product = math.prod(ici) * math.prod(dcn)
    if product != num_devices:
        raise ConfigError(
            f"config key 'ici_*/dcn_*_parallelism': the mesh {dict(zip(MESH_AXES, np.multiply(ici, dcn).tolist(), strict=True))}"
            f" needs {product} devices, but this job has {num_devices} devices"
        )
    ways = dict(zip(MESH_AXES, [d * i for d, i in zip(dcn, ici, strict=True)], strict=True))
    if config.num_experts % ways["expert"]:
        raise ConfigError(
            f"config key 'ici_expert_parallelism': num_experts ({config.num_experts}) is not divisible by expert parallelism ({ways['expert']})"
        )
    if ways[STAGE_AXIS] > 1:
        # Inside a stage, a micro-batch's rows (each of its lanes') are split over the stage's devices but tensor.
        rows, microbatches = config.micro_batch_size(num_devices), config.pipeline_microbatches
        split = num_devices // (ways[STAGE_AXIS] * ways["tensor"])
        lanes = config.num_pipeline_lanes
        if rows % (microbatches * split):
            raise ConfigError(
                f"config key 'num_pipeline_microbatches': {rows} sequences per batch do not cut into {microbatches} "
                f"micro-batches of a multiple of {split} rows (one per device of a stage); change "
                "num_pipeline_microbatches or per_device_batch_size"
            )
        if rows % (microbatches * split * lanes):
            raise ConfigError(
                f"config key 'num_pipeline_lanes': {rows // microbatches} rows of a micro-batch do not deal into "
                f"{lanes} lanes of a multiple of {split} rows (one per device of a stage); change num_pipeline_lanes, "
                "num_pipeline_microbatches or per_device_batch_size"
            )
    return dcn, ici


def make_mesh(config: Config, devices: list | None = None) -> Mesh:
    devices = list(jax.devices() if devices is None else devices)
    devices.sort(key=lambda d: (d.process_index, d.id))
    dcn, ici = mesh_shape(config, len(devices))
    n = len(MESH_AXES)
    grid = np.array(devices, dtype=object).reshape(dcn + ici)
    # (dcn_0..dcn_n, ici_0..ici_n) -> (dcn_0, ici_0, dcn_1, ici_1, ...) -> one dim per axis.
    grid = grid.transpose([i for axis in range(n) for i in (axis, n + axis)])
    return Mesh(grid.reshape([d * i for d, i in zip(dcn, ici, strict=True)]), MESH_AXES)
