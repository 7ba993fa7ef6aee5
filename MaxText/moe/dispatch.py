"""Dropless token dispatch by sorting: every (token, expert) pair is computed, none dropped.

``sort_by_expert`` lays the T*K token copies out grouped by expert (group sizes vary freely);
``combine`` puts the expert outputs back in token order and sums them with the router weights.

Shape legend: T tokens, K experts per token, M = T*K routed rows, D model dim, E experts.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Dispatch(NamedTuple):
    x_MD: jax.Array  # token copies sorted by expert
    group_sizes_E: jax.Array  # rows per expert in x_MD (int32)
    order_M: jax.Array  # x_MD[m] is a copy of token order_M[m] // K


def sort_by_expert(x_TD: jax.Array, experts_TK: jax.Array, num_experts: int) -> Dispatch:
    K = experts_TK.shape[-1]
    order_M = jnp.argsort(experts_TK.reshape(-1), stable=True)
    group_sizes_E = jnp.zeros((num_experts,), jnp.int32).at[experts_TK.reshape(-1)].add(1)
    return Dispatch(x_TD[order_M // K], group_sizes_E, order_M)


def combine(y_MD: jax.Array, order_M: jax.Array, weights_TK: jax.Array) -> jax.Array:
    """Un-sort expert outputs and sum each token's K outputs weighted by the router."""
    T, K = weights_TK.shape
    inverse_M = jnp.zeros_like(order_M).at[order_M].set(jnp.arange(order_M.shape[0], dtype=order_M.dtype))
    y_TKD = y_MD[inverse_M].reshape(T, K, -1)
    return jnp.einsum("tkd,tk->td", y_TKD, weights_TK.astype(y_TKD.dtype))
