"""Multi-token prediction: the shift, the wiring of module 1 and what its logits depend on."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from conftest import make_config

from MaxText.models.decoder import DecoderLayer
from MaxText.models.deepseek import DeepSeekV3, shift_left

B, S = 2, 8
MUTABLE = ["moe_load", "moe_loss"]


@functools.cache
def setup():
    """(config, variables with random O(1)-signal values, jitted model apply with captured intermediates)."""
    # One (dense) main layer keeps compile time down; the MTP module has its own MoE layer.
    cfg = make_config("mtp_num_layers=1", "base_num_decoder_layers=1", "first_num_dense_layers=1")
    tokens = jnp.zeros((B, S), jnp.int32)
    shapes = nn.unbox(jax.eval_shape(lambda: DeepSeekV3(cfg).init(jax.random.key(0), tokens, tokens, tokens)))
    rng = np.random.default_rng(0)

    def fill(path, leaf):
        name = path[-1].key
        if path[0].key == "moe_bias":
            return jnp.asarray(0.05 * rng.standard_normal(leaf.shape), leaf.dtype)
        if path[0].key != "params":
            return jnp.zeros(leaf.shape, leaf.dtype)
        if name == "scale":  # norm scales differ from one, so swapped or missing norms show
            return jnp.asarray(1 + 0.3 * rng.standard_normal(leaf.shape), leaf.dtype)
        std = 1.0 if name == "token_embedding" else 0.15
        return jnp.asarray(std * rng.standard_normal(leaf.shape), leaf.dtype)

    variables = jax.tree_util.tree_map_with_path(fill, shapes)

    @jax.jit
    def model(variables, tokens, positions, segments):
        out, state = DeepSeekV3(cfg).apply(
            variables, tokens, positions, segments, capture_intermediates=True, mutable=[*MUTABLE, "intermediates"]
        )
        # The main model's last hidden state (before the final norm): the output of the last stack.
        last_stack = "moe_layers" if cfg.num_moe_layers else "dense_layers"
        hidden = state["intermediates"][last_stack]["__call__"][0]
        return out.logits_BSV, out.mtp_logits_NBSV, hidden

    return cfg, variables, model


def inputs(cfg, seed=1):
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, size=(B, S)).astype(np.int32)
    positions = np.broadcast_to(np.arange(S, dtype=np.int32), (B, S)).copy()
    return tokens, positions, np.ones((B, S), np.int32)


def rms(x, scale, eps):
    return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def test_shift_left():
    x = jnp.arange(12).reshape(2, 6)
    for k in (1, 2):
        got = np.asarray(shift_left(x, k))
        np.testing.assert_array_equal(got[:, : 6 - k], np.asarray(x)[:, k:])


@functools.cache
def reference_mtp_logits():
    """Jitted: MTP-1 logits at positions 0..S-2, recomputed from the params and the main hidden state."""
    cfg, _, _ = setup()
    eps = cfg.normalization_layer_epsilon

    @jax.jit
    def reference(variables, tokens, positions, segments, h):
        p, mtp = variables["params"], variables["params"]["mtp_1"]
        # h'_i = W_eh [norm(Emb(t_{i+1})) ; norm(h_i)], embedding half first (shared embedding).
        e = rms(p["token_embedding"][tokens[:, 1:]], mtp["embedding_norm"]["scale"], eps)
        hn = rms(h[:, :-1], mtp["hidden_norm"]["scale"], eps)
        h_prime = jnp.concatenate([e, hn], axis=-1) @ mtp["projection"]
        # One decoder layer with the MoE FFN; it is causal, so the S-1 prefix gives the same rows.
        layer_vars = {"params": mtp["layer"], "moe_bias": variables["moe_bias"]["mtp_1"]["layer"]}
        (out, _), _ = DecoderLayer(cfg, use_moe=True).apply(
            layer_vars, h_prime, positions[:, :-1], segments[:, :-1], mutable=MUTABLE
        )
        # The module's own final norm, then the shared output head.
        return rms(out, mtp["final_norm"]["scale"], eps) @ p["output_head"]

    return reference


def test_mtp_module_against_reference():
    cfg, variables, model = setup()
    p = variables["params"]
    tokens, positions, segments = inputs(cfg)
    main_logits, mtp_logits, h = model(variables, tokens, positions, segments)
    assert main_logits.shape == (B, S, cfg.vocab_size) and mtp_logits.shape == (1, B, S, cfg.vocab_size)
    assert h.shape == (B, S, cfg.emb_dim)

    # h is the hidden state before the final norm: the main head reproduces the main logits from it.
    main_ref = rms(h, p["final_norm"]["scale"], cfg.normalization_layer_epsilon) @ p["output_head"]
    np.testing.assert_allclose(np.asarray(main_ref), np.asarray(main_logits), rtol=1e-4, atol=1e-4)

    want = np.asarray(reference_mtp_logits()(variables, tokens, positions, segments, h))
    got = np.asarray(mtp_logits[0, :, :-1])
    assert np.abs(want).mean() > 0.1
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)

    # The other order of the halves ([norm(h); norm(e)] @ W = [norm(e); norm(h)] @ W with its row halves
    # swapped) gives different logits, so the check above tells the orders apart.
    swapped = jax.tree_util.tree_map(lambda a: a, variables)
    swapped["params"]["mtp_1"]["projection"] = jnp.roll(p["mtp_1"]["projection"], cfg.emb_dim, axis=0)
    other_order = np.asarray(reference_mtp_logits()(swapped, tokens, positions, segments, h))
    assert np.abs(other_order - got).max() > 1e-2


def test_mtp_dependence_structure():
    """MTP logits at i depend on tokens <= i+1 (and on token i+1); main logits at i on tokens <= i."""
    cfg, variables, model = setup()
    tokens, positions, segments = inputs(cfg)
    main_base, mtp_base, _ = (np.asarray(a) for a in model(variables, tokens, positions, segments))
    mtp_base = mtp_base[0, :, : S - 1]  # the last position's target lies beyond the sequence (masked by callers)
    for j in (1, 3, 6, S - 1):
        changed = tokens.copy()
        changed[:, j] = (changed[:, j] + 1 + np.arange(B) * 7) % cfg.vocab_size
        main, mtp, _ = (np.asarray(a) for a in model(variables, changed, positions, segments))
        mtp = mtp[0, :, : S - 1]
        # MTP at i < j-1 does not see token j; at i = j-1 (it is t_{i+1}) and later it does.
        np.testing.assert_allclose(mtp[:, : j - 1], mtp_base[:, : j - 1], atol=1e-5)
        assert np.all(np.abs(mtp[:, j - 1 :] - mtp_base[:, j - 1 :]).max(axis=-1) > 1e-3), j
        # The main model is causal in the usual way.
        np.testing.assert_allclose(main[:, :j], main_base[:, :j], atol=1e-5)
        assert np.all(np.abs(main[:, j:] - main_base[:, j:]).max(axis=-1) > 1e-3), j
