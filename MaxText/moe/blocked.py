"""Block-wise grouped SwiGLU: the portable dropless backend (the CPU default).

XLA:CPU runs a dense [B, D] @ [D, F] matmul at plain-matmul speed once B is a few hundred rows,
but ``ragged_dot`` is expanded over every expert (docs/LOG.md). So each expert's rows are cut
into blocks and a loop runs one expert MLP per block, ``y_b = (silu(x_b W0_e) * (x_b W1_e)) Wo_e``.

Block sizes: big blocks are fast, but padding each expert to a multiple of a big block wastes
about half a block per expert. So the blocks come in levels that halve, ``moe_block_rows`` down
to ``moe_min_block_rows``: each expert takes as many top-level blocks as fit, then at most one
block of each smaller level (the binary digits of its remainder), and pads only to the smallest
block. Most rows run in big blocks, and padding stays under one small block per expert. One loop
per level, with a dynamic trip count: unused block slots cost nothing.

Keeping the SwiGLU inside the loop reads each block's rows once and keeps its hidden activations
in cache, instead of three passes over all rows. The VJP is written out and is one loop per level
too: per block, the data gradient goes through the transposed weights and the three weight
gradients accumulate ``x_b^T g_b`` into the block's expert slot, in float32.

Shape legend: E experts, P padded rows, NB block slots of a level, D model dim, F expert hidden dim.
"""

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp


class Blocks(NamedTuple):
    """The blocks of one level: block i covers padded rows [start[i], start[i] + rows)."""

    start_NB: jax.Array
    expert_NB: jax.Array
    count: jax.Array  # blocks [0, count) are real; the rest are unused slots


def level_rows(block_rows: int, min_block_rows: int) -> tuple[int, ...]:
    """Block sizes from ``block_rows`` halving down to ``min_block_rows``."""
    levels = [block_rows]
    while levels[-1] > min_block_rows:
        levels.append(levels[-1] // 2)
    return tuple(levels)


def expert_blocks(start_E: jax.Array, padded_E: jax.Array, rows: tuple[int, ...], num_rows: int) -> tuple[Blocks, ...]:
    """Each expert's padded rows (a multiple of ``rows[-1]``) cut into blocks of every level."""
    E = start_E.shape[0]
    done_E = jnp.zeros_like(padded_E)
    levels = []
    for level, B in enumerate(rows):
        n_E = (padded_E - done_E) // B  # top level: as many as fit; below: 0 or 1 (a binary digit)
        slots = num_rows // B if level == 0 else min(num_rows // B, E * (rows[level - 1] // B - 1))
        end_E = jnp.cumsum(n_E)
        i_NB = jnp.arange(max(slots, 1))
        expert_NB = jnp.minimum(jnp.searchsorted(end_E, i_NB, side="right"), E - 1)
        first_block_E = end_E - n_E
        start_NB = start_E[expert_NB] + done_E[expert_NB] + (i_NB - first_block_E[expert_NB]) * B
        levels.append(Blocks(start_NB, expert_NB, end_E[-1]))
        done_E = done_E + n_E * B
    return tuple(levels)


def _read(a_PX: jax.Array, start: jax.Array, rows: int) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(a_PX, start, rows)


def _write(a_PX: jax.Array, value: jax.Array, start: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(a_PX, value.astype(a_PX.dtype), start, 0)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def blocked_swiglu(
    rows: tuple[int, ...], xp_PD: jax.Array, wi_0: jax.Array, wi_1: jax.Array, wo: jax.Array, blocks: tuple[Blocks, ...]
) -> jax.Array:
    """Every block's rows through its expert's SwiGLU MLP: [P, D] -> [P, D]; rows outside every
    block (padding) give zeros. ``rows[l]`` is the block size of level ``blocks[l]``."""
    return _blocked_swiglu_fwd(rows, xp_PD, wi_0, wi_1, wo, blocks)[0]


def _blocked_swiglu_fwd(rows, xp_PD, wi_0, wi_1, wo, blocks):
    P, F = xp_PD.shape[0], wi_0.shape[-1]
    outputs = (jnp.zeros_like(xp_PD), jnp.zeros((P, F), xp_PD.dtype), jnp.zeros((P, F), xp_PD.dtype))
    for B, level in zip(rows, blocks, strict=True):

        def one_block(i, outputs, B=B, level=level):
            y, gate, up = outputs
            start, e = level.start_NB[i], level.expert_NB[i]
            x = _read(xp_PD, start, B)
            gate_b, up_b = x @ wi_0[e], x @ wi_1[e]
            y_b = (jax.nn.silu(gate_b) * up_b) @ wo[e]
            return _write(y, y_b, start), _write(gate, gate_b, start), _write(up, up_b, start)

        outputs = jax.lax.fori_loop(0, level.count, one_block, outputs)
    y, gate, up = outputs
    return y, (xp_PD, wi_0, wi_1, wo, blocks, gate, up)


def _blocked_swiglu_bwd(rows, residuals, dy_PD):
    xp_PD, wi_0, wi_1, wo, blocks, gate, up = residuals
    grads = (jnp.zeros_like(xp_PD), *(jnp.zeros(w.shape, jnp.float32) for w in (wi_0, wi_1, wo)))
    for B, level in zip(rows, blocks, strict=True):

        def one_block(i, grads, B=B, level=level):
            dx, dw0, dw1, dwo = grads
            start, e = level.start_NB[i], level.expert_NB[i]
            x, g, gate_b, up_b = (_read(a, start, B) for a in (xp_PD, dy_PD, gate, up))
            sig = jax.nn.sigmoid(gate_b)
            act = gate_b * sig  # silu(gate)
            dh = g @ wo[e].T
            d_up = dh * act
            d_gate = dh * up_b * sig * (1 + gate_b * (1 - sig))  # silu'(a) = sig(a) (1 + a (1 - sig(a)))
            dx = _write(dx, d_gate @ wi_0[e].T + d_up @ wi_1[e].T, start)
            f32 = jnp.float32
            dwo = dwo.at[e].add(jnp.matmul((act * up_b).T, g, preferred_element_type=f32))
            dw0 = dw0.at[e].add(jnp.matmul(x.T, d_gate, preferred_element_type=f32))
            dw1 = dw1.at[e].add(jnp.matmul(x.T, d_up, preferred_element_type=f32))
            return dx, dw0, dw1, dwo

        grads = jax.lax.fori_loop(0, level.count, one_block, grads)
    dx, dw0, dw1, dwo = grads
    no_grad = jax.tree.map(lambda _: None, blocks)
    return dx, dw0.astype(wi_0.dtype), dw1.astype(wi_1.dtype), dwo.astype(wo.dtype), no_grad


blocked_swiglu.defvjp(_blocked_swiglu_fwd, _blocked_swiglu_bwd)
