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

from MaxText.quantization.matmul import fp8_gemm, mx_gemm, mx_operand
from MaxText.quantization.quantize import Recipe, fake_quantize


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


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def blocked_swiglu(
    rows: tuple[int, ...],
    recipe: Recipe | None,
    xp_PD: jax.Array,
    wi_0: jax.Array,
    wi_1: jax.Array,
    wo: jax.Array,
    blocks: tuple[Blocks, ...],
) -> jax.Array:
    """Every block's rows through its expert's SwiGLU MLP: [P, D] -> [P, D]; rows outside every
    block (padding) give zeros. ``rows[l]`` is the block size of level ``blocks[l]``. With an FP8
    ``recipe`` each of the nine GEMMs (three forward, three input- and three weight-gradient)
    takes FP8 operands quantized along its own contraction dimension (``quantization/matmul.py``):
    the weights once per layer and direction, the activations and gradients per block (the
    weight gradients' tiles run along the block's rows, its tokens)."""
    return _blocked_swiglu_fwd(rows, recipe, xp_PD, wi_0, wi_1, wo, blocks)[0]


def _emulated(recipe: Recipe | None) -> Recipe | None:
    """The recipe when its GEMMs are emulated here (operands fake-quantized up front), else None
    (no recipe, or cuDNN's GEMMs, which quantize their own operands: ``_mm``)."""
    return recipe if recipe is not None and recipe.gemm == "emulate" else None


def _weights(recipe: Recipe | None, wi_0, wi_1, wo, direction: str):
    """The expert stacks [E, in, out] as the forward (contracting ``in``) or the input gradient
    (contracting ``out``) multiplies them, quantized once per layer and direction: dequantized
    (emulation), or cuDNN's operands laid out [E, rows, K] (``_mm`` takes them as they are)."""
    if recipe is not None and recipe.gemm == "cudnn":
        laid_out = (w.swapaxes(1, 2) for w in (wi_0, wi_1, wo)) if direction == "forward" else (wi_0, wi_1, wo)
        return tuple(mx_operand(w, recipe) for w in laid_out)
    recipe = _emulated(recipe)
    contracted = 1 if direction == "forward" else 2
    axis = (1, 2) if recipe is not None and recipe.weight_blocks_2d else contracted
    return tuple(fake_quantize(w, recipe, axis) for w in (wi_0, wi_1, wo))


def _transposed(w, recipe: Recipe | None):
    """A dequantized weight transposed for the input gradient; cuDNN's operand as it is (laid
    out for it already)."""
    return w if recipe is not None and recipe.gemm == "cudnn" else w.T


def _expert(w, e):
    """Expert ``e`` of a stack of either form."""
    return jax.tree.map(lambda t: t[e], w)


def _mm(a, b, recipe: Recipe | None, dtype) -> jax.Array:
    """``a @ b`` of a block; with a recipe as an FP8 GEMM, given in ``dtype`` (emulated: the
    float32 GEMM of the operands, dequantized up front; cuDNN: quantized here, along K)."""
    if recipe is None:
        return a @ b
    if recipe.gemm == "cudnn":  # b: the weight's operand, [rows, K]
        return mx_gemm(a, b, recipe, dtype)
    return fp8_gemm(a, b, dtype)


def _weight_grad(a_BI: jax.Array, g_BO: jax.Array, recipe: Recipe | None) -> jax.Array:
    """``a^T g`` in float32: a weight gradient, contracting the block's rows (b x 1 tiles with a
    recipe)."""
    if recipe is None:
        return jnp.matmul(a_BI.T, g_BO, preferred_element_type=jnp.float32)
    if recipe.gemm == "cudnn":
        return mx_gemm(a_BI.T, g_BO.T, recipe)
    return fp8_gemm(fake_quantize(a_BI, recipe, 0).T, fake_quantize(g_BO, recipe, 0))


def _blocked_swiglu_fwd(rows, recipe, xp_PD, wi_0, wi_1, wo, blocks):
    P, F = xp_PD.shape[0], wi_0.shape[-1]
    w0, w1, w2 = _weights(recipe, wi_0, wi_1, wo, "forward")
    xq_PD = fake_quantize(xp_PD, _emulated(recipe), 1)  # 1 x b tiles along D: the same per block or whole
    dtype = xp_PD.dtype
    outputs = (jnp.zeros_like(xp_PD), jnp.zeros((P, F), xp_PD.dtype), jnp.zeros((P, F), xp_PD.dtype))
    for B, level in zip(rows, blocks, strict=True):

        def one_block(i, outputs, B=B, level=level):
            y, gate, up = outputs
            start, e = level.start_NB[i], level.expert_NB[i]
            x = _read(xq_PD, start, B)
            gate_b, up_b = _mm(x, _expert(w0, e), recipe, dtype), _mm(x, _expert(w1, e), recipe, dtype)
            h_b = jax.nn.silu(gate_b) * up_b
            y_b = _mm(fake_quantize(h_b, _emulated(recipe), 1), _expert(w2, e), recipe, dtype)
            return _write(y, y_b, start), _write(gate, gate_b, start), _write(up, up_b, start)

        outputs = jax.lax.fori_loop(0, level.count, one_block, outputs)
    y, gate, up = outputs
    return y, (xp_PD, wi_0, wi_1, wo, blocks, gate, up)


def _blocked_swiglu_bwd(rows, recipe, residuals, dy_PD):
    xp_PD, wi_0, wi_1, wo, blocks, gate, up = residuals
    w0, w1, w2 = _weights(recipe, wi_0, wi_1, wo, "backward")
    gq_PD = fake_quantize(dy_PD, _emulated(recipe), 1)  # along D, for the input gradient through wo
    dtype = xp_PD.dtype
    grads = (jnp.zeros_like(xp_PD), *(jnp.zeros(w.shape, jnp.float32) for w in (wi_0, wi_1, wo)))
    for B, level in zip(rows, blocks, strict=True):

        def one_block(i, grads, B=B, level=level):
            dx, dw0, dw1, dwo = grads
            start, e = level.start_NB[i], level.expert_NB[i]
            x, g, gate_b, up_b = (_read(a, start, B) for a in (xp_PD, dy_PD, gate, up))
            sig = jax.nn.sigmoid(gate_b)
            act = gate_b * sig  # silu(gate)
            dh = _mm(_read(gq_PD, start, B), _transposed(_expert(w2, e), recipe), recipe, dtype)
            d_up = dh * act
            d_gate = dh * up_b * sig * (1 + gate_b * (1 - sig))  # silu'(a) = sig(a) (1 + a (1 - sig(a)))
            rowwise = partial(fake_quantize, recipe=_emulated(recipe), axis=1)
            dx_b = _mm(rowwise(d_gate), _transposed(_expert(w0, e), recipe), recipe, dtype)
            dx_b += _mm(rowwise(d_up), _transposed(_expert(w1, e), recipe), recipe, dtype)
            dx = _write(dx, dx_b, start)
            h_b = act * up_b
            dwo = dwo.at[e].add(_weight_grad(h_b, g, recipe))
            dw0 = dw0.at[e].add(_weight_grad(x, d_gate, recipe))
            dw1 = dw1.at[e].add(_weight_grad(x, d_up, recipe))
            return dx, dw0, dw1, dwo

        grads = jax.lax.fori_loop(0, level.count, one_block, grads)
    dx, dw0, dw1, dwo = grads
    no_grad = jax.tree.map(lambda _: None, blocks)
    return dx, dw0.astype(wi_0.dtype), dw1.astype(wi_1.dtype), dwo.astype(wo.dtype), no_grad


blocked_swiglu.defvjp(_blocked_swiglu_fwd, _blocked_swiglu_bwd)
