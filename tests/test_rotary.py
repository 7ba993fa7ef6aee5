"""Rotary embedding and YaRN against straightforward re-implementations of the reference formulas.

The references here are written from docs (shared/reference/deepseek_v3.md and the HF
``DeepseekV3YarnRotaryEmbedding``), element by element in plain Python, not from the code under test.
"""

import math

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_config

from MaxText.layers.rotary import apply_rope, rope_inv_freq, rope_magnitude, softmax_scale, yarn_mscale


def yarn_reference(dim, theta, factor, orig_len, beta_fast, beta_slow):
    """(inv_freq list, low, high) from the formulas, one frequency at a time."""

    def correction(rotations):
        return dim * math.log(orig_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction(beta_fast)), 0)
    high = min(math.ceil(correction(beta_slow)), dim - 1)
    out = []
    for i in range(dim // 2):
        base = theta ** (-2 * i / dim)
        span = (high - low) if high != low else 0.001
        ramp = min(max((i - low) / span, 0.0), 1.0)
        out.append(base / factor * ramp + base * (1 - ramp))
    return out, low, high


# The release's context extension (the 671B overlay pretrains with plain RoPE; converted checkpoints keep it).
RELEASE_YARN = ("rope_type=yarn",)


def test_671b_pretrains_with_plain_rope():
    """DeepSeek-V3 pretrained at 4K with plain RoPE; YaRN came with the context extension (report 4.3)."""
    cfg = make_config(model="deepseek3-671b")
    assert cfg.rope_type == "default"
    np.testing.assert_allclose(np.asarray(rope_inv_freq(cfg)), 10000.0 ** (-np.arange(0, 64, 2) / 64), rtol=1e-12)
    assert softmax_scale(cfg) == pytest.approx(192**-0.5, rel=1e-12)
    assert make_config(model="deepseek3-small").rope_type == "default"


def test_yarn_inv_freq_671b():
    cfg = make_config(*RELEASE_YARN, model="deepseek3-671b")
    assert cfg.rope_type == "yarn" and cfg.qk_rope_head_dim == 64 and cfg.rope_factor == 40
    ref, low, high = yarn_reference(64, 10000.0, 40.0, 4096, 32.0, 1.0)
    assert (low, high) == (10, 23)  # the correction range quoted in the reference doc
    got = np.asarray(rope_inv_freq(cfg))
    assert got.shape == (32,)
    np.testing.assert_allclose(got, ref, rtol=1e-12)
    plain = 10000.0 ** (-np.arange(0, 64, 2) / 64)
    # High frequencies (i <= low) are kept, low ones (i >= high) divided by the factor, a ramp between.
    np.testing.assert_allclose(got[:11], plain[:11], rtol=1e-12)
    np.testing.assert_allclose(got[23:], plain[23:] / 40, rtol=1e-12)
    assert np.all((got[11:23] < plain[11:23]) & (got[11:23] > plain[11:23] / 40))


def test_yarn_inv_freq_tiny():
    cfg = make_config()
    ref, low, high = yarn_reference(
        cfg.qk_rope_head_dim,
        cfg.rope_max_timescale,
        cfg.rope_factor,
        cfg.original_max_position_embeddings,
        cfg.beta_fast,
        cfg.beta_slow,
    )
    assert cfg.rope_type == "yarn" and low < high
    np.testing.assert_allclose(np.asarray(rope_inv_freq(cfg)), ref, rtol=1e-12)


@pytest.mark.parametrize("overrides", [(), ("rope_factor=1",), ("original_max_position_embeddings=100000",)])
def test_yarn_inv_freq_other_ranges(overrides):
    cfg = make_config("qk_rope_head_dim=32", *overrides)
    ref, _, _ = yarn_reference(32, 10000.0, cfg.rope_factor, cfg.original_max_position_embeddings, 32.0, 1.0)
    np.testing.assert_allclose(np.asarray(rope_inv_freq(cfg)), ref, rtol=1e-12)


def test_default_rope_is_plain():
    cfg = make_config("rope_type=default", model="deepseek3-671b")
    np.testing.assert_allclose(np.asarray(rope_inv_freq(cfg)), 10000.0 ** (-np.arange(0, 64, 2) / 64), rtol=1e-12)
    assert softmax_scale(cfg) == pytest.approx(192**-0.5, rel=1e-12)
    assert rope_magnitude(cfg) == 1.0


def test_mscale_and_softmax_scale_671b():
    cfg = make_config(*RELEASE_YARN, model="deepseek3-671b")
    m = 0.1 * 1.0 * math.log(40) + 1
    assert yarn_mscale(40, 1.0) == pytest.approx(m, rel=1e-12)
    assert yarn_mscale(1, 1.0) == 1.0
    assert cfg.qk_head_dim == 192
    assert softmax_scale(cfg) == pytest.approx(192**-0.5 * m**2, rel=1e-12)
    assert softmax_scale(cfg) == pytest.approx(0.135234, abs=1e-6)  # the value in the reference doc
    assert rope_magnitude(cfg) == pytest.approx(1.0)  # mscale == mscale_all_dim in the release


def test_rope_magnitude_when_mscales_differ():
    cfg = make_config("rope_mscale=0.707", "rope_mscale_all_dim=1.0")
    f = cfg.rope_factor
    expected = (0.1 * 0.707 * math.log(f) + 1) / (0.1 * 1.0 * math.log(f) + 1)
    assert rope_magnitude(cfg) == pytest.approx(expected, rel=1e-12)
    assert softmax_scale(cfg) == pytest.approx(cfg.qk_head_dim**-0.5 * (0.1 * math.log(f) + 1) ** 2, rel=1e-12)


def rope_loop_reference(x, positions, inv_freq, interleave, magnitude=1.0):
    """Rotate each pair of x [B, S, N, d] by pos * inv_freq[i], one pair at a time (float64)."""
    x = np.asarray(x, np.float64)
    out = np.empty_like(x)
    B, S, N, d = x.shape
    for b in range(B):
        for s in range(S):
            for i in range(d // 2):
                a, c = (2 * i, 2 * i + 1) if interleave else (i, i + d // 2)
                angle = float(positions[b, s]) * inv_freq[i]
                cos, sin = math.cos(angle) * magnitude, math.sin(angle) * magnitude
                out[b, s, :, a] = x[b, s, :, a] * cos - x[b, s, :, c] * sin
                out[b, s, :, c] = x[b, s, :, c] * cos + x[b, s, :, a] * sin
    return out


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("rope_type", ["yarn", "default"])
def test_apply_rope_against_pair_loop(interleave, rope_type):
    cfg = make_config(f"rope_interleave={str(interleave).lower()}", f"rope_type={rope_type}", "rope_mscale=0.8")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, 3, cfg.qk_rope_head_dim)).astype(np.float32)
    positions = rng.integers(0, 200, size=(2, 5)).astype(np.int32)
    inv_freq, _, _ = yarn_reference(
        cfg.qk_rope_head_dim,
        cfg.rope_max_timescale,
        cfg.rope_factor if rope_type == "yarn" else 1.0,
        cfg.original_max_position_embeddings,
        cfg.beta_fast,
        cfg.beta_slow,
    )
    f = cfg.rope_factor
    magnitude = (0.1 * 0.8 * math.log(f) + 1) / (0.1 * math.log(f) + 1) if rope_type == "yarn" else 1.0
    got = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(positions), cfg))
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, rope_loop_reference(x, positions, inv_freq, interleave, magnitude), atol=2e-5)


def test_interleaved_and_halves_differ():
    """The two layouts are different rotations (so a test against the wrong one would fail)."""
    x = jnp.asarray(np.random.default_rng(1).standard_normal((1, 4, 1, 8)), jnp.float32)
    pos = jnp.arange(4)[None]
    a = apply_rope(x, pos, make_config("rope_interleave=true"))
    b = apply_rope(x, pos, make_config("rope_interleave=false"))
    assert float(jnp.max(jnp.abs(a - b))) > 1e-2


@pytest.mark.parametrize("interleave", [True, False])
def test_dot_product_depends_only_on_position_difference(interleave):
    cfg = make_config(f"rope_interleave={str(interleave).lower()}", "qk_rope_head_dim=16")
    rng = np.random.default_rng(2)
    q = rng.standard_normal(16)
    k = rng.standard_normal(16)
    starts, deltas = np.array([0, 3, 50, 311]), np.array([0, 1, 7, 40])
    # Rotate q at m + delta and k at m for every (m, delta), in one call each: [1, 16, 1, d].
    m = np.repeat(starts, len(deltas))
    pos_q = jnp.asarray((m + np.tile(deltas, len(starts)))[None], jnp.int32)
    pos_k = jnp.asarray(m[None], jnp.int32)
    qs = apply_rope(jnp.asarray(np.broadcast_to(q, (1, 16, 1, 16)), jnp.float32), pos_q, cfg)
    ks = apply_rope(jnp.asarray(np.broadcast_to(k, (1, 16, 1, 16)), jnp.float32), pos_k, cfg)
    dots = np.asarray(jnp.sum(qs * ks, axis=-1)).reshape(len(starts), len(deltas))
    # Same difference, same dot product, wherever the pair sits ...
    np.testing.assert_allclose(dots, np.broadcast_to(dots[:1], dots.shape), atol=2e-4)
    # ... and different differences give different dot products (the rotation is not trivial).
    assert np.min(np.abs(np.diff(dots[0]))) > 1e-3
    np.testing.assert_allclose(dots[0, 0], q @ k, rtol=1e-5)  # no rotation at difference 0
