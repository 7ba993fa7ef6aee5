"""Attention backends: flash (and cuDNN's call, run through XLA) against dot, dot against a textbook
loop, the MLA model with flash against dot, flash's compiled memory, and the GPU-only refusals."""

import functools
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.config import ConfigError
from MaxText.layers.attention import MLA
from MaxText.layers.attention_ops import (
    BACKENDS,
    FLASH_MIN_LENGTH,
    _cudnn,
    attend,
    check_attention,
    resolve_attention,
    segment_positions,
)
from MaxText.layers.flash_attention import _blocks_visible
from MaxText.layers.rotary import softmax_scale
from tests.conftest import make_config

B, S, H, K, V = 2, 48, 3, 24, 16
# Row 0: three documents and trailing padding; row 1: one document filling the row.
SEGMENTS = np.array([[1] * 13 + [2] * 20 + [3] * 9 + [0] * 6, [7] * S], np.int32)


def random_qkv(seed=0, s=S, h=H):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal((B, s, h, d)), jnp.float32) for d in (K, K, V))


def out_and_grads(backend, config, q, k, v, seg):
    """The output, and the gradients with respect to q, k and v of a random linear functional of it
    (so every output entry has its own cotangent): one compiled program."""
    weights = jnp.asarray(np.random.default_rng(9).standard_normal((*q.shape[:3], v.shape[-1])), jnp.float32)

    def run(q, k, v):
        out, vjp = jax.vjp(lambda q, k, v: backend(q, k, v, seg, config), q, k, v)
        return out, vjp(weights)

    return jax.jit(run)(q, k, v)


@functools.cache
def dot_reference():
    q, k, v = random_qkv()
    return out_and_grads(BACKENDS["dot"], make_config(), q, k, v, jnp.asarray(SEGMENTS))


def assert_same(got, want):
    (out_got, grads_got), (out_want, grads_want) = got, want
    np.testing.assert_allclose(out_got, out_want, rtol=1e-5, atol=1e-5, err_msg="output")
    for name, a, b in zip("qkv", grads_got, grads_want, strict=True):
        assert np.abs(b).max() > 0.1, name  # a live gradient
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=f"d loss / d {name}")


# ---------------------------------------------------------------- dot: the reference, against a loop


def test_dot_matches_textbook_loop():
    cfg = make_config()
    q, k, v = (np.asarray(x, np.float64) for x in random_qkv(s=10, h=2))
    seg = np.array([[1, 1, 1, 2, 2, 2, 2, 0, 0, 0], [4] * 10], np.int32)
    got = np.asarray(BACKENDS["dot"](*map(jnp.asarray, (q, k, v, seg)), cfg))
    want = np.zeros(got.shape)
    for b in range(B):
        for h in range(2):
            for s in range(10):
                visible = [t for t in range(s + 1) if seg[b, t] == seg[b, s]]
                scores = np.array([q[b, s, h] @ k[b, t, h] * softmax_scale(cfg) for t in visible])
                probs = np.exp(scores - scores.max()) / np.exp(scores - scores.max()).sum()
                want[b, s, h] = sum(p * v[b, t, h] for p, t in zip(probs, visible, strict=True))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- flash and cuDNN's call against dot


@pytest.mark.parametrize(
    "block_q, block_kv",
    [(16, 16), (7, 20), (20, 16), (64, 64)],
    ids=["dividing", "not_dividing", "more_query_padding", "longer_than_sequence"],
)
def test_flash_matches_dot(block_q, block_kv):
    cfg = make_config(f"attention_block_q={block_q}", f"attention_block_kv={block_kv}")
    q, k, v = random_qkv()
    assert_same(out_and_grads(BACKENDS["flash"], cfg, q, k, v, jnp.asarray(SEGMENTS)), dot_reference())


def test_cudnn_call_matches_dot_through_xla():
    """The cudnn backend's arguments (head dims widened to one width, document mask, causal flag, scale)
    give dot's result and gradients when the same call runs on XLA."""
    q, k, v = random_qkv()
    cudnn_via_xla = partial(_cudnn, implementation="xla")
    assert_same(out_and_grads(cudnn_via_xla, make_config(), q, k, v, jnp.asarray(SEGMENTS)), dot_reference())


def test_flash_skips_only_fully_masked_blocks():
    for block_q, block_kv, length in [(16, 16, 48), (16, 12, 48), (7, 20, 60), (20, 7, 63)]:
        num_kv = length // block_kv
        for i in range(length // block_q):
            rows = range(i * block_q, (i + 1) * block_q)
            needed = [j for j in range(num_kv) if any(j * block_kv <= r for r in rows)]
            assert int(_blocks_visible(i, block_q, block_kv, num_kv)) == len(needed) == max(needed) + 1


# ---------------------------------------------------------------- the MLA layer: flash against dot


def test_mla_layer_same_loss_and_gradients_with_flash_and_dot():
    """The whole MLA layer (projections, norms, YaRN rotary, shared rotary key broadcast to the heads,
    output projection): loss and gradients for every parameter and the input."""
    length = 40
    rng = np.random.default_rng(3)
    x_BSD = jnp.asarray(rng.standard_normal((2, length, 64)), jnp.float32)
    seg = np.array([[1] * 15 + [2] * 19 + [0] * 6, [1] * length], np.int32)
    pos = np.arange(length)[None] - np.array([[0] * 15 + [15] * 19 + [34] * 6, [0] * length])
    weights = jnp.asarray(rng.standard_normal(x_BSD.shape), jnp.float32)
    shapes = nn.unbox(jax.eval_shape(partial(MLA(make_config()).init, jax.random.key(0)), x_BSD, pos, seg))
    params = jax.tree.map(lambda a: jnp.asarray(0.3 * rng.standard_normal(a.shape), a.dtype), shapes["params"])
    results = {}
    for backend in ("dot", "flash"):
        # blocks that do not divide the length, and a kv block unlike the query block
        mla = MLA(make_config(f"attention={backend}", "attention_block_q=16", "attention_block_kv=12"))

        def loss(params, x, mla=mla):
            return jnp.sum(mla.apply({"params": params}, x, pos, seg) * weights)

        results[backend] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x_BSD)
    (loss_dot, grads_dot), (loss_flash, grads_flash) = results["dot"], results["flash"]
    np.testing.assert_allclose(loss_flash, loss_dot, rtol=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads_dot), jax.tree.leaves(grads_flash), strict=True):
        scale = float(np.abs(a).max())
        assert scale > 1e-3, jax.tree_util.keystr(path)  # a live gradient
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path))


# ---------------------------------------------------------------- memory


def test_flash_compiled_memory_is_under_a_quarter_of_dot_at_4096():
    """XLA's compiled temp + output bytes of forward+backward (nothing is allocated to read them)."""
    cfg = make_config("qk_nope_head_dim=128", "qk_rope_head_dim=64", "v_head_dim=128")
    length, heads = 4096, 2
    q = k = jax.ShapeDtypeStruct((1, length, heads, cfg.qk_head_dim), jnp.float32)
    v = jax.ShapeDtypeStruct((1, length, heads, cfg.v_head_dim), jnp.float32)
    seg = jax.ShapeDtypeStruct((1, length), jnp.int32)
    peak = {}
    for backend in ("dot", "flash"):

        def loss(q, k, v, seg, backend=backend):
            return jnp.sum(BACKENDS[backend](q, k, v, seg, cfg))

        compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(q, k, v, seg).compile()
        memory = compiled.memory_analysis()
        peak[backend] = memory.temp_size_in_bytes + memory.output_size_in_bytes
    scores_bytes = heads * length * length * 4
    assert peak["dot"] >= scores_bytes  # dot holds at least one [H, S, S] float32 array
    assert peak["flash"] < peak["dot"] / 4, peak
    assert peak["flash"] < scores_bytes / 4, peak


# ---------------------------------------------------------------- choice and refusals


@pytest.mark.parametrize("backend", ["cudnn", "te"])
def test_gpu_backends_are_refused_on_cpu(backend, tmp_path):
    cfg = make_config(f"attention={backend}", f"base_output_directory={tmp_path}")
    with pytest.raises(ConfigError, match=f"config key 'attention': {backend} .*GPU only"):
        check_attention(cfg, "cpu")
    q, k, v = random_qkv(s=8)
    with pytest.raises(ConfigError, match="config key 'attention'"):
        attend(q, k, v, jnp.ones((B, 8), jnp.int32), cfg)
    from MaxText.train.loop import train

    with pytest.raises(ConfigError, match="config key 'attention'"):  # at start-up, before compiling
        train(cfg)


def test_gpu_backends_refuse_float32_on_gpu():
    with pytest.raises(ConfigError, match="config key 'attention': cudnn .*bfloat16"):
        check_attention(make_config("attention=cudnn", "dtype=float32"), "gpu")
    check_attention(make_config("attention=cudnn", "dtype=bfloat16"), "gpu")  # MLA's 192/128 fit


def test_auto_resolution():
    cfg = make_config()  # attention: auto, dtype float32 (CPU)
    assert resolve_attention(cfg, FLASH_MIN_LENGTH - 1, "cpu") == "dot"
    assert resolve_attention(cfg, FLASH_MIN_LENGTH, "cpu") == "flash"
    assert resolve_attention(cfg, 4096, "gpu") == "flash"  # cuDNN and TE take 16-bit inputs only
    # Transformer Engine does not import on a CPU install, so a 16-bit GPU run gets cuDNN.
    assert resolve_attention(make_config("dtype=bfloat16"), 4096, "gpu") == "cudnn"
    for name in ("dot", "flash", "cudnn", "te"):
        assert resolve_attention(make_config(f"attention={name}"), 8, "cpu") == name


@pytest.mark.parametrize("key", ["attention_block_q", "attention_block_kv", "attention_max_segments"])
def test_block_keys_must_be_positive(key):
    with pytest.raises(ConfigError, match=f"config key '{key}'"):
        make_config(f"{key}=0")
    with pytest.raises(ConfigError, match="config key 'attention'"):
        make_config("attention=splash")


def test_segment_positions_against_loop():
    seg = np.array([[1, 1, 1, 2, 2, 0, 0], [5, 5, 5, 5, 5, 5, 5]], np.int32)
    got = np.asarray(segment_positions(jnp.asarray(seg)))
    for b in range(2):
        for s in range(7):
            start = s
            while start > 0 and seg[b, start - 1] == seg[b, s]:
                start -= 1
            assert got[b, s] == s - start
