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

from collections.abc import Callable
from functools import partial
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


def num_padded_rows(num_rows: int, num_experts: int, row_multiple: int, total_multiple: int = 1) -> int:
    """Static number of rows that holds any routing: each expert pads fewer than ``row_multiple``
    rows, plus one row that always stays zero (where inactive copies point); the total rounded up
    to a multiple of ``total_multiple`` (a kernel's row tile)."""
    used = num_rows + num_experts * (row_multiple - 1)
    rows = (used // row_multiple + 1) * row_multiple
    return -(-rows // total_multiple) * total_multiple


class SortedCopies(NamedTuple):
    """The copies in expert order, computed once however many layout passes read them."""

    flat_M: jax.Array  # each copy's expert (num_experts for inactive copies, which sort last)
    order_M: jax.Array  # sorted position -> (token, slot) copy
    rank_M: jax.Array  # (token, slot) copy -> its sorted position
    sizes_E: jax.Array  # active copies per expert


def sort_copies(experts_TK: jax.Array, num_experts: int, active_TK: jax.Array | None = None) -> SortedCopies:
    M = experts_TK.size
    active_M = jnp.ones((M,), bool) if active_TK is None else active_TK.reshape(M)
    flat_M = jnp.where(active_M, experts_TK.reshape(M), num_experts)
    order_M = jnp.argsort(flat_M, stable=True)
    rank_M = jnp.zeros((M,), jnp.int32).at[order_M].set(jnp.arange(M, dtype=jnp.int32))
    sizes_E = jnp.zeros((num_experts + 1,), jnp.int32).at[flat_M].add(1)[:num_experts]
    return SortedCopies(flat_M, order_M, rank_M, sizes_E)


def block_layout(
    experts_TK: jax.Array,
    num_experts: int,
    row_multiple: int,
    active_TK: jax.Array | None = None,
    capacity: int | None = None,
    skip: jax.Array | int = 0,
    copies: SortedCopies | None = None,
    total_multiple: int = 1,
) -> BlockLayout:
    """The padded layout of the copies whose ``active_TK`` is true (all by default). Inactive
    copies (for example, routed to another device's experts) get no row: they read an
    always-zero row and contribute nothing.

    With ``capacity``, the layout has rows for that many copies only: those at positions
    ``[skip, skip + capacity)`` of the expert-sorted order; the others are left out like
    inactive ones (a later pass takes them with a larger ``skip``). Passes over the same copies
    share one ``sort_copies`` (``copies``)."""
    T, K = experts_TK.shape
    M, m = T * K, row_multiple
    window = M if capacity is None else min(M, capacity)
    P = num_padded_rows(window, num_experts, m, total_multiple)
    flat_M, order_M, rank_M, all_sizes_E = copies or sort_copies(experts_TK, num_experts, active_TK)
    all_start_E = jnp.cumsum(all_sizes_E) - all_sizes_E  # first sorted position of each expert
    # The window [skip, skip + window) of sorted positions, expert by expert.
    first_E = jnp.clip(skip - all_start_E, 0, all_sizes_E)
    sizes_E = jnp.clip(skip + window - all_start_E, 0, all_sizes_E) - first_E
    sorted_start_E = all_start_E + first_E  # first sorted position of each expert's rows here
    padded_E = (sizes_E + m - 1) // m * m
    end_E = jnp.cumsum(padded_E)
    start_E = end_E - padded_E

    p_P = jnp.arange(P)
    expert_P = jnp.minimum(jnp.searchsorted(end_E, p_P, side="right"), num_experts - 1)
    offset_P = p_P - start_E[expert_P]
    valid_P = (p_P < end_E[-1]) & (offset_P < sizes_E[expert_P])
    sorted_P = jnp.where(valid_P, sorted_start_E[expert_P] + offset_P, 0)
    copy_P = jnp.where(valid_P, order_M[sorted_P], 0)

    # The padded row of each copy here: its expert's first padded row + its rank within the expert.
    here_M = (flat_M < num_experts) & (rank_M >= skip) & (rank_M < skip + window)
    expert_M = jnp.minimum(flat_M, num_experts - 1)
    row_M = jnp.where(here_M, start_E[expert_M] + rank_M - sorted_start_E[expert_M], P - 1)
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
    return _sum_rows_at(dxp_PD, row_TK), None, None, None  # sum over each token's K copies


gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


def _sum_rows_at(a_PD: jax.Array, row_TK: jax.Array) -> jax.Array:
    """``a_PD[row_TK].sum(axis=1)`` one slot at a time, so that no [T, K, D] array is formed."""
    total_TD = a_PD[row_TK[:, 0]]
    for k in range(1, row_TK.shape[1]):
        total_TD = total_TD + a_PD[row_TK[:, k]]
    return total_TD


@jax.custom_vjp
def sum_copies(yp_PD: jax.Array, copy_P: jax.Array, valid_P: jax.Array, row_TK: jax.Array) -> jax.Array:
    """[P, D] rows -> [T, D] the sum of each token's K copies (inactive copies read a zero row)."""
    return _sum_rows_at(yp_PD, row_TK)


def _sum_copies_fwd(yp_PD, copy_P, valid_P, row_TK):
    return sum_copies(yp_PD, copy_P, valid_P, row_TK), (copy_P, valid_P, row_TK)


def _sum_copies_bwd(residuals, dy_TD):
    copy_P, valid_P, row_TK = residuals
    K = row_TK.shape[1]
    return jnp.where(valid_P[:, None], dy_TD[copy_P // K], 0), None, None, None


sum_copies.defvjp(_sum_copies_fwd, _sum_copies_bwd)


def to_blocks(x_TD: jax.Array, layout: BlockLayout) -> jax.Array:
    """[T, D] tokens -> [P, D] padded rows (each token appears once per chosen expert)."""
    return gather_rows(x_TD, layout.token_P, layout.valid_P, layout.row_TK)


def row_weights(weights_TK: jax.Array, layout: BlockLayout) -> jax.Array:
    """[P] each row's router weight (0 on rows that hold no copy): the backends scale a row's
    hidden activations by it before the down-projection, so that summing the rows' outputs
    per token (``sum_copies``) is the weighted combine and no [T, K, D] array is formed."""
    return jnp.where(layout.valid_P, weights_TK.reshape(-1)[layout.copy_P], 0)


# One loop over the further rounds, or (True) each round its own ops. XLA:CPU's in-process
# collectives can race when devices fall out of step in a loop of collectives (a device enters
# the next iteration's rendezvous before another has left the last one, and the process aborts),
# so the CPU tests of the exchange unroll; unrolled, XLA:GPU holds more of the rounds' buffers at
# once (the 4-layer 671B on GB200: 41.6 GB of temp against 27.5), so the loop is what runs.
UNROLL_ROUNDS = False


def in_rounds(
    round_fn: Callable[[jax.Array | int], jax.Array],
    load: jax.Array,
    per_round: int,
    rounds: int,
    first: jax.Array | None = None,
):
    """``round_fn(0)`` (or ``first``, where the caller ran it) plus the further rounds
    ``1 .. rounds - 1`` that ``load`` items, taken ``per_round`` at a time, need. Buffers are
    sized for one round; nothing is dropped: an overflow costs time, not memory.

    The further rounds run in a loop of a fixed trip count, each under a ``lax.cond`` that skips
    it once the load is covered, and the whole loop under one that skips it when the first round
    holds everything: no loop waits on a data-dependent condition, and with XLA:GPU's command
    buffers (``CONDITIONAL``, ``WHILE``) the conditionals are decided on the device. Their VJP
    (``_further_rounds``) reruns each needed round in a loop of the same shape, so no round keeps
    residuals and none are stacked per iteration (which XLA would slice per iteration, keeping
    the backward loop out of a command buffer)."""
    y = round_fn(0) if first is None else first
    if rounds == 1:
        return y
    # The further rounds' function with every value it closes over made an input (the custom VJP
    # runs it outside this trace), traced once.
    closed = jax.make_jaxpr(round_fn)(jnp.int32(1))
    return y + _further_rounds(closed.jaxpr, per_round, rounds, load, *closed.consts)


def _round(jaxpr, r, *consts):
    """Round ``r`` of the traced round function, given the values it closed over."""
    return jax.core.eval_jaxpr(jaxpr, consts, r)[0]


def _for_needed_rounds(round_fn: Callable, zeros: Callable, load: jax.Array, per_round: int, rounds: int):
    """The sum of ``round_fn(r)`` over the rounds ``1 .. rounds - 1`` that ``load`` needs."""

    def body(r, total):
        needed = jax.lax.cond(r * per_round < load, round_fn, lambda _: zeros(), r)
        return jax.tree.map(jnp.add, total, needed)

    def all_rounds():
        return jax.lax.fori_loop(1, rounds, body, zeros(), unroll=UNROLL_ROUNDS)

    return jax.lax.cond(load > per_round, all_rounds, zeros)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _further_rounds(jaxpr, per_round: int, rounds: int, load: jax.Array, *consts) -> jax.Array:
    out = jaxpr.outvars[0].aval
    zeros = lambda: jnp.zeros(out.shape, out.dtype)  # noqa: E731
    return _for_needed_rounds(lambda r: _round(jaxpr, r, *consts), zeros, load, per_round, rounds)


def _further_rounds_fwd(jaxpr, per_round, rounds, load, *consts):
    return _further_rounds(jaxpr, per_round, rounds, load, *consts), (load, consts)


def _further_rounds_bwd(jaxpr, per_round, rounds, residuals, dy):
    """Each needed round's VJP, the round rerun inside it; integer inputs get no cotangent."""
    load, consts = residuals
    wrt = [i for i, c in enumerate(consts) if jnp.issubdtype(c.dtype, jnp.inexact)]

    def round_grads(r):
        def of_differentiable(*args):
            full = list(consts)
            for i, a in zip(wrt, args, strict=True):
                full[i] = a
            return _round(jaxpr, r, *full)

        return jax.vjp(of_differentiable, *(consts[i] for i in wrt))[1](dy)

    zeros = lambda: tuple(jnp.zeros_like(consts[i]) for i in wrt)  # noqa: E731
    grads = _for_needed_rounds(round_grads, zeros, load, per_round, rounds)
    by_index = dict(zip(wrt, grads, strict=True))
    return (None, *(by_index.get(i) for i in range(len(consts))))


_further_rounds.defvjp(_further_rounds_fwd, _further_rounds_bwd)


def combine(y_TKD: jax.Array, weights_TK: jax.Array) -> jax.Array:
    """Each token's K expert outputs summed with its router weights: [T, K, D] -> [T, D]."""
    return jnp.einsum("tkd,tk->td", y_TKD, weights_TK.astype(y_TKD.dtype))
