"""Token-dropping capacity dispatch (GShard-style), kept as the baseline that dropless beats.

Each expert takes at most ``C = ceil(capacity_factor * T * K / E)`` token copies; copies beyond
that are dropped (their expert output is zero), with top-1 choices served before top-2 and so on.
Dispatch and combine are one-hot einsums over a [T, E, C] tensor, so memory and FLOPs grow with
T x E x C: this is what ``capacity_factor: -1`` (dropless) avoids.

Shape legend: T tokens, K experts per token, E experts, C capacity per expert, D model dim,
F expert hidden dim.
"""

import math

import jax
import jax.numpy as jnp


def capacity(num_tokens: int, num_experts_per_tok: int, num_experts: int, capacity_factor: float) -> int:
    return max(1, math.ceil(capacity_factor * num_tokens * num_experts_per_tok / num_experts))


def _positions(experts_TK: jax.Array, num_experts: int) -> jax.Array:
    """[T, K] each copy's place in its expert's queue (slot-major: all top-1 copies first)."""
    onehot_KTE = jax.nn.one_hot(experts_TK.T, num_experts, dtype=jnp.int32)
    flat = onehot_KTE.reshape(-1, num_experts)
    position = (jnp.cumsum(flat, axis=0) - flat).reshape(onehot_KTE.shape)
    return (position * onehot_KTE).sum(-1).T


def dropped_copies(experts_TK: jax.Array, num_experts: int, capacity_factor: float) -> jax.Array:
    """How many (token, expert) copies exceed their expert's capacity."""
    T, K = experts_TK.shape
    return (_positions(experts_TK, num_experts) >= capacity(T, K, num_experts, capacity_factor)).sum()


def capacity_experts(x_TD, experts_TK, wi_0, wi_1, wo, capacity_factor: float) -> jax.Array:
    """Each token's K expert outputs [T, K, D]; dropped copies give zeros."""
    T, K = experts_TK.shape
    E = wi_0.shape[0]
    C = capacity(T, K, E, capacity_factor)
    position_TK = _positions(experts_TK, E)
    # One-hot of (expert, slot in its queue) per copy; dropped copies (position >= C) are all-zero rows.
    dispatch_TKEC = (
        jax.nn.one_hot(experts_TK, E, dtype=x_TD.dtype)[..., None]
        * jax.nn.one_hot(jnp.where(position_TK < C, position_TK, C), C, dtype=x_TD.dtype)[..., None, :]
    )
    x_ECD = jnp.einsum("tkec,td->ecd", dispatch_TKEC, x_TD)
    h_ECF = jax.nn.silu(jnp.einsum("ecd,edf->ecf", x_ECD, wi_0)) * jnp.einsum("ecd,edf->ecf", x_ECD, wi_1)
    y_ECD = jnp.einsum("ecf,efd->ecd", h_ECF, wo)
    return jnp.einsum("tkec,ecd->tkd", dispatch_TKEC, y_ECD)
