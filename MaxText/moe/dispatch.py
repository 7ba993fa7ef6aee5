"""Dropless dispatch: every (token, expert) copy gets a row, grouped by expert; none is dropped.

The layout sorts the T*K copies by expert and pads each expert's rows to a multiple of
``row_multiple`` (the ``blocked`` backend's smallest block; 1 for ``ragged_dot`` and ``te``, which
take the sorted rows unpadded). Expert e's rows are ``[start_E[e], start_E[e] + sizes_E[e])``; the
rest of its ``padded_E[e]`` rows and every row past the last expert are zero.

Moving tokens into the layout and expert outputs back out are gathers, and each one's VJP is the
other kind of gather (no scatter-add of activations): a token's gradient is the sum of its K
copies' gradients, read through ``row_TK``.

Shape legend: T tokens, K experts per token (top-k), E experts, M = T*K routed rows,
P padded rows, D feature dim.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp


class BlockLayout(NamedTuple):
    token_P: jax.Array  # padded row -> the token it holds (0 for padding rows)
    valid_P: jax.Array  # padded row holds a real (token, expert) copy
    row_TK: jax.Array  # (token, slot k) -> its padded row (an always-zero row for inactive copies)
    copy_P: jax.Array  # padded row -> its (token, slot) copy, flattened as token * K + k (0 for padding)
    sizes_E: jax.Array  # active copies per expert
    start_E: jax.Array  # each expert's first padded row
    padded_E: jax.Array  # rows each expert occupies: its size rounded up to the row multiple


def num_padded_rows(num_rows: int, num_experts: int, row_multiple: int) -> int:
    """Static number of rows that holds any routing: each expert pads fewer than ``row_multiple``
    rows, plus one row that always stays zero (where inactive copies point)."""
    used = num_rows + num_experts * (row_multiple - 1)
    return (used // row_multiple + 1) * row_multiple


def block_layout(
    experts_TK: jax.Array, num_experts: int, row_multiple: int, active_TK: jax.Array | None = None
) -> BlockLayout:
    """The padded layout of every copy whose ``active_TK`` is true (all by default). Inactive
    copies (for example, routed to another device's experts) get no row: they read an
    always-zero row and contribute nothing."""
    T, K = experts_TK.shape
    M, m = T * K, row_multiple
    P = num_padded_rows(M, num_experts, m)
    active_M = jnp.ones((M,), bool) if active_TK is None else active_TK.reshape(M)
    flat_M = jnp.where(active_M, experts_TK.reshape(M), num_experts)  # inactive copies sort last
    order_M = jnp.argsort(flat_M, stable=True)  # sorted position -> (token, slot) copy
    sizes_E = jnp.zeros((num_experts + 1,), jnp.int32).at[flat_M].add(1)[:num_experts]
    padded_E = (sizes_E + m - 1) // m * m
    end_E = jnp.cumsum(padded_E)
    start_E = end_E - padded_E
    sorted_start_E = jnp.cumsum(sizes_E) - sizes_E  # first sorted position of each expert

    p_P = jnp.arange(P)
    expert_P = jnp.minimum(jnp.searchsorted(end_E, p_P, side="right"), num_experts - 1)
    offset_P = p_P - start_E[expert_P]
    valid_P = (p_P < end_E[-1]) & (offset_P < sizes_E[expert_P])
    sorted_P = jnp.where(valid_P, sorted_start_E[expert_P] + offset_P, 0)
    copy_P = jnp.where(valid_P, order_M[sorted_P], 0)

    # The padded row of each copy: its expert's first padded row + its rank within the expert.
    rank_M = jnp.zeros((M,), jnp.int32).at[order_M].set(jnp.arange(M, dtype=jnp.int32))
    expert_M = jnp.minimum(flat_M, num_experts - 1)
    row_M = jnp.where(active_M, start_E[expert_M] + rank_M - sorted_start_E[expert_M], P - 1)
    return BlockLayout(copy_P // K, valid_P, row_M.reshape(T, K), copy_P, sizes_E, start_E, padded_E)


# ---- into and out of a row layout: gathers whose transposes are gathers ----
#
# A row layout is described by index arrays: ``token_P`` (row -> its token), ``valid_P`` (row holds
# a copy), ``copy_P`` (row -> its copy, flattened as token * K + k) and ``row_TK`` (copy -> its row;
# inactive copies point at a row that is always zero). The dispatch layout above is one; the
# expert-parallel send buffers (a token's K "copies" being its destination devices) are another.


@jax.custom_vjp
def gather_rows(x_TD: jax.Array, token_P: jax.Array, valid_P: jax.Array, row_TK: jax.Array) -> jax.Array:
    """[T, D] tokens -> [P, D] rows (zero where not valid)."""
    return jnp.where(valid_P[:, None], x_TD[token_P], 0)


def _gather_rows_fwd(x_TD, token_P, valid_P, row_TK):
    return gather_rows(x_TD, token_P, valid_P, row_TK), (token_P, valid_P, row_TK)


def _gather_rows_bwd(residuals, dxp_PD):
    token_P, valid_P, row_TK = residuals
    return dxp_PD[row_TK].sum(axis=1), None, None, None  # sum over each token's K copies


gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


@jax.custom_vjp
def gather_copies(yp_PD: jax.Array, copy_P: jax.Array, valid_P: jax.Array, row_TK: jax.Array) -> jax.Array:
    """[P, D] rows -> [T, K, D] each token's K copies (zero for inactive copies)."""
    return yp_PD[row_TK]


def _gather_copies_fwd(yp_PD, copy_P, valid_P, row_TK):
    return gather_copies(yp_PD, copy_P, valid_P, row_TK), (copy_P, valid_P, row_TK)


def _gather_copies_bwd(residuals, dy_TKD):
    copy_P, valid_P, row_TK = residuals
    T, K, D = dy_TKD.shape
    return jnp.where(valid_P[:, None], dy_TKD.reshape(T * K, D)[copy_P], 0), None, None, None


gather_copies.defvjp(_gather_copies_fwd, _gather_copies_bwd)


def to_blocks(x_TD: jax.Array, layout: BlockLayout) -> jax.Array:
    """[T, D] tokens -> [P, D] padded rows (each token appears once per chosen expert)."""
    return gather_rows(x_TD, layout.token_P, layout.valid_P, layout.row_TK)


def from_blocks(yp_PD: jax.Array, layout: BlockLayout) -> jax.Array:
    """[P, D] padded rows -> [T, K, D] each token's K expert outputs."""
    return gather_copies(yp_PD, layout.copy_P, layout.valid_P, layout.row_TK)


def combine(y_TKD: jax.Array, weights_TK: jax.Array) -> jax.Array:
    """Each token's K expert outputs summed with its router weights: [T, K, D] -> [T, D]."""
    return jnp.einsum("tkd,tk->td", y_TKD, weights_TK.astype(y_TKD.dtype))
