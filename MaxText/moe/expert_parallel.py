"""Expert parallelism: routed experts split over the ``expert`` mesh axis, inside ``shard_map``.

Each device holds ``E / ep`` experts and its shard of the tokens. The ``allgather`` exchange
gathers the tokens (and their routing) of every device on the expert axis, computes the copies
routed to its own experts (dropless: however many there are; copies for other devices' experts
take no rows), and reduce-scatters the partial outputs back to the tokens' owners. Its traffic
is the whole group's tokens per device, so it suits small expert groups and CPU; exact-size
all-to-all exchanges are the scalable alternative on GPU.

Which mesh axes hold tokens and experts comes from ``logical_axis_rules`` (``activation_batch``
and ``exp``); without an expert axis larger than 1 the caller computes experts directly.

Shape legend: T tokens (local / gathered), K experts per token, E experts (local), D model dim.
"""

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from MaxText.config import Config
from MaxText.moe.dispatch import combine


def expert_axis() -> str | None:
    """The mesh axis experts are split over in the current mesh and rules, if more than 1 way."""
    mesh = jax.sharding.get_abstract_mesh()
    axes = nn.logical_to_mesh_axes(("exp",))[0]
    if mesh.empty or axes is None:
        return None
    if not isinstance(axes, str):
        raise ValueError(f"logical_axis_rules: 'exp' must map to one mesh axis, got {axes}")
    return axes if mesh.shape[axes] > 1 else None


def _mesh_axes(spec_entry) -> tuple[str, ...]:
    return () if spec_entry is None else (spec_entry,) if isinstance(spec_entry, str) else tuple(spec_entry)


def allgather_experts(
    x_TD: jax.Array,
    experts_TK: jax.Array,
    weights_TK: jax.Array,
    wi_0: jax.Array,
    wi_1: jax.Array,
    wo: jax.Array,
    config: Config,
    local_experts: Callable[..., jax.Array],
    axis: str,
) -> jax.Array:
    """``routed_experts`` with experts split over ``axis``; ``local_experts`` is the backend."""
    token_spec = P(nn.logical_to_mesh_axes(("activation_batch",))[0], None)
    tokens_split_over_axis = axis in _mesh_axes(token_spec[0])
    expert_spec = P(axis, None, None)

    def per_device(x_TD, experts_TK, weights_TK, wi_0, wi_1, wo):
        if tokens_split_over_axis:
            x_TD, experts_TK, weights_TK = (
                jax.lax.all_gather(a, axis, tiled=True) for a in (x_TD, experts_TK, weights_TK)
            )
        E_local = wi_0.shape[0]
        local_TK = experts_TK - jax.lax.axis_index(axis) * E_local
        active_TK = (local_TK >= 0) & (local_TK < E_local)
        y_TKD = local_experts(x_TD, jnp.where(active_TK, local_TK, 0), active_TK, wi_0, wi_1, wo, config)
        y_TD = combine(y_TKD, jnp.where(active_TK, weights_TK, 0))
        if tokens_split_over_axis:
            return jax.lax.psum_scatter(y_TD, axis, tiled=True)
        return jax.lax.psum(y_TD, axis)

    return jax.shard_map(
        per_device,
        in_specs=(token_spec, token_spec, token_spec, expert_spec, expert_spec, expert_spec),
        out_specs=token_spec,
        check_vma=False,
    )(x_TD, experts_TK, weights_TK, wi_0, wi_1, wo)
