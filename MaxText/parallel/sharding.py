"""Logical axis names -> mesh shardings, using ``logical_axis_rules`` from the config.

The model tags every parameter with logical axes (via ``nn.with_logical_partitioning``) and
constrains activations by logical name; this module is the only place that maps those names
onto mesh axes.
"""

import math
from typing import Any

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from MaxText.config import Config, ConfigError

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]


def axis_rules(config: Config) -> Rules:
    """The config's rules in Flax's form: [] -> None (replicated), [a] -> a, [a, b] -> (a, b)."""

    def mesh_axes(axes: list[str]):
        return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)

    return tuple((name, mesh_axes(axes)) for name, axes in config.logical_axis_rules)


def logical_to_shardings(boxed_tree: Any, mesh: Mesh, config: Config) -> Any:
    """NamedShardings for a tree of logically-partitioned (boxed) abstract values."""
    check_splits(boxed_tree, dict(mesh.shape), config)
    return nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed_tree), mesh, axis_rules(config))


def check_splits(boxed_tree: Any, axis_sizes: dict[str, int], config: Config) -> None:
    """Every split must divide its dim; otherwise a ConfigError names the first parameter that
    does not fit (JAX would refuse it later, with a less helpful message). Needs only the mesh's
    axis sizes, so a cluster layout can be checked without its devices."""
    rules = axis_rules(config)
    boxes = jax.tree_util.tree_flatten_with_path(boxed_tree, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))[
        0
    ]
    for path, box in boxes:
        if not isinstance(box, nn.LogicallyPartitioned):
            continue
        for dim, axes in zip(box.value.shape, nn.logical_to_mesh_axes(box.names, rules), strict=False):
            ways = math.prod(axis_sizes[a] for a in ((axes,) if isinstance(axes, str) else axes or ()))
            if dim % ways:
                raise ConfigError(
                    f"config key 'logical_axis_rules': {jax.tree_util.keystr(path)} {tuple(box.value.shape)} "
                    f"cannot be split {ways} ways over {axes} (dim {dim}); change the mesh or the rules"
                )


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
