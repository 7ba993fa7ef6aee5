"""FP8 quantizers and GEMMs against references written out here, element by element in numpy.

The references follow the recipes' texts (DeepSeek-V3 report 3.3; OCP Microscaling 1.0 and the
rounding-up rule Transformer Engine, cuDNN and jax.nn.scaled_matmul use), not the product code.
"""

import math
from functools import partial

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from MaxText.quantization import Recipe, dequantize, fake_quantize, fp8_matmul, quantize
from MaxText.quantization.matmul import linear

E4M3 = ml_dtypes.float8_e4m3fn
BLOCKWISE, MX_CEIL, MX_FLOOR = Recipe("fp8_blockwise", 128), Recipe("mxfp8", 32), Recipe("mxfp8", 32, "floor")


def reference_block(block: np.ndarray, recipe: Recipe) -> tuple[np.ndarray, float]:
    """One block (any shape) -> (dequantized float32 values, scale as a float multiplier)."""
    amax = float(np.max(np.abs(block.astype(np.float64)))) if block.size else 0.0
    if not math.isfinite(amax):
        return np.full(block.shape, np.nan, np.float32), math.nan
    if recipe.name == "fp8_blockwise":
        amax = amax and max(amax, 448.0 * 2.0**-126)  # a scale in float32's normal range
        scale = 1.0 if amax == 0 else float(np.float32(np.float32(amax) / np.float32(448.0)))
    elif amax == 0:
        scale = 2.0**-127
    else:
        ratio = float(np.float32(np.float32(amax) / np.float32(448.0)))
        mantissa, exponent = math.frexp(ratio if recipe.scale_rule == "ceil" else amax)  # x = m 2^e, m in [0.5, 1)
        if recipe.scale_rule == "ceil":
            e = exponent - 1 if mantissa == 0.5 else exponent
        else:
            e = (exponent - 1) - 8  # floor(log2 amax) - emax(E4M3)
        scale = 2.0 ** min(max(e, -127), 127)
    # Blockwise values are x * (448 / amax) (DeepSeek's kernels); MX divides by a power of two.
    inverse = np.float32(448.0) / np.float32(amax) if recipe.name == "fp8_blockwise" and amax else 1 / scale
    out = np.empty(block.shape, np.float32)
    for index, x in np.ndenumerate(block):
        scaled = np.float32(np.float32(x) * np.float32(inverse))
        scaled = min(max(float(scaled), -448.0), 448.0)  # saturate before the cast
        with np.errstate(over="ignore"):  # float32's largest values may round past it (MX)
            out[index] = np.float64(np.array(scaled, np.float32).astype(E4M3)) * scale
    return out, scale


def reference_quantize(x: np.ndarray, recipe: Recipe, axis) -> tuple[np.ndarray, np.ndarray]:
    """Dequantized values and the scales, block by block along ``axis`` (int or pair)."""
    axes = (axis,) if isinstance(axis, int) else axis
    b = recipe.block
    grid = [math.ceil(n / b) if d in axes else n for d, n in enumerate(x.shape)]
    out, scales = np.empty(x.shape, np.float32), np.empty(grid, np.float64)
    for index in np.ndindex(*grid):
        sl = tuple(slice(i * b, (i + 1) * b) if d in axes else slice(i, i + 1) for d, i in enumerate(index))
        out[sl], scales[index] = reference_block(x[sl], recipe)
    return out, scales


def scale_values(scales: jax.Array, recipe: Recipe) -> np.ndarray:
    """The product's scales as float multipliers (E8M0 bytes decoded by the OCP definition)."""
    s = np.asarray(scales)
    if recipe.name == "mxfp8":
        assert s.dtype == np.uint8
        return np.where(s == 255, np.nan, np.exp2(s.astype(np.float64) - 127))
    assert s.dtype == np.float32
    return s.astype(np.float64)


def edge_blocks(block: int) -> np.ndarray:
    """Rows of one block each: random, all zero, FP8 subnormals next to 448, the largest float32,
    1e-6 mixed with 1e3, an amax whose mantissa is above 1.75 (where the MX rules differ), an
    amax exactly 448 times a power of two, and a block of zeros and values near float32's
    smallest normal (whose scale would leave float32's range: 448 / amax overflows)."""
    rng = np.random.default_rng(0)
    rows = [rng.normal(size=block) * 3, np.zeros(block)]
    sub = np.full(block, 2.0**-8)
    sub[0], sub[1], sub[2] = 448.0, 2.0**-9, 3 * 2.0**-10
    rows.append(sub)
    rows.append(np.linspace(-1, 1, block) * np.finfo(np.float32).max)
    rows.append(np.where(np.arange(block) % 2, 1e-6, 1e3) * np.where(np.arange(block) % 3, 1, -1))
    rows.append(rng.uniform(-1, 1, size=block) * 1.9 * 2.0**5)
    exact = rng.uniform(-1, 1, size=block)
    exact[3] = 448.0 * 2.0**-3
    rows.append(exact)
    tiny = np.zeros(block)
    tiny[:3] = 1e-37, -3e-38, 2.5e-37
    rows.append(tiny)
    return np.stack(rows).astype(np.float32)


@pytest.mark.parametrize("recipe", [BLOCKWISE, MX_CEIL, MX_FLOOR], ids=lambda r: f"{r.name}-{r.scale_rule}")
def test_quantize_matches_the_written_out_reference_on_edge_blocks(recipe):
    x = edge_blocks(recipe.block)
    values, scales = quantize(jnp.asarray(x), recipe, axis=1)
    assert values.dtype == jnp.float8_e4m3fn and values.shape == x.shape
    want, want_scales = reference_quantize(x, recipe, 1)
    np.testing.assert_array_equal(scale_values(scales, recipe), want_scales)
    np.testing.assert_array_equal(np.asarray(dequantize(values, scales, recipe, 1)), want)
    assert np.all(want[1] == 0)  # zeros stay zeros
    # No value overflows, but at float32's largest (row 3), where an MX value rounding up to a
    # power of two lands past float32's range when dequantized: the reference says the same.
    assert np.all(np.isfinite(np.delete(want, 3, axis=0)))
    # Values near float32's smallest normal keep their values, their zeros stay zeros (no NaN).
    np.testing.assert_allclose(want[-1], x[-1], rtol=2.0**-4, atol=0)


def test_the_two_mx_rules_differ_only_where_the_amax_mantissa_exceeds_1_75():
    x = edge_blocks(32)
    (_, ceil_s), (_, floor_s) = quantize(jnp.asarray(x), MX_CEIL, 1), quantize(jnp.asarray(x), MX_FLOOR, 1)
    amax = np.abs(x.astype(np.float64)).max(axis=1)
    mantissa = amax / np.exp2(np.floor(np.log2(np.where(amax > 0, amax, 1))))
    differs = np.asarray(ceil_s)[:, 0] != np.asarray(floor_s)[:, 0]
    np.testing.assert_array_equal(differs, (mantissa > 1.75) & (amax > 0))
    assert differs.any()  # the 1.9 x 2^5 block
    # Under the floor rule that block saturates: its largest element becomes 448 x scale.
    values, scales = quantize(jnp.asarray(x[5:6]), MX_FLOOR, 1)
    assert float(jnp.max(jnp.abs(values.astype(jnp.float32)))) == 448.0


@pytest.mark.parametrize("recipe", [BLOCKWISE, MX_CEIL], ids=lambda r: r.name)
def test_shapes_that_are_not_a_multiple_of_the_block_are_padded_inside(recipe):
    x = np.random.default_rng(1).normal(size=(3, recipe.block + 7)).astype(np.float32) * 5
    values, scales = quantize(jnp.asarray(x), recipe, axis=1)
    assert scales.shape == (3, 2) and values.shape == x.shape
    want, want_scales = reference_quantize(x, recipe, 1)
    np.testing.assert_array_equal(scale_values(scales, recipe), want_scales)
    np.testing.assert_array_equal(np.asarray(dequantize(values, scales, recipe, 1)), want)


def test_blockwise_weights_take_square_blocks():
    x = np.random.default_rng(2).normal(size=(200, 300)).astype(np.float32)
    values, scales = quantize(jnp.asarray(x), BLOCKWISE, axis=(0, 1))
    assert scales.shape == (2, 3)
    want, want_scales = reference_quantize(x, BLOCKWISE, (0, 1))
    np.testing.assert_array_equal(np.asarray(scales, np.float64), want_scales)
    np.testing.assert_array_equal(np.asarray(dequantize(values, scales, BLOCKWISE, (0, 1))), want)
    with pytest.raises(ValueError, match="1-D blocks"):
        quantize(jnp.asarray(x), MX_CEIL, axis=(0, 1))


@pytest.mark.parametrize("recipe", [BLOCKWISE, MX_CEIL, MX_FLOOR], ids=lambda r: f"{r.name}-{r.scale_rule}")
def test_round_trip_error_of_normal_values_is_at_most_2_to_the_minus_4(recipe):
    rng = np.random.default_rng(3)
    x = (rng.normal(size=(64, 256)) * np.exp(rng.uniform(-8, 8, size=(64, 1)))).astype(np.float32)
    values, scales = quantize(jnp.asarray(x), recipe, axis=1)
    back = np.asarray(dequantize(values, scales, recipe, 1))
    scaled = np.abs(np.asarray(values, np.float32))
    normal = (scaled >= 2.0**-6) & (scaled < 448)  # E4M3 normal range, not saturated
    assert normal.mean() > 0.9
    relative = np.abs(back - x)[normal] / np.abs(x)[normal]
    assert relative.max() <= 2.0**-4


@pytest.mark.parametrize("recipe", [BLOCKWISE, MX_CEIL], ids=lambda r: r.name)
def test_nan_and_inf_are_not_hidden(recipe):
    x = np.ones((2, 2 * recipe.block), np.float32)
    x[0, 3], x[1, recipe.block + 1] = np.nan, np.inf
    back = np.asarray(dequantize(*quantize(jnp.asarray(x), recipe, 1), recipe, 1))
    assert np.isnan(back[0, : recipe.block]).all() and np.isnan(back[1, recipe.block :]).all()
    assert np.isfinite(back[0, recipe.block :]).all() and np.isfinite(back[1, : recipe.block]).all()


# ---- GEMMs ----


def _dq(x, recipe, axis):
    return dequantize(*quantize(x, recipe, axis), recipe, axis)


def _gemm(a, b):
    return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)


@pytest.mark.parametrize("recipe", [BLOCKWISE, MX_CEIL], ids=lambda r: r.name)
def test_each_fp8_gemm_equals_the_float32_gemm_of_its_dequantized_operands(recipe):
    """Forward, input gradient and weight gradient, each quantized along its own contraction
    dimension (weights: square blocks for blockwise, a copy per direction for MX)."""
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x, w = jax.random.normal(kx, (160, 96)), jax.random.normal(kw, (96, 200)) * 0.1
    g = jax.random.normal(kg, (160, 200))
    y, vjp = jax.vjp(lambda x, w: fp8_matmul(x, w, recipe), x, w)
    dx, dw = vjp(g)
    w_fwd, w_bwd = ((0, 1), (0, 1)) if recipe.name == "fp8_blockwise" else (0, 1)
    np.testing.assert_array_equal(y, _gemm(_dq(x, recipe, 1), _dq(w, recipe, w_fwd)))
    np.testing.assert_array_equal(dx, _gemm(_dq(g, recipe, 1), _dq(w, recipe, w_bwd).T))
    tokens_contracted = partial(jnp.einsum, "mk,mn->kn", precision=jax.lax.Precision.HIGHEST)
    np.testing.assert_array_equal(dw, tokens_contracted(_dq(x, recipe, 0), _dq(g, recipe, 0)))
    # ... and the float32 GEMMs of the originals within FP8's precision: relative Frobenius error
    # under 2 x 2^-4 (two operands, each element within 2^-4).
    for got, want in ((y, _gemm(x, w)), (dx, _gemm(g, w.T)), (dw, _gemm(x.T, g))):
        assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 2 * 2.0**-4


@pytest.mark.slow
def test_mx_operands_are_exact_in_bfloat16_as_gpus_take_them():
    """On a GPU the emulated MX GEMMs take bfloat16 operands (bfloat16 tensor cores): the same
    values as float32's, so the GEMM differs only in the order of its float32 sums."""
    on_gpu = Recipe("mxfp8", 32, operands="bfloat16")
    kx, kw, kg = jax.random.split(jax.random.key(2), 3)
    x, w = jax.random.normal(kx, (96, 160)) * 3, jax.random.normal(kw, (160, 64)) * 0.02
    g = jax.random.normal(kg, (96, 64)) * 1e-5
    for t, axis in ((x, 1), (x, 0), (w, 0), (g, 0)):
        narrow = fake_quantize(t, on_gpu, axis)
        assert narrow.dtype == jnp.bfloat16
        np.testing.assert_array_equal(narrow.astype(jnp.float32), fake_quantize(t, MX_CEIL, axis))
    got = jax.vjp(lambda x, w: fp8_matmul(x, w, on_gpu), x, w)
    want = jax.vjp(lambda x, w: fp8_matmul(x, w, MX_CEIL), x, w)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6 * float(jnp.abs(want[0]).max()))
    for a, b in zip(got[1](g), want[1](g), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * float(jnp.abs(b).max()))
    with pytest.raises(ValueError, match="not exact in bfloat16"):
        fake_quantize(x, Recipe("fp8_blockwise", 128, operands="bfloat16"), 1)


@pytest.mark.parametrize("recipe", [BLOCKWISE, MX_CEIL], ids=lambda r: r.name)
def test_an_outlier_changes_only_its_own_block(recipe):
    """The granularity is real: a 1,000x outlier moves the scale of its tile (activations) or its
    block (weights) and no other, so the other outputs of the GEMM do not change."""
    b = recipe.block
    kx, kw = jax.random.split(jax.random.key(1))
    x, w = jax.random.normal(kx, (2 * b, 3 * b)), jax.random.normal(kw, (3 * b, 2 * b))
    x_out = x.at[5, b + 2].multiply(1000.0)
    (_, s0), (_, s1) = quantize(x, recipe, 1), quantize(x_out, recipe, 1)
    changed = np.argwhere(np.asarray(s0) != np.asarray(s1))
    np.testing.assert_array_equal(changed, [[5, 1]])
    y0, y1 = fp8_matmul(x, w, recipe), fp8_matmul(x_out, w, recipe)
    np.testing.assert_array_equal(np.delete(np.asarray(y0), 5, 0), np.delete(np.asarray(y1), 5, 0))
    w_axis = (0, 1) if recipe.weight_blocks_2d else 0
    (_, t0), (_, t1) = quantize(w, recipe, w_axis), quantize(w.at[b + 1, 3].multiply(1000.0), recipe, w_axis)
    assert (np.asarray(t0) != np.asarray(t1)).sum() == 1


def test_linear_contracts_several_dims_as_one_gemm():
    """``bshv,hvd->bsd`` (MLA's output projection) is one GEMM over the flattened h*v."""
    kx, kw = jax.random.split(jax.random.key(2))
    x, w = jax.random.normal(kx, (2, 3, 4, 16)), jax.random.normal(kw, (4, 16, 8))
    np.testing.assert_allclose(linear(x, w, None, 2), jnp.einsum("bshv,hvd->bsd", x, w), rtol=1e-5, atol=1e-5)
    want = fp8_matmul(x.reshape(6, 64), w.reshape(64, 8), MX_CEIL).reshape(2, 3, 8)
    np.testing.assert_array_equal(linear(x, w, MX_CEIL, 2), want)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (("moe_matmul=ragged_dot",), "moe_matmul"),
        (("moe_matmul=te",), "moe_matmul"),
        (("capacity_factor=1.25",), "capacity_factor"),
    ],
)
def test_combinations_without_an_fp8_path_are_refused_by_key(overrides, key):
    from MaxText.config import ConfigError
    from tests.conftest import make_config

    with pytest.raises(ConfigError, match=f"config key '{key}'"):
        make_config("quantization=mxfp8", *overrides)


def test_cudnn_fp8_gemms_are_refused_where_there_is_no_mx_gemm():
    """cuDNN's MX GEMM exists on Blackwell (10.0) and later: CPU and Hopper (9.0) exit 2 naming the key."""
    from MaxText.config import ConfigError
    from MaxText.quantization.quantize import check_quantization
    from tests.conftest import make_config

    cudnn = make_config("quantization=mxfp8", "fp8_gemm=cudnn")
    for platform, capability in (("cpu", None), ("gpu", (9, 0)), ("gpu", (8, 9))):
        with pytest.raises(ConfigError, match="config key 'fp8_gemm'"):
            check_quantization(cudnn, platform, capability)
    for capability in ((10, 0), (10, 3), None):  # None: a GPU whose capability is not known here
        check_quantization(cudnn, "gpu", capability)
    check_quantization(make_config("quantization=mxfp8"), "gpu", (9, 0))  # auto: emulation


def test_auto_runs_the_routed_experts_fp8_gemms_in_blocked_everywhere():
    from MaxText.moe.experts import resolve_backend

    for platform in ("cpu", "gpu", "tpu"):
        assert resolve_backend("auto", platform, te=True, fp8=True) == "blocked"
    assert resolve_backend("auto", "gpu", te=True) == "tokamax"


def test_the_weight_gradient_is_summed_onto_the_weights_own_split():
    """``per_device``'s weight gradient on 8 devices (data 2 x fsdp 2 x expert 2, the tokens split
    over all three): each device's partial sum reduce-scattered onto the weight's stored split and
    all-reduced over the other token axes equals the whole GEMM, for every split the rules give
    the model's weights (and one along N); ``weight_spec`` flattens a weight's logical axes to its
    GEMM's [K, N] only where the shards stay contiguous blocks."""
    import flax.linen as nn
    from jax.sharding import PartitionSpec as P

    from MaxText.parallel.mesh import make_mesh
    from MaxText.parallel.sharding import axis_rules
    from MaxText.quantization.matmul import per_device, weight_spec
    from tests.conftest import make_config

    config = make_config("ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_expert_parallelism=2")
    mesh = make_mesh(config)
    kx, kg = jax.random.split(jax.random.key(3))
    x, g = jax.random.normal(kx, (8, 4, 32)), jax.random.normal(kg, (8, 4, 16))
    want = jnp.einsum("bsk,bsn->kn", x, g)
    tokens = ("data", "fsdp", "expert")
    gemm = partial(jnp.einsum, "bsk,bsn->kn")
    with jax.set_mesh(mesh), nn.logical_axis_rules(axis_rules(config)):
        assert weight_spec(("embed", "q_lora"), (32, 16), 1) == P(("fsdp", "expert"), None)
        assert weight_spec(("kv_lora", "heads", "head_dim"), (32, 4, 8), 1) == P(("fsdp", "expert"), None)
        # As the weight is stored: where fsdp x expert does not divide the dim, fsdp alone.
        assert weight_spec(("kv_lora", "heads", "head_dim"), (6, 4, 8), 1) == P("fsdp", None)
        assert weight_spec(("mlp", "embed"), (16, 32), 1) == P(None, ("fsdp", "expert"))
        for spec in (P(("fsdp", "expert"), None), P(None, ("fsdp", "expert")), P("fsdp", None), P(None, "expert")):
            got = jax.jit(lambda x, g, spec=spec: per_device(gemm, tokens, x, g, tokens_contracted=True, out_spec=spec))
            out = got(x, g)
            assert out.sharding.is_equivalent_to(jax.NamedSharding(mesh, spec), 2)
            np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    tensor = make_config("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2")
    with jax.set_mesh(make_mesh(tensor)), nn.logical_axis_rules(axis_rules(tensor)):
        assert weight_spec(("heads", "head_dim", "embed"), (4, 8, 32), 2) == P("tensor", "fsdp")
        assert weight_spec(("kv_lora", "heads", "head_dim"), (32, 4, 8), 1) == P("fsdp", "tensor")  # heads lead N
        assert weight_spec(("kv_lora", "head_dim", "heads"), (32, 8, 4), 1) is None  # split inside N: not blocks
