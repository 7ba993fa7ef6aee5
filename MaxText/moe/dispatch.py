"""Dropless dispatch: every (token, expert) copy gets a row, grouped by expert; none is dropped.

The layout sorts the T*K copies by expert and pads each expert's rows to a multiple of
``block_rows`` B, so that the rows form blocks that each belong to one expert (the ``blocked``
backend runs one dense matmul per block). With B = 1 there is no padding: rows [0, M) are the
copies sorted by expert, as ``ragged_dot`` wants them (the last E rows are unused).

Moving tokens into the layout and expert outputs back out are gathers, and each one's VJP is the
other kind of gather (no scatter-add of activations): a token's gradient is the sum of its K
copies' gradients, read through ``row_TK``.

Shape legend: T tokens, K experts per token (top-k), E experts, M = T*K routed rows,
NB blocks of B rows, P = NB*B padded rows, D feature dim.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp


class BlockLayout(NamedTuple):
    token_P: jax.Array  # padded row -> the token it holds (0 for padding rows)
    valid_P: jax.Array  # padded row holds a real (token, expert) copy
    row_TK: jax.Array  # (token, slot k) -> its padded row (an always-zero row for inactive copies)
    copy_P: jax.Array  # padded row -> its (token, slot) copy, flattened as token * K + k (0 for padding)
    expert_NB: jax.Array  # block -> its expert
    used_blocks: jax.Array  # blocks [0, used_blocks) hold rows; the rest are padding
    sizes_E: jax.Array  # active copies per expert


def num_blocks(num_rows: int, num_experts: int, block_rows: int) -> int:
    """Static upper bound on the blocks any routing needs, plus one block that always stays
    empty: sum_e ceil(n_e / B) <= M // B + E."""
    return num_rows // block_rows + num_experts + 1


def block_layout(
    experts_TK: jax.Array, num_experts: int, block_rows: int, active_TK: jax.Array | None = None
) -> BlockLayout:
    """The padded layout of every copy whose ``active_TK`` is true (all by default). Inactive
    copies (for example, routed to another device's experts) get no row: they read an
    always-zero row and contribute nothing."""
    T, K = experts_TK.shape
    M, B = T * K, block_rows
    NB = num_blocks(M, num_experts, B)
    active_M = jnp.ones((M,), bool) if active_TK is None else active_TK.reshape(M)
    flat_M = jnp.where(active_M, experts_TK.reshape(M), num_experts)  # inactive copies sort last
    order_M = jnp.argsort(flat_M, stable=True)  # sorted position -> (token, slot) copy
    sizes_E = jnp.zeros((num_experts + 1,), jnp.int32).at[flat_M].add(1)[:num_experts]
    blocks_E = (sizes_E + B - 1) // B
    block_end_E = jnp.cumsum(blocks_E)
    block_start_E = block_end_E - blocks_E
    row_start_E = jnp.cumsum(sizes_E) - sizes_E  # first sorted position of each expert

    expert_NB = jnp.minimum(jnp.searchsorted(block_end_E, jnp.arange(NB), side="right"), num_experts - 1)
    p_P = jnp.arange(NB * B)
    expert_P = expert_NB[p_P // B]
    offset_P = p_P - block_start_E[expert_P] * B
    valid_P = (p_P // B < block_end_E[-1]) & (offset_P < sizes_E[expert_P])
    sorted_P = jnp.where(valid_P, row_start_E[expert_P] + offset_P, 0)
    copy_P = jnp.where(valid_P, order_M[sorted_P], 0)

    # The padded row of each copy: its expert's first padded row + its rank within the expert.
    rank_M = jnp.zeros((M,), jnp.int32).at[order_M].set(jnp.arange(M, dtype=jnp.int32))
    expert_M = jnp.minimum(flat_M, num_experts - 1)
    row_M = jnp.where(active_M, block_start_E[expert_M] * B + rank_M - row_start_E[expert_M], NB * B - 1)
    return BlockLayout(copy_P // K, valid_P, row_M.reshape(T, K), copy_P, expert_NB, block_end_E[-1], sizes_E)


# ---- into and out of the padded layout: gathers whose transposes are gathers ----


@jax.custom_vjp
def _gather_into_blocks(x_TD: jax.Array, token_P: jax.Array, valid_P: jax.Array, row_TK: jax.Array) -> jax.Array:
    return jnp.where(valid_P[:, None], x_TD[token_P], 0)


def _gather_into_blocks_fwd(x_TD, token_P, valid_P, row_TK):
    return _gather_into_blocks(x_TD, token_P, valid_P, row_TK), (token_P, valid_P, row_TK)


def _gather_into_blocks_bwd(residuals, dxp_PD):
    token_P, valid_P, row_TK = residuals
    return dxp_PD[row_TK].sum(axis=1), None, None, None  # sum over each token's K copies


_gather_into_blocks.defvjp(_gather_into_blocks_fwd, _gather_into_blocks_bwd)


@jax.custom_vjp
def _gather_from_blocks(yp_PD: jax.Array, copy_P: jax.Array, valid_P: jax.Array, row_TK: jax.Array) -> jax.Array:
    return yp_PD[row_TK]


def _gather_from_blocks_fwd(yp_PD, copy_P, valid_P, row_TK):
    return _gather_from_blocks(yp_PD, copy_P, valid_P, row_TK), (copy_P, valid_P, row_TK)


def _gather_from_blocks_bwd(residuals, dy_TKD):
    copy_P, valid_P, row_TK = residuals
    T, K, D = dy_TKD.shape
    return jnp.where(valid_P[:, None], dy_TKD.reshape(T * K, D)[copy_P], 0), None, None, None


_gather_from_blocks.defvjp(_gather_from_blocks_fwd, _gather_from_blocks_bwd)


def to_blocks(x_TD: jax.Array, layout: BlockLayout) -> jax.Array:
    """[T, D] tokens -> [P, D] padded rows (each token appears once per chosen expert)."""
    return _gather_into_blocks(x_TD, layout.token_P, layout.valid_P, layout.row_TK)


def from_blocks(yp_PD: jax.Array, layout: BlockLayout) -> jax.Array:
    """[P, D] padded rows -> [T, K, D] each token's K expert outputs."""
    return _gather_from_blocks(yp_PD, layout.copy_P, layout.valid_P, layout.row_TK)


def combine(y_TKD: jax.Array, weights_TK: jax.Array) -> jax.Array:
    """Each token's K expert outputs summed with its router weights: [T, K, D] -> [T, D]."""
    return jnp.einsum("tkd,tk->td", y_TKD, weights_TK.astype(y_TKD.dtype))
