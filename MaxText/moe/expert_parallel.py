"""Expert parallelism: routed experts split over the ``expert`` mesh axis, inside ``shard_map``.

Each device holds ``E / ep`` experts and its shard of the tokens. ``moe_ep_comm`` chooses how
tokens reach their experts and come back; every exchange is dropless, whatever the routing:

- ``allgather``: gather every device's tokens (and routing) on the expert axis, compute the copies
  routed to the local experts, reduce-scatter the partial outputs back. Traffic: the whole
  group's tokens per device. Simple; the CPU choice.
- ``all_to_all``: each device sends each token once to every device holding one of its experts,
  in fixed slots of ``T + 1`` rows per destination (the most any routing can send there, so
  nothing is ever dropped); the receiver computes its copies, weights and sums them per token, and
  the partial outputs travel back the same way. Runs everywhere; moves whole slots.
- ``ragged_all_to_all``: the same slots, but only the rows in use move (sizes are exchanged
  first). GPU/TPU only: XLA:CPU does not implement it.
- ``te``: Transformer Engine's NCCL expert-parallel dispatch/combine (GPU; ``te_exchange.py``).

Which mesh axes hold tokens and experts comes from ``logical_axis_rules`` (``activation_batch``
and ``exp``); without an expert axis larger than 1 the caller computes experts directly. When
the tokens are not split over the expert axis, every device of the group already holds them:
each computes its own experts' copies and the partial outputs are summed.

Shape legend: T tokens (local), K experts per token, E experts (local), D model dim,
ep devices on the expert axis, C = T + 1 rows per slot, R = ep * C slot rows.
"""

from collections.abc import Callable
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from MaxText.config import Config
from MaxText.moe.dispatch import combine, gather_copies, gather_rows


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


# ---- fixed-slot exchanges: slot d of every device's [ep * C] rows goes to device d ----


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def slot_exchange(x_RD: jax.Array, send_sizes: jax.Array, recv_sizes: jax.Array, axis: str, ragged: bool) -> jax.Array:
    """Slot d (rows [d*C, (d+1)*C)) of ``x`` goes to device d, where it lands in slot ``me``.

    With ``ragged`` only the first ``send_sizes[d]`` rows of each slot travel (``recv_sizes[s]``
    arrive from device s) and the rest of each received slot is zero; otherwise whole slots move
    (the caller keeps unused rows zero). Its transpose is the same exchange back with the sizes
    swapped, which is also how outputs return to their tokens."""
    if not ragged:
        return jax.lax.all_to_all(x_RD, axis, 0, 0, tiled=True)
    ep = send_sizes.shape[0]
    C = x_RD.shape[0] // ep
    slot_starts = jnp.arange(ep, dtype=jnp.int32) * C
    here = jnp.full((ep,), jax.lax.axis_index(axis) * C, jnp.int32)
    return jax.lax.ragged_all_to_all(
        x_RD, jnp.zeros_like(x_RD), slot_starts, send_sizes, here, recv_sizes, axis_name=axis
    )


def _slot_exchange_fwd(x_RD, send_sizes, recv_sizes, axis, ragged):
    return slot_exchange(x_RD, send_sizes, recv_sizes, axis, ragged), (send_sizes, recv_sizes)


def _slot_exchange_bwd(axis, ragged, residuals, dy_RD):
    send_sizes, recv_sizes = residuals
    return slot_exchange(dy_RD, recv_sizes, send_sizes, axis, ragged), None, None


slot_exchange.defvjp(_slot_exchange_fwd, _slot_exchange_bwd)


def _send_slots(experts_TK: jax.Array, experts_per_device: int, ep: int):
    """Where each token goes: (token_R, destination_R, valid_R, row_Td, copy_R, sizes_d). Token t is sent once
    to every device d holding one of its experts, at row ``d*C + rank of t among d's tokens``;
    row ``d*C + T`` of every slot stays empty (where unsent (token, device) pairs point)."""
    T = experts_TK.shape[0]
    C = T + 1
    d_ = jnp.arange(ep)
    send_Td = (experts_TK[:, :, None] // experts_per_device == d_).any(axis=1)
    sizes_d = send_Td.sum(axis=0, dtype=jnp.int32)
    rank_Td = jnp.cumsum(send_Td, axis=0, dtype=jnp.int32) - 1
    row_Td = d_ * C + jnp.where(send_Td, rank_Td, T)
    # Slot d lists the tokens sent to d first (in token order), then an unused tail.
    token_dC = jnp.argsort(~send_Td, axis=0, stable=True).T  # [ep, T]
    token_R = jnp.concatenate([token_dC, jnp.zeros((ep, 1), token_dC.dtype)], axis=1).reshape(ep * C)
    valid_R = (jnp.arange(C) < sizes_d[:, None]).reshape(ep * C)
    destination_R = jnp.repeat(d_, C)
    copy_R = jnp.where(valid_R, token_R * ep + destination_R, 0)  # the (token, device) pair of each row
    return token_R, destination_R, valid_R, row_Td, copy_R, sizes_d


def _slot_experts(x_TD, experts_TK, weights_TK, wi_0, wi_1, wo, config, local_experts, axis, ragged):
    """Per device: send tokens to their experts' devices, compute, send partial outputs back."""
    ep, E_local = jax.sharding.get_abstract_mesh().shape[axis], wi_0.shape[0]
    token_R, destination_R, valid_R, row_Td, copy_R, send_sizes = _send_slots(experts_TK, E_local, ep)
    recv_sizes = jax.lax.all_to_all(send_sizes, axis, 0, 0, tiled=True)

    # Outbound: the tokens, their experts as ids local to the destination, their weights.
    x_RD = slot_exchange(gather_rows(x_TD, token_R, valid_R, row_Td), send_sizes, recv_sizes, axis, ragged)
    local_RK = experts_TK[token_R] - destination_R[:, None] * E_local
    active_RK = valid_R[:, None] & (local_RK >= 0) & (local_RK < E_local)
    weights_RK = jnp.where(active_RK, weights_TK[token_R], 0)
    local_RK, active_RK, weights_RK = (
        jax.lax.all_to_all(a, axis, 0, 0, tiled=True) for a in (local_RK, active_RK, weights_RK)
    )

    # Compute the received copies on the local experts; one weighted partial output per row.
    y_RKD = local_experts(x_RD, jnp.where(active_RK, local_RK, 0), active_RK, wi_0, wi_1, wo, config)
    y_RD = combine(y_RKD, weights_RK)

    # Inbound: partial outputs back to their tokens, summed over the devices that computed them.
    y_RD = slot_exchange(y_RD, recv_sizes, send_sizes, axis, ragged)
    return gather_copies(y_RD, copy_R, valid_R, row_Td).sum(axis=1)


def _allgather_experts(x_TD, experts_TK, weights_TK, wi_0, wi_1, wo, config, local_experts, axis):
    x_TD, experts_TK, weights_TK = (jax.lax.all_gather(a, axis, tiled=True) for a in (x_TD, experts_TK, weights_TK))
    y_TD = _own_experts(x_TD, experts_TK, weights_TK, wi_0, wi_1, wo, config, local_experts, axis)
    return jax.lax.psum_scatter(y_TD, axis, tiled=True)


def _own_experts(x_TD, experts_TK, weights_TK, wi_0, wi_1, wo, config, local_experts, axis):
    """The part of every token's output that this device's experts compute."""
    E_local = wi_0.shape[0]
    local_TK = experts_TK - jax.lax.axis_index(axis) * E_local
    active_TK = (local_TK >= 0) & (local_TK < E_local)
    y_TKD = local_experts(x_TD, jnp.where(active_TK, local_TK, 0), active_TK, wi_0, wi_1, wo, config)
    return combine(y_TKD, jnp.where(active_TK, weights_TK, 0))


def expert_parallel_experts(
    x_TD: jax.Array,
    experts_TK: jax.Array,
    weights_TK: jax.Array,
    wi_0: jax.Array,
    wi_1: jax.Array,
    wo: jax.Array,
    config: Config,
    local_experts: Callable[..., jax.Array],
    axis: str,
    exchange: str,
) -> jax.Array:
    """``routed_experts`` with experts split over ``axis``; ``local_experts`` is the backend."""
    token_spec = P(nn.logical_to_mesh_axes(("activation_batch",))[0], None)
    tokens_split_over_axis = axis in _mesh_axes(token_spec[0])
    expert_spec = P(axis, None, None)

    def per_device(x_TD, experts_TK, weights_TK, wi_0, wi_1, wo):
        args = (x_TD, experts_TK, weights_TK, wi_0, wi_1, wo, config, local_experts, axis)
        if not tokens_split_over_axis:  # every device of the group holds the same tokens
            return jax.lax.psum(_own_experts(*args), axis)
        if exchange == "allgather":
            return _allgather_experts(*args)
        return _slot_experts(*args, ragged=exchange == "ragged_all_to_all")

    return jax.shard_map(
        per_device,
        in_specs=(token_spec, token_spec, token_spec, expert_spec, expert_spec, expert_spec),
        out_specs=token_spec,
        check_vma=False,
    )(x_TD, experts_TK, weights_TK, wi_0, wi_1, wo)
