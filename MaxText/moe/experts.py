"""The routed experts behind one function: dispatch, grouped SwiGLU matmuls, weighted combine.

Backends are chosen by ``moe_matmul`` and share one signature; the seam is the whole routed-expert
computation rather than a single grouped matmul because a backend's best layout decides the
dispatch too (the blocked backend pads groups to whole blocks in the same gather that sorts).

- ``blocked``: block-padded groups and a scan of dense matmuls (ours; portable; CPU default).
- ``ragged_dot``: XLA's grouped matmul over the sorted, unpadded layout (GPU/TPU).
- ``auto``: ``ragged_dot`` on GPU/TPU, ``blocked`` elsewhere.

``capacity_factor > 0`` replaces all of them with the token-dropping baseline (``capacity.py``).

Shape legend: T tokens, K experts per token, E experts, D model dim, F expert hidden dim,
P padded rows.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp

from MaxText.config import Config
from MaxText.moe.blocked import block_matmul
from MaxText.moe.capacity import capacity_experts
from MaxText.moe.dispatch import block_layout, from_blocks, to_blocks

RoutedExperts = Callable[..., jax.Array]


def _blocked(x_TD, experts_TK, wi_0, wi_1, wo, config: Config) -> jax.Array:
    layout = block_layout(experts_TK, wi_0.shape[0], config.moe_block_rows)
    xp_PD = to_blocks(x_TD, layout)
    gate_PF = block_matmul(xp_PD, wi_0, layout.expert_NB)
    up_PF = block_matmul(xp_PD, wi_1, layout.expert_NB)
    return from_blocks(block_matmul(jax.nn.silu(gate_PF) * up_PF, wo, layout.expert_NB), layout)


def _ragged_dot(x_TD, experts_TK, wi_0, wi_1, wo, config: Config) -> jax.Array:
    layout = block_layout(experts_TK, wi_0.shape[0], block_rows=1)  # sorted, no padding
    xs_PD = to_blocks(x_TD, layout)
    sizes_E = jnp.zeros((wi_0.shape[0],), jnp.int32).at[experts_TK.reshape(-1)].add(1)
    gate_PF = jax.lax.ragged_dot(xs_PD, wi_0, sizes_E)
    up_PF = jax.lax.ragged_dot(xs_PD, wi_1, sizes_E)
    return from_blocks(jax.lax.ragged_dot(jax.nn.silu(gate_PF) * up_PF, wo, sizes_E), layout)


BACKENDS: dict[str, RoutedExperts] = {"blocked": _blocked, "ragged_dot": _ragged_dot}


def resolve_backend(name: str, platform: str | None = None) -> str:
    """``auto`` becomes the best backend for the platform (default: JAX's current backend)."""
    if name != "auto":
        return name
    platform = platform or jax.default_backend()
    return "ragged_dot" if platform in ("gpu", "cuda", "rocm", "tpu") else "blocked"


def routed_experts(
    x_TD: jax.Array,
    experts_TK: jax.Array,
    weights_TK: jax.Array,
    wi_0: jax.Array,
    wi_1: jax.Array,
    wo: jax.Array,
    config: Config,
) -> jax.Array:
    """``sum_k weights[t, k] * SwiGLU_{experts[t, k]}(x[t])`` for every token: [T, D] -> [T, D].

    Dropless unless ``capacity_factor > 0`` asks for the token-dropping baseline."""
    if config.capacity_factor > 0:
        y_TKD = capacity_experts(x_TD, experts_TK, wi_0, wi_1, wo, config.capacity_factor)
    else:
        y_TKD = BACKENDS[resolve_backend(config.moe_matmul)](x_TD, experts_TK, wi_0, wi_1, wo, config)
    return jnp.einsum("tkd,tk->td", y_TKD, weights_TK.astype(y_TKD.dtype))
