"""FP8 expert dispatch: the routed experts' input travels as E4M3 values and their scales.

DeepSeek-V3 quantizes the tokens before the dispatch all-to-all (report 3.3.2): 1 byte per
element plus one scale per block (4 bytes per 128 for ``fp8_blockwise``, 1 byte per 32 for
``mxfp8``), about 0.52x the bytes of bfloat16. The rows are quantized row-wise (blocks along the
model dim, what the experts' first GEMMs contract), moved by the exchange as they are (values as
their bytes), and dequantized to the activation dtype on arrival, where the grouped GEMMs
quantize their operands as every FP8 GEMM does (for ``mxfp8`` re-quantizing a dequantized row
gives it back exactly: its scales are powers of two). Every path through the routed experts
does the same, with or without an exchange, so expert parallelism changes no number.

The gradient is straight-through and stays in the activation dtype: it travels back through
the exchange's transpose (the combine of the backward pass, in bfloat16 as in the report).
"""

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp

from MaxText.quantization.quantize import FP8, Recipe, dequantize, quantize

# A row movement: rows [T, ...] -> rows [R, ...] on their destination, linear in its first
# argument, the same for any dtype (the indices and sizes it needs come in ``aux``).
Move = Callable[..., jax.Array]


def _stay(x: jax.Array) -> jax.Array:
    return x


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def fp8_moved(move: Move, recipe: Recipe, x_TD: jax.Array, aux: tuple = ()) -> jax.Array:
    """``move(x, *aux)``, with x sent as FP8 values and scales and dequantized on arrival to x's
    dtype. ``move`` None: no movement (the quantization alone, as the same tokens would arrive)."""
    move = move or _stay
    values, scales = quantize(x_TD, recipe, axis=-1)
    bytes_TD = jax.lax.bitcast_convert_type(values, jnp.uint8)  # collectives carry bytes everywhere
    moved = jax.lax.bitcast_convert_type(move(bytes_TD, *aux), FP8)
    return dequantize(moved, move(scales, *aux), recipe, axis=-1).astype(x_TD.dtype)


def _fp8_moved_fwd(move, recipe, x_TD, aux):
    return fp8_moved(move, recipe, x_TD, aux), (x_TD, aux)


def _fp8_moved_bwd(move, recipe, residuals, g_RD):
    x_TD, aux = residuals
    move = move or _stay
    _, transpose = jax.vjp(lambda a: move(a, *aux), jnp.zeros_like(x_TD))
    return transpose(g_RD.astype(x_TD.dtype))[0], None


fp8_moved.defvjp(_fp8_moved_fwd, _fp8_moved_bwd)


def dispatch_bytes_per_element(recipe: Recipe | None, dtype_bytes: int) -> float:
    """Bytes the dispatch moves per element of a token: the activation dtype's, or one FP8 byte
    plus its share of a scale (float32 per block for blockwise, one E8M0 byte for MX)."""
    if recipe is None:
        return float(dtype_bytes)
    return 1.0 + (1.0 if recipe.power_of_two_scales else 4.0) / recipe.block
