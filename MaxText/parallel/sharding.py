"""Logical axis names -> mesh shardings, using ``logical_axis_rules`` from the config.

The model tags every parameter with logical axes (via ``nn.with_logical_partitioning``) and
constrains activations by logical name; this module is the only place that maps those names
onto mesh axes.
"""

import itertools
import math
from collections.abc import Sequence
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


def spec_axes(entry: str | Sequence[str] | None) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec (or rule) entry: None, a name or names, as a tuple."""
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def batch_mesh_axes() -> tuple[str, ...]:
    """The mesh axes the rules map ``activation_batch`` (the tokens' split) onto, () outside a
    mesh; inside a shard_map, less its manual axes (a pipeline stage's tokens are its own)."""
    if jax.sharding.get_abstract_mesh().empty:
        return ()
    return without_manual_axes(PartitionSpec(nn.logical_to_mesh_axes(("activation_batch",))[0]))[0] or ()


def interleaved_split(x: jax.Array, n: int) -> jax.Array:
    """[B, ...] -> [n, B / n, ...], micro-batch i taking rows i, i + n, ...: each micro-batch keeps
    the batch's split over devices (a device's rows stay its own), where contiguous slices would
    give each micro-batch to a few devices."""
    return x.reshape(x.shape[0] // n, n, *x.shape[1:]).swapaxes(0, 1)


def interleaved_join(x: jax.Array) -> jax.Array:
    """The inverse of ``interleaved_split``: [n, B / n, ...] -> [B, ...]."""
    return x.swapaxes(0, 1).reshape(-1, *x.shape[2:])


def without_manual_axes(spec: PartitionSpec) -> PartitionSpec:
    """``spec`` less the current mesh's manual axes (inside a shard_map, such as the pipeline's
    over ``stage``, those are split by hand; a sharding constraint may not name them). Each entry
    becomes a tuple of mesh axes, or None."""
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    entries = [tuple(a for a in spec_axes(entry) if a not in manual) for entry in spec]
    return PartitionSpec(*(entry or None for entry in entries))


def constrain(x: jax.Array, logical_axes: Sequence[str]) -> jax.Array:
    """Shard an activation by logical axis names (a no-op outside a mesh); inside a shard_map the
    rules' manual axes are left out."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not mesh.manual_axes:
        return nn.with_logical_constraint(x, tuple(logical_axes))
    spec = nn.logical_to_mesh_axes(tuple(logical_axes))
    return jax.lax.with_sharding_constraint(x, without_manual_axes(spec))


def vocabulary_group(
    vocab_size: int, axes: Sequence[str], batch_axes: Sequence[str], axis_sizes: dict[str, int]
) -> tuple[str, ...]:
    """The mesh axes the embedding and the output head are split over by vocabulary rows
    (``layers/vocab_parallel.py``): of ``axes`` that split the batch (size > 1), the largest
    product that divides ``vocab_size`` (given data 8 x fsdp 2 x expert 64, 129,280 rows split
    128 ways, over fsdp x expert, not 1,024). () where none does."""
    candidates = [a for a in batch_axes if a in axes and axis_sizes.get(a, 1) > 1]
    best, best_ways = (), 1
    for r in range(len(candidates), 0, -1):
        for group in itertools.combinations(candidates, r):
            ways = math.prod(axis_sizes[a] for a in group)
            if vocab_size % ways == 0 and ways > best_ways:
                best, best_ways = group, ways
    return best


def parameter_rules(config: Config, axis_sizes: dict[str, int]) -> Rules:
    """The rules parameters are stored by: the config's, led by the vocabulary split's group when
    there is one, so that the embedding and the head are held as the split reads them, their rows
    over the group (and their embed dim over the FSDP axes left). Stored by the plain rules instead
    (embed dim over fsdp x expert), XLA:SPMD could not reshard them to the split's layout and
    replicated both on every device each step ("involuntary full rematerialization")."""
    group = config_vocab_group(config, axis_sizes)
    return ((("vocab", group if len(group) > 1 else group[0]),) if group else ()) + axis_rules(config)


def config_vocab_group(
    config: Config, axis_sizes: dict[str, int], axes: Sequence[str] | None = None
) -> tuple[str, ...]:
    """``vocabulary_group`` for a config and mesh axis sizes, outside a trace: of ``axes`` (default:
    ``vocab_parallel_axes``), those the rules' ``activation_batch`` splits."""
    batch = dict(axis_rules(config)).get("activation_batch")
    batch = () if batch is None else (batch,) if isinstance(batch, str) else batch
    return vocabulary_group(config.vocab_size, config.vocab_axes() if axes is None else axes, batch, axis_sizes)


def logical_to_shardings(boxed_tree: Any, mesh: Mesh, config: Config) -> Any:
    """NamedShardings for a tree of logically-partitioned (boxed) abstract values."""
    specs = parameter_specs(boxed_tree, dict(mesh.shape), config)
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def parameter_mesh_axes(
    names: tuple[str | None, ...], shape: tuple[int, ...], rules: Rules, axis_sizes: dict[str, int]
) -> tuple[Any, ...]:
    """Flax's priority rules (each rule, in order, claims the dim of its name if the rule's mesh
    axes are still free) with one addition for parameters: a rule whose split does not divide the
    dim is passed over, so a later rule of the same name can take it. That lets a name ask for
    ``fsdp x expert`` where it divides and fall back to ``fsdp`` where it does not (the MLA
    latents at 1,024 GPUs). A dim that no rule of its name could divide is an error."""
    result: list[Any] = [None] * len(names)
    assigned, indivisible = [False] * len(names), {}
    used: set[str] = set()
    for name, axes in rules:
        if name not in names:
            continue
        i = names.index(name)
        mesh_axes = spec_axes(axes)
        if assigned[i] or used & set(mesh_axes):
            continue
        ways = math.prod(axis_sizes.get(a, 1) for a in mesh_axes)  # an axis not given is one way
        if shape[i] % ways:
            indivisible[i] = (ways, axes)  # the last one tried is the one to report
            continue
        result[i], assigned[i] = axes, True
        used |= set(mesh_axes)
    for i, (ways, axes) in indivisible.items():
        if not assigned[i]:
            raise ValueError(f"cannot be split {ways} ways over {axes} (dim {shape[i]})")
    return tuple(result)


def stored_spec(shape: tuple[int, ...], logical_axes: Sequence[str | None]) -> PartitionSpec:
    """How a parameter of ``shape`` declared with ``logical_axes`` is stored across the current
    mesh (``parameter_mesh_axes`` with the rules in force): what a shard_map that takes it as
    stored, or leaves its gradient as stored, names."""
    mesh = jax.sharding.get_abstract_mesh()
    return PartitionSpec(
        *parameter_mesh_axes(tuple(logical_axes), shape, nn.get_logical_axis_rules(), dict(mesh.shape))
    )


def parameter_specs(boxed_tree: Any, axis_sizes: dict[str, int], config: Config) -> Any:
    """A PartitionSpec per boxed leaf (``parameter_mesh_axes``). Needs only the mesh's axis sizes,
    so a cluster layout can be checked without its devices; a split that cannot divide raises a
    ConfigError naming the parameter (JAX would refuse it later, with a less helpful message)."""
    rules = parameter_rules(config, axis_sizes)
    is_box = lambda x: isinstance(x, nn.LogicallyPartitioned)  # noqa: E731

    def spec(path, box):
        if not is_box(box):
            return PartitionSpec()
        try:
            return PartitionSpec(*parameter_mesh_axes(tuple(box.names), box.value.shape, rules, axis_sizes))
        except ValueError as err:
            raise ConfigError(
                f"config key 'logical_axis_rules': {jax.tree_util.keystr(path)} {tuple(box.value.shape)} {err}; "
                "change the mesh or the rules"
            ) from None

    return jax.tree_util.tree_map_with_path(spec, boxed_tree, is_leaf=is_box)


def check_splits(boxed_tree: Any, axis_sizes: dict[str, int], config: Config) -> None:
    """Raise a ConfigError naming the first parameter whose split does not divide its dim."""
    parameter_specs(boxed_tree, axis_sizes, config)


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
