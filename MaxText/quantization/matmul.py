"""FP8 GEMMs with their gradients: forward, input gradient and weight gradient all take FP8
operands, each quantized along that GEMM's own contraction dimension.

For ``y = x @ w`` (x [M, K] activations, w [K, N] a weight, g = dL/dy; M the tokens):

    forward         y  = Q(x; along K)   @ W(w; along K)     1 x b tiles; weight blocks
    input gradient  dx = Q(g; along N)   @ W(w; along N)^T   1 x b tiles; weight blocks
    weight gradient dw = Q(x; along M)^T @ Q(g; along M)     b x 1 tiles: the tokens contract

``W`` is the weight's quantization: 2-D ``b x b`` blocks for ``fp8_blockwise`` (one copy serves
both GEMMs, as DeepSeek-V3 does), 1-D blocks along the contracted dimension for ``mxfp8`` (a
row-wise and a column-wise copy, each from the high-precision weight, as Transformer Engine
does). Every quantized copy is made from the high-precision tensor. The gradient is
straight-through: clipping at 448 passes gradients unchanged.

Execution (``fp8_gemm``, the recipe's ``gemm``):

- ``emulate``: ``fp8_gemm`` multiplies the dequantized operands, accumulating in float32
  throughout (the report promotes partial sums to float32 every 128 elements of K, tensor cores
  accumulate with a few bits less). The operands hold the dequantized values exactly: bfloat16
  for ``mxfp8`` (so on a GPU the GEMMs run at the bfloat16 tensor-core rate), float32 for
  ``fp8_blockwise`` (``precision=HIGHEST``). The exact FP8 numerics, on any platform; the path
  on CPU, for ``fp8_blockwise`` everywhere (cuDNN has no 2-D weight blocks), and the reference
  the fused kernels are checked against (``tools/gpu_check.sh``).
- ``cudnn`` (``mxfp8`` on a Blackwell GPU, opt-in): ``mx_gemm`` feeds the same quantizer's E4M3
  values and E8M0 scales to cuDNN's block-scaled GEMM (Blackwell tensor cores), on each device's
  own tokens (``per_device``). The tokens are flattened for it, so the weight gradient's tiles
  run along the flattened tokens (the same tiles as emulation's when the sequence is a multiple
  of the block).

Shape legend: M rows (tokens), L leading dims (the tokens unflattened), K contracted, N output
features.
"""

import math
from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from MaxText.parallel.sharding import batch_mesh_axes, spec_axes, stored_spec
from MaxText.quantization.quantize import Recipe, fake_quantize, quantize


def weight_axis(recipe: Recipe, contracted: int) -> int | tuple[int, int]:
    """How a 2-D weight [K, N] is blocked for a GEMM contracting its axis ``contracted``."""
    return (0, 1) if recipe.weight_blocks_2d else contracted


def fp8_gemm(a_MK: jax.Array, b_KN: jax.Array, out_dtype=jnp.float32) -> jax.Array:
    """The GEMM of two already-dequantized operands (emulation, ``fake_quantize``'s exact
    float32 or bfloat16 values), accumulated in float32 and given in ``out_dtype``.

    The result comes out of the GEMM in the dtype the caller keeps (rounded in its epilogue, as
    a bfloat16 GEMM's): a float32 result cast to bfloat16 afterwards is what XLA:GPU's excess-
    precision rewrites may keep in float32, and a weight gradient then crosses the FSDP
    reduce-scatter in float32 (2x the bytes; seen in the GB200 compile)."""
    return jnp.matmul(a_MK, b_KN, precision=jax.lax.Precision.HIGHEST, preferred_element_type=out_dtype)


def mx_operand(x_RK: jax.Array, recipe: Recipe) -> tuple[jax.Array, jax.Array]:
    """An operand for ``mx_gemm``, rows x K (leading dims allowed): ``quantize`` along K, padded
    with zeros to whole blocks, the scales as E8M0. Quantize a weight once per layer and direction
    and index it, not once per GEMM."""
    pad = -x_RK.shape[-1] % recipe.block
    if pad:
        x_RK = jnp.pad(x_RK, [(0, 0)] * (x_RK.ndim - 1) + [(0, pad)])
    values, scales = quantize(x_RK, recipe, -1)
    return values, jax.lax.bitcast_convert_type(scales, jnp.float8_e8m0fnu)


def mx_gemm(a_MK, b_NK, recipe: Recipe, out_dtype=jnp.float32) -> jax.Array:
    """``a @ b^T`` [M, N] by cuDNN's block-scaled GEMM (``jax.nn.scaled_matmul``, XLA's
    ``__op$block_scaled_dot``; GPU only), E4M3 values with E8M0 scales, accumulated in float32 and
    given in ``out_dtype`` (rounded in the GEMM's epilogue: a float32 result cast afterwards is a
    float32 buffer of every GEMM's output, 32 GB more per GPU in the GB200 recipe's compile). Each
    operand is an array (quantized here, ``mx_operand``) or an ``mx_operand`` already."""
    (a, sa), (b, sb) = (t if isinstance(t, tuple) else mx_operand(t, recipe) for t in (a_MK, b_NK))
    out = jax.nn.scaled_matmul(a[None], b[None], sa[None], sb[None], preferred_element_type=out_dtype)
    return out[0]


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def fp8_matmul(x_LK: jax.Array, w_KN: jax.Array, recipe: Recipe, w_spec: P | None = None) -> jax.Array:
    """``x @ w`` with FP8 operands in all three GEMMs; the result in x's dtype. x has one or more
    leading dims (``L``: tokens, e.g. batch and sequence, kept apart so that their sharding is
    untouched); the weight gradient contracts all of them, its tiles running along the last
    (consecutive tokens of a sequence: the flattened tokens' tiles when it is a multiple of the
    block). ``w_spec``: how the weight is stored across the mesh (``weight_spec``), where the
    ``cudnn`` GEMMs leave its gradient; None leaves that to XLA."""
    return _fp8_matmul_fwd(x_LK, w_KN, recipe, w_spec)[0]


def _tokens_contracted(a_LX: jax.Array, b_LY: jax.Array, out_dtype) -> jax.Array:
    """``sum over every leading dim of a[..., x] b[..., y]``, accumulated in float32: [X, Y]."""
    lead = tuple(range(a_LX.ndim - 1))
    dims = ((lead, lead), ((), ()))
    return jax.lax.dot_general(a_LX, b_LY, dims, precision=jax.lax.Precision.HIGHEST, preferred_element_type=out_dtype)


def token_split(x_LK: jax.Array) -> tuple[str, ...]:
    """The mesh axes x's leading (batch) dim is split over for ``per_device``: the rules' batch
    axes not already manual (inside a shard_map), as many as divide it."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    manual, axes, parts = set(mesh.manual_axes), [], 1
    for axis in batch_mesh_axes():
        if axis not in manual and x_LK.shape[0] % (parts * mesh.shape[axis]) == 0:
            axes.append(axis)
            parts *= mesh.shape[axis]
    return tuple(axes)


def weight_spec(logical_axes: Sequence[str | None], shape: Sequence[int], contract: int) -> P | None:
    """How a weight of ``shape`` declared with ``logical_axes`` is stored across the mesh
    (``stored_spec``), once flattened to the 2-D [K, N] of its GEMM (its first ``contract`` dims
    K); mesh axes of size 1 left out. None outside a mesh, or when a flattened dim is split other
    than along its leading (major) declared dim: then its shards are not contiguous blocks of [K, N]."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    spec = stored_spec(tuple(shape), logical_axes)
    axes = [tuple(a for a in spec_axes(d) if mesh.shape[a] > 1) for d in spec]
    flat = []
    for group in (axes[:contract], axes[contract:]):
        if any(group[1:]):
            return None
        flat.append(group[0] or None)
    return P(*flat)


def summed_onto(partial_KN: jax.Array, tokens: tuple[str, ...], spec: P) -> jax.Array:
    """A device's partial weight gradient summed over the ``tokens`` axes and left split as
    ``spec`` (inside a shard_map): reduce-scattered over the spec's axes, then all-reduced over
    the other token axes, in its own dtype; the FSDP gather's transpose, as XLA makes it for
    the unquantized GEMM."""
    scattered = ()
    for dim, axes in enumerate(map(spec_axes, spec)):
        if axes:
            partial_KN = jax.lax.psum_scatter(partial_KN, axes, scatter_dimension=dim, tiled=True)
            scattered += axes
    rest = tuple(a for a in tokens if a not in scattered)
    return jax.lax.psum(partial_KN, rest) if rest else partial_KN


def per_device(
    gemm, tokens: tuple[str, ...], *operands: jax.Array, tokens_contracted: bool = False, out_spec: P | None = None
) -> jax.Array:
    """``gemm`` on each device's tokens, every operand split along its leading (tokens) dim over
    ``tokens`` but the last, a weight, which each device takes whole. cuDNN's block-scaled GEMM
    is partitioned by JAX's ``custom_partitioning``, which on a sharded mesh turns the E8M0 scales
    into collectives (NCCL has no such type, and the 671B recipe's compile fails in the
    partitioner); inside a shard_map it is a local call, and the FSDP gathers stay XLA's, in the
    model's dtype. With ``tokens_contracted`` (the weight gradient) each device's partial sum is
    summed onto ``out_spec`` inside (``summed_onto``) when the spec's axes all split the tokens;
    otherwise the sum over devices is left to XLA, outside, which on the 671B recipe's mesh
    all-reduced the dense layers' whole gradients over every GPU."""
    if not tokens:
        return gemm(*operands)
    split, whole = P(tokens), P()
    if tokens_contracted and out_spec is not None and all(set(a) <= set(tokens) for a in map(spec_axes, out_spec)):
        return jax.shard_map(
            lambda *ops: summed_onto(gemm(*ops), tokens, out_spec),
            in_specs=(split,) * len(operands),
            out_specs=out_spec,
            check_vma=False,
        )(*operands)
    if tokens_contracted:
        partials = jax.shard_map(
            lambda *ops: gemm(*ops)[None], in_specs=(split,) * len(operands), out_specs=split, check_vma=False
        )(*operands)
        zero = jnp.zeros((), partials.dtype)  # summed in their own dtype (jnp.sum would widen bfloat16)
        return jax.lax.reduce(partials, zero, jax.lax.add, (0,))
    in_specs = (*(split,) * (len(operands) - 1), whole)
    return jax.shard_map(gemm, in_specs=in_specs, out_specs=split, check_vma=False)(*operands)


def _fp8_matmul_fwd(x_LK, w_KN, recipe, w_spec):
    if recipe.gemm == "cudnn":  # the tokens flattened: [M, K] x [N, K]

        def forward(x_LK, w_KN):
            y_MN = mx_gemm(x_LK.reshape(-1, x_LK.shape[-1]), w_KN.T, recipe, x_LK.dtype)
            return y_MN.reshape(*x_LK.shape[:-1], -1)

        y = per_device(forward, token_split(x_LK), x_LK, w_KN)
    else:
        xq, wq = fake_quantize(x_LK, recipe, -1), fake_quantize(w_KN, recipe, weight_axis(recipe, 0))
        y = fp8_gemm(xq, wq, x_LK.dtype)
    return y.astype(x_LK.dtype), (x_LK, w_KN)


def _fp8_matmul_bwd(recipe, w_spec, residuals, g_LN):
    x_LK, w_KN = residuals
    if recipe.gemm == "cudnn":

        def input_gradient(g_LN, w_KN):
            dx_MK = mx_gemm(g_LN.reshape(-1, g_LN.shape[-1]), w_KN, recipe, x_LK.dtype)
            return dx_MK.reshape(*g_LN.shape[:-1], -1)

        def weight_gradient(x_LK, g_LN):  # the tokens contract: 32 x 1 tiles
            x_MK, g_MN = x_LK.reshape(-1, x_LK.shape[-1]), g_LN.reshape(-1, g_LN.shape[-1])
            return mx_gemm(x_MK.T, g_MN.T, recipe, w_KN.dtype)

        tokens = token_split(x_LK)
        dx = per_device(input_gradient, tokens, g_LN, w_KN)
        dw = per_device(weight_gradient, tokens, x_LK, g_LN, tokens_contracted=True, out_spec=w_spec)
    else:
        w_for_dx = fake_quantize(w_KN, recipe, weight_axis(recipe, 1))
        dx = fp8_gemm(fake_quantize(g_LN, recipe, -1), w_for_dx.T, x_LK.dtype)
        dw = _tokens_contracted(fake_quantize(x_LK, recipe, -2), fake_quantize(g_LN, recipe, -2), w_KN.dtype)
    return dx.astype(x_LK.dtype), dw.astype(w_KN.dtype)


fp8_matmul.defvjp(_fp8_matmul_fwd, _fp8_matmul_bwd)


def linear(
    x: jax.Array, w: jax.Array, recipe: Recipe | None, contract: int = 1, w_axes: Sequence[str] | None = None
) -> jax.Array:
    """Contract x's last ``contract`` dims with w's first ``contract`` dims (every projection of
    the model has this form: ``bsd,df->bsf``, ``bsr,rhk->bshk``, ``bshv,hvd->bsd``). With a recipe
    it runs as one FP8 GEMM over the flattened contracted dims, [..., K] x [K, N] (the weights'
    2-D layout in DeepSeek's released FP8 checkpoints, so their 128 x 128 blocks are the same).
    ``w_axes``: the weight's declared logical axes, where its FP8 gradient is left (``weight_spec``)."""
    if recipe is None:
        return jnp.tensordot(x, w, axes=contract)
    lead, out = x.shape[: x.ndim - contract], w.shape[contract:]
    K = math.prod(w.shape[:contract])
    spec = None if w_axes is None else weight_spec(w_axes, w.shape, contract)
    y = fp8_matmul(x.reshape(*lead, K), w.reshape(K, -1), recipe, spec)
    return y.reshape(*lead, *out)
