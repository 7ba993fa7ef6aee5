"""FP8 block quantizers: the one implementation every FP8 GEMM, the FP8 dispatch and the tests use.

Two recipes (``quantization`` in base.yml), both E4M3 elements (largest finite 448):

- ``fp8_blockwise`` (DeepSeek-V3 report, section 3.3): one float32 multiplier per block,
  ``scale = amax / 448`` from the current tensor (no history), ``x ~ values * scale``. Blocks are
  ``1 x fp8_block`` tiles along a GEMM's contraction dimension for activations and gradients, and
  ``fp8_block x fp8_block`` tiles for weights (2-D blocks: ``axis`` is a pair). Values are
  ``x * (448 / amax)``, as DeepSeek's kernels compute them (not ``x / scale``: one rounding apart).
- ``mxfp8`` (OCP Microscaling, Blackwell tensor cores): blocks of ``mxfp8_block`` (32) along the
  contraction dimension, each with one E8M0 scale, a power of two stored as its biased exponent
  ``s`` (uint8, value ``2**(s - 127)``, 255 = NaN). ``mxfp8_scale_rule`` picks the exponent:
  ``ceil`` (what Transformer Engine, cuDNN and ``jax.nn.scaled_matmul`` do: ``ceil(log2(amax /
  448))``, so the block's largest value never exceeds 448) or ``floor`` (the OCP text:
  ``floor(log2(amax)) - 8``; blocks whose amax mantissa exceeds 1.75 then saturate at 448).

Every cast clips to +-448 first: casts to float8 do not saturate (past 448 they give NaN). An
all-zero block takes scale 1 (blockwise) or the smallest exponent, s = 0 (MX, as JAX does); a
blockwise scale never goes below float32's normal range (``BLOCKWISE_MIN_AMAX``); NaN
or Inf in a block makes the whole block NaN after dequantization, so the step's non-finite
checks still see it. A dimension that is not a multiple of the block is padded with zeros inside
(the last block is partial); scales have ``ceil(n / block)`` entries along each blocked axis.

Shape legend: blocks along ``axis`` (an int, or a pair for 2-D blocks); every other axis as given.
"""

from dataclasses import dataclass
from typing import Literal

import jax
import jax.numpy as jnp

from MaxText.parallel.platform import GPU_PLATFORMS, trace_platform

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite E4M3 value
E4M3_EMAX = 8  # 448 = 1.75 * 2**8: the OCP rule's exponent offset
E8M0_BIAS, E8M0_NAN = 127, 255
# The smallest amax a blockwise scale is computed from: its scale, amax / 448, is then float32's
# smallest normal (2**-126) and 448 / amax is finite. Blocks below it (every element under
# 5.3e-36) quantize with that scale, their values subnormal E4M3 or zero.
BLOCKWISE_MIN_AMAX = FP8_MAX * 2.0**-126


@dataclass(frozen=True)
class Recipe:
    """How one FP8 recipe lays its blocks and computes its scales."""

    name: Literal["fp8_blockwise", "mxfp8"]
    block: int  # block length along a contraction dimension (and the side of a 2-D weight block)
    scale_rule: Literal["ceil", "floor"] = "ceil"  # mxfp8 only
    gemm: Literal["emulate", "cudnn"] = "emulate"  # how the GEMMs run (``fp8_gemm``; matmul.py)
    operands: Literal["float32", "bfloat16"] = "float32"  # emulated GEMMs' operand dtype (operand_dtype)

    @property
    def power_of_two_scales(self) -> bool:
        return self.name == "mxfp8"

    @property
    def weight_blocks_2d(self) -> bool:
        """Blockwise weights take square blocks, one copy for the forward and the input gradient;
        MX weights take 1-D blocks along each GEMM's own contraction dimension (two copies)."""
        return self.name == "fp8_blockwise"


def recipe_of(config, platform: str | None = None) -> Recipe | None:
    """The recipe ``quantization`` names (None for ``none``), with its block sizes and the GEMM
    implementation ``fp8_gemm`` resolves to on ``platform`` (default: the one traced for)."""
    if config.quantization == "none":
        return None
    platform = platform or trace_platform()
    gemm = resolve_fp8_gemm(config, platform)
    if config.quantization == "fp8_blockwise":
        return Recipe("fp8_blockwise", config.fp8_block, gemm=gemm)
    # On a GPU MX operands go to the GEMM as bfloat16 (exact, at the tensor cores' bfloat16
    # rate); on CPU as float32, where XLA's bfloat16 dot sums in another order.
    operands = "bfloat16" if platform in GPU_PLATFORMS else "float32"
    return Recipe("mxfp8", config.mxfp8_block, config.mxfp8_scale_rule, gemm, operands)


MX_GEMM_COMPUTE_CAPABILITY = (10, 0)  # block-scaled (MX) tensor-core GEMMs: Blackwell and later


def check_quantization(config, platform: str, compute_capability: tuple[int, int] | None = None) -> None:
    """Fail early, naming the key, when the FP8 GEMMs asked for cannot run on ``platform`` (and,
    for a GPU, its ``compute_capability``: Hopper has FP8 tensor cores but no MX scaling)."""
    from MaxText.config import ConfigError

    if config.quantization == "none" or resolve_fp8_gemm(config, platform) != "cudnn":
        return
    if platform not in GPU_PLATFORMS:
        raise ConfigError(
            f"config key 'fp8_gemm': cudnn (cuDNN's block-scaled GEMM) runs on GPU only, not on {platform}; "
            "choose emulate or auto"
        )
    if compute_capability is not None and compute_capability < MX_GEMM_COMPUTE_CAPABILITY:
        have, need = (".".join(map(str, c)) for c in (compute_capability, MX_GEMM_COMPUTE_CAPABILITY))
        raise ConfigError(
            f"config key 'fp8_gemm': cudnn (cuDNN's MX block-scaled GEMM) needs a GPU of compute capability "
            f"{need} or later (Blackwell), this one is {have}; choose emulate or auto"
        )


def gpu_compute_capability(device) -> tuple[int, int] | None:
    """A JAX GPU device's compute capability, e.g. (9, 0); None off GPU."""
    if device.platform not in GPU_PLATFORMS:
        return None
    major, minor = str(getattr(device, "compute_capability", "0.0")).split(".")
    return int(major), int(minor)


def resolve_fp8_gemm(config, platform: str | None = None) -> str:
    """``fp8_gemm: auto`` is emulation everywhere for now: cuDNN's block-scaled GEMM (``cudnn``,
    opt-in) compiles for the 671B recipes (each device's own GEMMs, matmul.per_device) but has
    never run on a Blackwell GPU, the only kind that has it."""
    del platform
    return "emulate" if config.fp8_gemm == "auto" else config.fp8_gemm


def _axes(x: jax.Array, axis: int | tuple[int, ...]) -> tuple[int, ...]:
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    return tuple(sorted(a % x.ndim for a in axes))


def _to_blocks(x: jax.Array, axes: tuple[int, ...], block: int) -> tuple[jax.Array, tuple[int, ...]]:
    """x padded with zeros along ``axes`` to whole blocks, each such axis split into
    (blocks, block); returns it and the positions of the within-block axes."""
    pads = [(0, -n % block if d in axes else 0) for d, n in enumerate(x.shape)]
    padded = jnp.pad(x, pads)
    shape, inner = [], []
    for d, n in enumerate(padded.shape):
        if d in axes:
            shape += [n // block, block]
            inner.append(len(shape) - 1)
        else:
            shape.append(n)
    return padded.reshape(shape), tuple(inner)


def _from_blocks(xb: jax.Array, shape: tuple[int, ...], axes: tuple[int, ...]) -> jax.Array:
    """Undo ``_to_blocks``: merge each (blocks, block) pair and drop the padding."""
    merged = []
    d = 0
    for a in range(len(shape)):
        merged.append(xb.shape[d] * xb.shape[d + 1] if a in axes else xb.shape[d])
        d += 2 if a in axes else 1
    return xb.reshape(merged)[tuple(slice(0, n) for n in shape)]


def _divided_by_fp8_max(amax: jax.Array) -> jax.Array:
    """``amax / 448`` rounded once, as written: XLA rewrites a division by a constant (or by a
    broadcast scalar) into a multiplication by its rounded reciprocal, one ulp off on some
    blocks and across a power of two where amax is 448 times one; so the divisor is an opaque
    array of amax's shape."""
    return amax / jax.lax.optimization_barrier(jnp.full(amax.shape, FP8_MAX, jnp.float32))


def _mx_exponent(amax: jax.Array, rule: str) -> jax.Array:
    """The E8M0 biased exponent of a block with this amax (float32): ``ceil(log2(amax / 448))``
    or ``floor(log2(amax)) - 8``, clamped to [-127, 127]; 0 for all-zero blocks (2**-127), 255
    (NaN) for NaN or Inf. Both from amax's exact exponent (frexp: amax = m * 2**p, m in [0.5,
    1)) with no division: 448 = 0.875 * 2**9, so amax / 448 = (m / 0.875) * 2**(p - 9), whose
    ceil-log2 is p - 9, plus one where m > 0.875. (Dividing first would round, and on XLA:CPU
    flush a quotient under 2**-126 to zero.)"""
    m, p = jnp.frexp(amax)
    exponent = p - 9 + (m > 0.875) if rule == "ceil" else p - 1 - E4M3_EMAX
    biased = jnp.clip(exponent + E8M0_BIAS, 0, 2 * E8M0_BIAS)
    biased = jnp.where(amax == 0, 0, biased)
    return jnp.where(jnp.isfinite(amax), biased, E8M0_NAN).astype(jnp.uint8)


def mx_scale_value(biased: jax.Array) -> jax.Array:
    """``2**(s - 127)`` as float32 (NaN for s = 255); s = 0 gives float32's subnormal 2**-127,
    which XLA:CPU flushes to zero (``dequantize`` multiplies by it in two steps)."""
    value = jnp.ldexp(jnp.ones(biased.shape, jnp.float32), biased.astype(jnp.int32) - E8M0_BIAS)
    return jnp.where(biased == E8M0_NAN, jnp.nan, value)


def quantize(x: jax.Array, recipe: Recipe, axis: int | tuple[int, int]) -> tuple[jax.Array, jax.Array]:
    """``x`` in blocks along ``axis`` -> (values float8_e4m3fn with x's shape, scales): float32
    multipliers (blockwise) or E8M0 biased exponents as uint8 (mxfp8), one per block."""
    axes = _axes(x, axis)
    if len(axes) > 1 and not recipe.weight_blocks_2d:
        raise ValueError(f"{recipe.name} scales 1-D blocks along one contraction dimension, got axes {axes}")
    xb, inner = _to_blocks(x.astype(jnp.float32), axes, recipe.block)
    amax = jnp.max(jnp.abs(xb), axis=inner, keepdims=True)  # NaN propagates
    if recipe.power_of_two_scales:
        scales = _mx_exponent(amax, recipe.scale_rule)
        # Multiplying by 2**-e is exact and never divides by a subnormal.
        inverse = jnp.ldexp(jnp.ones(scales.shape, jnp.float32), E8M0_BIAS - scales.astype(jnp.int32))
        scaled = xb * jnp.where(scales == E8M0_NAN, jnp.nan, inverse)
    else:
        # DeepSeek's kernels multiply by 448 / amax rather than divide by the scale. An amax
        # under BLOCKWISE_MIN_AMAX is raised to it, so that neither 448 / amax overflows (x * inf
        # would make the block's zeros NaN) nor the scale falls below float32's normal range.
        floored = jnp.maximum(amax, BLOCKWISE_MIN_AMAX)  # NaN stays NaN
        scales = jnp.where(amax == 0, 1.0, _divided_by_fp8_max(floored))
        scaled = xb * jnp.where(amax == 0, 1.0, FP8_MAX / floored)
    values = jnp.clip(scaled, -FP8_MAX, FP8_MAX).astype(FP8)
    return _from_blocks(values, x.shape, axes), jnp.squeeze(scales, inner)


def dequantize(values: jax.Array, scales: jax.Array, recipe: Recipe, axis: int | tuple[int, int]) -> jax.Array:
    """``values * scale`` block by block, in float32, with ``values``' shape."""
    axes = _axes(values, axis)
    vb, inner = _to_blocks(values.astype(jnp.float32), axes, recipe.block)
    if recipe.power_of_two_scales:  # s = 0: 2**-126 then 1/2, no subnormal multiplier
        smallest = jnp.expand_dims(scales == 0, inner)
        multiplier = jnp.expand_dims(mx_scale_value(jnp.maximum(scales, 1)), inner)
        dequantized = vb * multiplier * jnp.where(smallest, 0.5, 1.0)
    else:
        dequantized = vb * jnp.expand_dims(scales.astype(jnp.float32), inner)
    return _from_blocks(dequantized, values.shape, axes)


def operand_dtype(recipe: Recipe) -> jnp.dtype:
    """The dtype emulated GEMMs take their dequantized operands in (``recipe.operands``). Both
    hold every value exactly where they are allowed: bfloat16 only for MX (an E4M3 value, 4
    significant bits, times a power of two: bfloat16 has 8 bits and float32's exponent range),
    float32 always (blockwise's float32 scales add 24 bits). A GEMM of bfloat16 operands with
    float32 accumulation is the float32 GEMM of the same values, up to the order of the sums, at
    a GPU's bfloat16 tensor-core rate."""
    if recipe.operands == "bfloat16" and not recipe.power_of_two_scales:
        raise ValueError(f"{recipe.name} values are not exact in bfloat16")
    return jnp.dtype(recipe.operands)


def fake_quantize(x: jax.Array, recipe: Recipe | None, axis: int | tuple[int, int]) -> jax.Array:
    """``dequantize(quantize(x))`` in ``operand_dtype``: the operand an FP8 GEMM really
    multiplies (x itself when ``recipe`` is None). No gradient flows through it: the GEMMs' VJPs
    are written out."""
    if recipe is None:
        return x
    return dequantize(*quantize(x, recipe, axis), recipe, axis).astype(operand_dtype(recipe))
