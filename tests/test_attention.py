"""Multi-head latent attention (MLA) against a per-head numpy reference built from the params dict."""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_config

from MaxText.layers.attention import MLA
from MaxText.layers.attention_ops import attention_mask

B, S = 2, 8


def random_params(cfg, seed=0):
    """MLA params of the right shapes (from eval_shape of init), filled with O(1)-output random values."""
    x = jnp.zeros((B, S, cfg.emb_dim), jnp.float32)
    pos = jnp.zeros((B, S), jnp.int32)
    shapes = nn.unbox(jax.eval_shape(lambda: MLA(cfg).init(jax.random.key(0), x, pos, pos)))["params"]
    rng = np.random.default_rng(seed)

    def fill(path, leaf):
        name = path[-1].key
        if name == "scale":  # norm scales: not all ones, so a missing or misplaced norm shows
            return jnp.asarray(1 + 0.3 * rng.standard_normal(leaf.shape), leaf.dtype)
        fan_in = math.prod(leaf.shape[:2]) if name == "wo" else leaf.shape[0]
        return jnp.asarray(1.5 * rng.standard_normal(leaf.shape) / math.sqrt(fan_in), leaf.dtype)

    return jax.tree_util.tree_map_with_path(fill, shapes)


@functools.cache
def setup(*overrides):
    """(config, random params, jitted MLA apply), built once per set of overrides."""
    cfg = make_config(*overrides)
    return cfg, random_params(cfg), jax.jit(lambda p, x, pos, seg: MLA(cfg).apply({"params": p}, x, pos, seg))


# ------------------------------------------------------------------ independent reference


def ref_inv_freq(cfg):
    """YaRN inverse frequencies, one at a time from the formulas of the reference doc."""
    d, theta = cfg.qk_rope_head_dim, cfg.rope_max_timescale
    if cfg.rope_type != "yarn":
        return [theta ** (-2 * i / d) for i in range(d // 2)]

    def corr(rot):
        return d * math.log(cfg.original_max_position_embeddings / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(corr(cfg.beta_fast)), 0), min(math.ceil(corr(cfg.beta_slow)), d - 1)
    out = []
    for i in range(d // 2):
        ramp = min(max((i - low) / max(high - low, 1e-3), 0.0), 1.0)
        base = theta ** (-2 * i / d)
        out.append(base / cfg.rope_factor * ramp + base * (1 - ramp))
    return out


def ref_rope(vec, position, inv_freq, interleave):
    out = np.array(vec, np.float64)
    d = vec.shape[-1]
    for i in range(d // 2):
        a, c = (2 * i, 2 * i + 1) if interleave else (i, i + d // 2)
        cos, sin = math.cos(position * inv_freq[i]), math.sin(position * inv_freq[i])
        out[..., a] = vec[..., a] * cos - vec[..., c] * sin
        out[..., c] = vec[..., c] * cos + vec[..., a] * sin
    return out


def ref_rms(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def reference_mla(cfg, p, x, pos, seg):
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), p)
    x = np.asarray(x, np.float64)
    H, nope, rope, R = cfg.base_num_query_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    eps = cfg.normalization_layer_epsilon
    if cfg.q_lora_rank > 0:
        cq = ref_rms(x @ p["wq_a"], p["q_norm"]["scale"], eps)
        q = np.einsum("bsr,rhk->bshk", cq, p["wq_b"])
    else:
        q = np.einsum("bsd,dhk->bshk", x, p["wq"])
    kv_a = x @ p["wkv_a"]
    latent = ref_rms(kv_a[..., :R], p["kv_norm"]["scale"], eps)  # only the latent is normalised
    k_pe = kv_a[..., R:]  # one rotary key per token, shared by all heads
    kv = np.einsum("bsr,rhk->bshk", latent, p["wkv_b"])
    inv_freq = ref_inv_freq(cfg)
    mscale = 0.1 * cfg.rope_mscale_all_dim * math.log(cfg.rope_factor) + 1 if cfg.rope_type == "yarn" else 1.0
    scale = (nope + rope) ** -0.5 * mscale**2
    out = np.zeros(x.shape)
    for b in range(x.shape[0]):
        for h in range(H):
            for s in range(x.shape[1]):
                q_h = np.concatenate(
                    [q[b, s, h, :nope], ref_rope(q[b, s, h, nope:], pos[b, s], inv_freq, cfg.rope_interleave)]
                )
                visible = [t for t in range(s + 1) if seg[b, t] == seg[b, s]]
                scores = []
                for t in visible:
                    k_h = np.concatenate(
                        [kv[b, t, h, :nope], ref_rope(k_pe[b, t], pos[b, t], inv_freq, cfg.rope_interleave)]
                    )
                    scores.append(q_h @ k_h * scale)
                scores = np.array(scores)
                probs = np.exp(scores - scores.max())
                probs /= probs.sum()
                o_h = sum(pr * kv[b, t, h, nope:] for pr, t in zip(probs, visible, strict=True))
                out[b, s] += o_h @ p["wo"][h]
    return out


def inputs(cfg, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, S, cfg.emb_dim)).astype(np.float32)
    # Sequence 0: one document; sequence 1: two packed documents (positions restart) and padding.
    seg = np.array([[1] * S, [1, 1, 1, 2, 2, 2, 2, 0]], np.int32)
    pos = np.array([list(range(S)), [0, 1, 2, 0, 1, 2, 3, 0]], np.int32)
    return x, pos, seg


# ------------------------------------------------------------------ tests


@pytest.mark.parametrize("q_lora_rank", [48, 0])
def test_shapes(q_lora_rank):
    cfg, p, f = setup(f"q_lora_rank={q_lora_rank}")
    H, K = cfg.base_num_query_heads, cfg.qk_head_dim
    if q_lora_rank:
        assert p["wq_a"].shape == (cfg.emb_dim, 48) and p["wq_b"].shape == (48, H, K) and "wq" not in p
        assert p["q_norm"]["scale"].shape == (48,)
    else:
        assert p["wq"].shape == (cfg.emb_dim, H, K) and "wq_a" not in p and "q_norm" not in p
    assert p["wkv_a"].shape == (cfg.emb_dim, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    assert p["wkv_b"].shape == (cfg.kv_lora_rank, H, cfg.qk_nope_head_dim + cfg.v_head_dim)
    assert p["kv_norm"]["scale"].shape == (cfg.kv_lora_rank,)
    assert p["wo"].shape == (H, cfg.v_head_dim, cfg.emb_dim)
    x, pos, seg = inputs(cfg)
    out = f(p, x, pos, seg)
    assert out.shape == (B, S, cfg.emb_dim) and out.dtype == jnp.float32


@pytest.mark.parametrize(
    "overrides",
    [
        (),
        ("q_lora_rank=0",),
        ("rope_interleave=false", "rope_type=default"),
        ("attention=flash", "attention_block_q=3", "attention_block_kv=5"),  # blocks that do not divide S
    ],
    ids=["qlora", "no_qlora", "halves_plain_rope", "flash"],
)
def test_forward_matches_reference(overrides):
    cfg, p, f = setup(*overrides)
    x, pos, seg = inputs(cfg)
    got = np.asarray(f(p, x, pos, seg))
    want = reference_mla(cfg, p, x, pos, seg)
    assert np.abs(want).mean() > 0.1  # a meaningful, non-degenerate output
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_causal():
    cfg, p, f = setup()
    x, pos, _ = inputs(cfg)
    seg = np.ones((B, S), np.int32)
    base = np.asarray(f(p, x, pos, seg))
    for j in (2, 5, S - 1):
        x2 = x.copy()
        x2[:, j] += 1.0
        out = np.asarray(f(p, x2, pos, seg))
        np.testing.assert_array_equal(out[:, :j], base[:, :j])
        assert np.all(np.abs(out[:, j:] - base[:, j:]).max(axis=-1) > 1e-4)


def test_segments_do_not_see_each_other():
    cfg, p, f = setup()
    x, _, _ = inputs(cfg)
    seg = np.array([[1, 1, 1, 1, 2, 2, 2, 2]] * B, np.int32)
    pos = np.array([[0, 1, 2, 3, 0, 1, 2, 3]] * B, np.int32)
    base = np.asarray(f(p, x, pos, seg))
    x2 = x.copy()
    x2[:, :4] = np.random.default_rng(5).standard_normal(x2[:, :4].shape)
    out = np.asarray(f(p, x2, pos, seg))
    np.testing.assert_allclose(out[:, 4:], base[:, 4:], atol=1e-6)
    assert np.abs(out[:, :4] - base[:, :4]).max() > 1e-2
    # With positions restarting, segment 2 is computed exactly as a sequence on its own.
    alone = np.asarray(f(p, x[:, 4:], pos[:, 4:], seg[:, 4:]))
    np.testing.assert_allclose(base[:, 4:], alone, atol=1e-5)
    # Without the segment ids, segment 2 would see segment 1.
    joined = np.asarray(f(p, x, pos, np.ones_like(seg)))
    assert np.abs(joined[:, 4:] - base[:, 4:]).max() > 1e-3


def test_attention_mask_against_loop():
    seg = np.array([[1, 1, 2, 2, 2, 0], [3, 3, 3, 3, 3, 3]], np.int32)
    got = np.asarray(attention_mask(jnp.asarray(seg)))
    assert got.shape == (2, 1, 6, 6) and got.dtype == np.bool_
    for b in range(2):
        for s in range(6):
            for t in range(6):
                assert got[b, 0, s, t] == (t <= s and seg[b, t] == seg[b, s])
