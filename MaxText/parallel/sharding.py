"""Logical axis names -> mesh shardings, using ``logical_axis_rules`` from the config.

The model tags every parameter with logical axes (via ``nn.with_logical_partitioning``) and
constrains activations by logical name; this module is the only place that maps those names
onto mesh axes.
"""

from typing import Any

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from MaxText.config import Config

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]


def axis_rules(config: Config) -> Rules:
    """The config's rules in Flax's form: [] -> None (replicated), [a] -> a, [a, b] -> (a, b)."""

    def mesh_axes(axes: list[str]):
        return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)

    return tuple((name, mesh_axes(axes)) for name, axes in config.logical_axis_rules)


def logical_to_shardings(boxed_tree: Any, mesh: Mesh, config: Config) -> Any:
    """NamedShardings for a tree of logically-partitioned (boxed) abstract values."""
    specs = nn.get_partition_spec(boxed_tree)
    return nn.logical_to_mesh_sharding(specs, mesh, axis_rules(config))


def batch_sharding(mesh: Mesh, config: Config) -> NamedSharding:
    """Sharding of [batch, length] input arrays."""
    spec = nn.logical_to_mesh_axes(("activation_batch", "activation_length"), axis_rules(config))
    return NamedSharding(mesh, spec)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def put_global_batch(local_batch: dict[str, Any], sharding: NamedSharding) -> dict[str, jax.Array]:
    """Assemble global arrays from each process's rows of the batch."""
    return {
        key: jax.make_array_from_process_local_data(
            sharding, value, (value.shape[0] * jax.process_count(), *value.shape[1:])
        )
        for key, value in local_batch.items()
    }
