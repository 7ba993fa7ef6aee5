"""The DeepSeek-V3 router, its balance loss and load counts against per-token numpy reference loops."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_config

from MaxText.moe.router import group_limited_mask, route, sequence_balance_loss, tokens_per_expert


def reference_route(logits, bias, cfg):
    """The reference doc's five steps, one token at a time, in float64.

    Returns (experts, weights, scores) with each token's experts sorted by id (weights to match).
    """
    T, E = logits.shape
    G, topk_groups, K = cfg.n_routing_groups, cfg.topk_routing_group, cfg.num_experts_per_tok
    experts_out, weights_out, scores_out = [], [], []
    for t in range(T):
        row = [float(v) for v in logits[t]]
        # 1. scores (sigmoid, or softmax over the experts)
        if cfg.routed_score_func == "sigmoid":
            s = [1 / (1 + math.exp(-v)) for v in row]
        else:
            z = sum(math.exp(v - max(row)) for v in row)
            s = [math.exp(v - max(row)) / z for v in row]
        # 2. the bias is for selection only
        sel = [s[e] + (float(bias[e]) if cfg.routed_bias else 0.0) for e in range(E)]
        # 3. group-limited: a group's score is the sum of its best two entries; keep the best groups
        size = E // G
        allowed = set(range(E))
        if G > 1:
            group_score = [sum(sorted(sel[g * size : (g + 1) * size], reverse=True)[:2]) for g in range(G)]
            kept = sorted(range(G), key=lambda g: -group_score[g])[:topk_groups]
            allowed = {e for g in kept for e in range(g * size, (g + 1) * size)}
        # 4. top-k among the allowed experts
        chosen = sorted(sorted(allowed, key=lambda e: -sel[e])[:K])
        # 5. weights: unbiased scores, normalised, scaled
        w = [s[e] for e in chosen]
        if cfg.routed_norm_topk_prob:
            total = sum(w) + 1e-20
            w = [v / total for v in w]
        experts_out.append(chosen)
        weights_out.append([v * cfg.routed_scaling_factor for v in w])
        scores_out.append(s)
    return np.array(experts_out), np.array(weights_out), np.array(scores_out)


def sorted_by_expert(experts, weights):
    order = np.argsort(experts, axis=-1)
    return np.take_along_axis(experts, order, -1), np.take_along_axis(weights, order, -1)


def check_route(cfg, logits, bias):
    got = jax.jit(lambda lg, bs: route(lg, bs, cfg))(jnp.asarray(logits, jnp.float32), jnp.asarray(bias, jnp.float32))
    experts, weights = sorted_by_expert(np.asarray(got.experts_TK), np.asarray(got.weights_TK))
    ref_experts, ref_weights, ref_scores = reference_route(logits.astype(np.float32), bias.astype(np.float32), cfg)
    assert got.experts_TK.dtype == jnp.int32
    np.testing.assert_array_equal(experts, ref_experts)
    np.testing.assert_allclose(weights, ref_weights, rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(got.scores_TE), ref_scores, rtol=2e-6, atol=1e-7)
    return ref_experts


def logits_for(cfg, T=64, seed=0):
    return np.random.default_rng(seed).standard_normal((T, cfg.num_experts)) * 2.0


def test_route_tiny_zero_bias():
    cfg = make_config()
    assert (cfg.num_experts, cfg.n_routing_groups, cfg.topk_routing_group, cfg.num_experts_per_tok) == (16, 4, 2, 4)
    check_route(cfg, logits_for(cfg), np.zeros(cfg.num_experts))


def test_route_bias_changes_choice_but_not_weights():
    cfg = make_config()
    logits = logits_for(cfg, seed=1)
    bias = np.random.default_rng(2).standard_normal(cfg.num_experts) * 0.5
    with_bias = check_route(cfg, logits, bias)
    without = check_route(cfg, logits, np.zeros(cfg.num_experts))
    assert np.mean(np.any(with_bias != without, axis=-1)) > 0.3  # the bias really changes choices
    # A bias that is constant within every group changes nothing (groups and top-k are shift-invariant).
    same = check_route(cfg, logits, np.full(cfg.num_experts, 3.0))
    np.testing.assert_array_equal(same, without)


def test_route_group_limit_matters():
    """Group-limited choice differs from a plain top-k over all experts (else the groups are untested)."""
    cfg = make_config()
    logits = logits_for(cfg, seed=3)
    experts = check_route(cfg, logits, np.zeros(cfg.num_experts))
    plain = np.sort(np.argsort(-logits, axis=-1)[:, : cfg.num_experts_per_tok], axis=-1)
    assert np.any(experts != plain)
    # Every token's experts lie in at most topk_routing_group groups.
    size = cfg.num_experts // cfg.n_routing_groups
    assert max(len(set(row // size)) for row in experts) <= cfg.topk_routing_group


def test_route_671b_shape():
    cfg = make_config(model="deepseek3-671b")
    logits = logits_for(cfg, T=16, seed=4)
    bias = np.random.default_rng(5).standard_normal(cfg.num_experts) * 0.1
    check_route(cfg, logits, bias)


def test_route_one_group():
    cfg = make_config("n_routing_groups=1", "topk_routing_group=1")
    logits = logits_for(cfg, seed=6)
    bias = np.random.default_rng(7).standard_normal(cfg.num_experts) * 0.3
    experts = check_route(cfg, logits, bias)
    plain = np.sort(np.argsort(-(1 / (1 + np.exp(-logits)) + bias), axis=-1)[:, :4], axis=-1)
    np.testing.assert_array_equal(experts, plain)


@pytest.mark.parametrize("routed_bias", ["true", "false"])
def test_route_softmax(routed_bias):
    cfg = make_config("routed_score_func=softmax", f"routed_bias={routed_bias}")
    bias = np.random.default_rng(8).standard_normal(cfg.num_experts)
    check_route(cfg, logits_for(cfg, seed=9), bias)


def test_route_unnormalised_weights():
    cfg = make_config("routed_norm_topk_prob=false", "routed_scaling_factor=1.0")
    check_route(cfg, logits_for(cfg, seed=10), np.zeros(cfg.num_experts))


def test_group_limited_mask():
    sel = np.array([[0.9, 0.0, 0.0, 0.0, 0.5, 0.5, 0.0, 0.0, 0.1, 0.1, 0.1, 0.1]])
    # groups of 4: best-two sums 0.9, 1.0, 0.2 -> keep groups 1 and 0
    got = np.asarray(group_limited_mask(jnp.asarray(sel), 3, 2))
    np.testing.assert_array_equal(got[0], [True] * 8 + [False] * 4)
    got = np.asarray(group_limited_mask(jnp.asarray(sel), 3, 1))
    np.testing.assert_array_equal(got[0], [False] * 4 + [True] * 4 + [False] * 4)


def test_tokens_per_expert():
    experts = np.random.default_rng(11).integers(0, 16, size=(40, 4))
    got = np.asarray(tokens_per_expert(jnp.asarray(experts, jnp.int32), 16))
    np.testing.assert_array_equal(got, np.bincount(experts.ravel(), minlength=16))
    assert got.sum() == 160


def reference_balance_loss(scores, experts):
    B, S, E = scores.shape
    K = experts.shape[-1]
    losses = []
    for b in range(B):
        counts = np.zeros(E)
        for t in range(S):
            for k in range(K):
                counts[experts[b, t, k]] += 1
        f = E / (K * S) * counts
        P = np.zeros(E)
        for t in range(S):
            P += scores[b, t] / scores[b, t].sum()
        P /= S
        losses.append(float((f * P).sum()))
    return np.mean(losses)


balance_loss = jax.jit(sequence_balance_loss)


def test_sequence_balance_loss():
    B, S, E, K = 3, 8, 16, 4
    rng = np.random.default_rng(12)
    scores = 1 / (1 + np.exp(-2 * rng.standard_normal((B, S, E))))
    experts = np.argsort(rng.standard_normal((B, S, E)), axis=-1)[..., :K]  # K distinct experts per token
    got = float(balance_loss(jnp.asarray(scores, jnp.float32), jnp.asarray(experts, jnp.int32)))
    assert got == pytest.approx(reference_balance_loss(scores, experts), rel=1e-5)
    # Per sequence, not over the whole batch: skew that cancels across the batch still costs.
    skew = np.zeros((B, S, K), np.int32)
    skew[0], skew[1], skew[2] = [0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]
    chosen = np.zeros((B, 1, E), bool)
    np.put_along_axis(chosen, skew[:, :1], True, axis=-1)
    skew_scores = np.where(chosen, 0.9, 0.1) + 0.05 * rng.random((B, S, E))  # routed experts score high
    got = float(balance_loss(jnp.asarray(skew_scores, jnp.float32), jnp.asarray(skew)))
    assert got == pytest.approx(reference_balance_loss(skew_scores, skew), rel=1e-5)
    batch_f = E / (K * B * S) * np.bincount(skew.ravel(), minlength=E)
    batch_wide = (batch_f * (skew_scores / skew_scores.sum(-1, keepdims=True)).mean((0, 1))).sum()
    assert got > 2 and abs(got - batch_wide) > 0.5
    # Perfect balance with uniform scores gives exactly 1.
    balanced = np.arange(B * S * K).reshape(B, S, K) % E
    assert float(balance_loss(jnp.full((B, S, E), 0.3), jnp.asarray(balanced, jnp.int32))) == pytest.approx(1.0)


def test_sequence_balance_loss_gradient():
    """The gradient flows only through P (f is a count): d/ds of sum_i f_i mean_t s_ti / sum_j s_tj."""
    E, K, S = 8, 2, 4
    experts = np.array([[[0, 1], [2, 3], [4, 5], [6, 1]]], np.int32)
    scores = np.abs(np.random.default_rng(14).standard_normal((1, S, E))) + 0.1
    f = E / (K * S) * np.bincount(experts.ravel(), minlength=E)
    grad_fn = jax.jit(jax.grad(sequence_balance_loss))
    grad = np.asarray(grad_fn(jnp.asarray(scores, jnp.float32), jnp.asarray(experts)))
    total = scores.sum(-1, keepdims=True)
    want = (f / total - (scores * f).sum(-1, keepdims=True) / total**2) / S
    np.testing.assert_allclose(grad, want, rtol=1e-4, atol=1e-7)


def test_padding_takes_no_part_in_loads_and_balance_loss():
    """Masked tokens are left out of the counts and of both f and P (per-sequence token counts)."""
    B, S, E, K = 2, 6, 8, 2
    rng = np.random.default_rng(15)
    scores = 1 / (1 + np.exp(-rng.standard_normal((B, S, E))))
    experts = np.argsort(rng.standard_normal((B, S, E)), axis=-1)[..., :K]
    valid = np.array([[1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]], bool)
    got = np.asarray(tokens_per_expert(jnp.asarray(experts.reshape(B * S, K)), E, jnp.asarray(valid.reshape(-1))))
    np.testing.assert_array_equal(got, np.bincount(experts[valid].ravel(), minlength=E))
    masked = float(jax.jit(sequence_balance_loss)(jnp.asarray(scores, jnp.float32), jnp.asarray(experts), valid))
    per_sequence = [reference_balance_loss(scores[b : b + 1, valid[b]], experts[b : b + 1, valid[b]]) for b in range(B)]
    assert masked == pytest.approx(np.mean(per_sequence), rel=1e-5)
    unmasked = float(balance_loss(jnp.asarray(scores, jnp.float32), jnp.asarray(experts)))
    assert abs(unmasked - masked) > 1e-3  # the padding would have counted
    # A sequence of padding alone contributes 0 but still counts in the mean over sequences.
    none = valid.copy()
    none[1] = False
    alone = float(jax.jit(sequence_balance_loss)(jnp.asarray(scores, jnp.float32), jnp.asarray(experts), none))
    assert alone == pytest.approx(per_sequence[0] / 2, rel=1e-5)
