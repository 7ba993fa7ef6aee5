"""The dropless MoE block against a per-token reference: forward, gradients and load counts.

The reference routes each token with a numpy loop over the reference doc's steps and computes
``sum_k w_k E_k(x) + S(x)`` token by token (no sorting, no grouped matmul), in jnp so that
``jax.grad`` of it can be compared with the block's gradients.
"""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_config

from MaxText.moe.block import MoEBlock

B, S = 2, 16


def random_params(cfg, seed=0):
    x = jnp.zeros((B, S, cfg.emb_dim), jnp.float32)
    shapes = nn.unbox(jax.eval_shape(lambda: MoEBlock(cfg).init(jax.random.key(0), x)))["params"]
    rng = np.random.default_rng(seed)

    def fill(path, leaf):
        fan_in = leaf.shape[-2]  # [D, F], [F, D], [E, D, F], [E, F, D], router [D, E]
        std = (1.5 if path[-1].key == "router" else 1.0) / math.sqrt(fan_in)
        return jnp.asarray(std * rng.standard_normal(leaf.shape), leaf.dtype)

    return jax.tree_util.tree_map_with_path(fill, shapes)


@functools.cache
def setup(*overrides):
    """(config, params, jitted block forward and gradients), once per config."""
    cfg = make_config(*overrides)

    def block(params, bias, x):
        variables = {"params": params, "moe_bias": {"router": bias}}
        y, state = MoEBlock(cfg).apply(variables, x, mutable=["moe_load", "moe_loss"])
        return y, state["moe_load"]["router"], state["moe_loss"]["router"]

    def block_with_grad(params, bias, x, cot):
        def loss(p, x_):
            y, load, balance = block(p, bias, x_)
            return jnp.sum(y * cot), (y, load, balance)

        (_, outputs), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
        return outputs, grads

    return cfg, random_params(cfg), jax.jit(block_with_grad)


# ------------------------------------------------------------------ reference


def reference_experts(cfg, params, bias, x):
    """[T, K] chosen experts, token by token (float64)."""
    x_TD = np.asarray(x, np.float64).reshape(-1, cfg.emb_dim)
    E, G, K = cfg.num_experts, cfg.n_routing_groups, cfg.num_experts_per_tok
    size = E // G
    out = []
    for x_D in x_TD:
        s = 1 / (1 + np.exp(-(x_D @ np.asarray(params["router"], np.float64))))
        sel = s + np.asarray(bias, np.float64)
        group_score = [np.sort(sel[g * size : (g + 1) * size])[-2:].sum() for g in range(G)]
        kept = np.argsort(group_score)[::-1][: cfg.topk_routing_group]
        allowed = [e for g in kept for e in range(g * size, (g + 1) * size)]
        out.append(sorted(sorted(allowed, key=lambda e: -sel[e])[:K]))
    return np.array(out, np.int32)


def reference_moe(cfg, params, x, experts_TK):
    """Each token t: sum over its K chosen experts e_tk of w_tk * SwiGLU_e(x_t), plus the shared expert.

    ``w_tk`` are the unbiased sigmoid scores of the chosen experts, normalised and scaled. Each token
    gathers its own experts' weight matrices ([T, K, D, F]): no sorting, no grouped matmul.
    """
    x_TD = x.reshape(-1, x.shape[-1])
    s_TE = jax.nn.sigmoid(x_TD @ params["router"])
    w_TK = jnp.take_along_axis(s_TE, experts_TK, axis=1)
    w_TK = w_TK / (w_TK.sum(axis=1, keepdims=True) + 1e-20) * cfg.routed_scaling_factor
    gate_TKF = jnp.einsum("td,tkdf->tkf", x_TD, params["wi_0"][experts_TK])
    up_TKF = jnp.einsum("td,tkdf->tkf", x_TD, params["wi_1"][experts_TK])
    y_TD = jnp.einsum("tkf,tkfd,tk->td", jax.nn.silu(gate_TKF) * up_TKF, params["wo"][experts_TK], w_TK)
    shared = params["shared_experts"]
    y_TD += (jax.nn.silu(x_TD @ shared["wi_0"]) * (x_TD @ shared["wi_1"])) @ shared["wo"]
    return y_TD.reshape(x.shape)


@functools.cache
def reference_with_grad(*overrides):
    """Jitted (y, gradients wrt params and x) of the reference; the routing is an input."""
    cfg = make_config(*overrides)

    def loss(p, x, experts_TK, cot):
        y = reference_moe(cfg, p, x, experts_TK)
        return jnp.sum(y * cot), y

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def reference_balance_loss(cfg, params, x, experts_TK):
    E, K = cfg.num_experts, cfg.num_experts_per_tok
    x = np.asarray(x, np.float64)
    losses = []
    for b in range(B):
        s = 1 / (1 + np.exp(-(x[b] @ np.asarray(params["router"], np.float64))))
        f = E / (K * S) * np.bincount(experts_TK[b * S : (b + 1) * S].ravel(), minlength=E)
        p = (s / s.sum(-1, keepdims=True)).mean(0)
        losses.append((f * p).sum())
    return np.mean(losses)


# ------------------------------------------------------------------ tests


def routing_bias(kind, E):
    if kind == "zipf":
        return 0.8 / np.arange(1, E + 1)  # expert e is preferred in proportion to 1/(e+1)
    if kind == "one_expert":
        return np.eye(E)[0] * 10.0  # every token goes to expert 0 (and 3 others)
    if kind == "one_group":
        return np.repeat([10.0, 0.0], [4, E - 4])  # experts 0..3 (routing group 0) get every token
    return np.random.default_rng(3).standard_normal(E) * 0.05


# Every routed-expert backend that runs on CPU; block sizes that do and do not divide the groups.
BACKENDS = [
    ("moe_matmul=tokamax",),  # tokamax's XLA reference kernels on CPU: the wiring (layout, padding, VJP)
    ("moe_matmul=ragged_dot",),
    ("moe_matmul=blocked", "moe_block_rows=8", "moe_min_block_rows=2"),  # blocks of 8, 4 and 2 rows
    ("moe_matmul=blocked", "moe_block_rows=20", "moe_min_block_rows=5"),  # 20, 10, 5: not powers of two
]


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: "-".join(x.split("=")[1] for x in b))
@pytest.mark.parametrize("kind", ["balanced", "zipf", "one_expert", "one_group"])
def test_moe_block_matches_reference(kind, backend):
    cfg, params, block_with_grad = setup(*backend)
    E, K, T = cfg.num_experts, cfg.num_experts_per_tok, B * S
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((B, S, cfg.emb_dim)), jnp.float32)
    cot = jnp.asarray(rng.standard_normal((B, S, cfg.emb_dim)), jnp.float32)
    bias = jnp.asarray(routing_bias(kind, E), jnp.float32)
    experts = reference_experts(cfg, params, bias, x)
    load_ref = np.bincount(experts.ravel(), minlength=E)
    mean_load = T * K / E

    # The routing case is what it claims to be.
    if kind == "balanced":
        assert load_ref.max() <= 3 * mean_load and np.count_nonzero(load_ref) >= E - 2
    elif kind == "zipf":
        assert load_ref[0] == load_ref.max() >= 3 * mean_load
        assert np.count_nonzero(load_ref < mean_load / 2) >= 3
    elif kind == "one_expert":
        assert load_ref[0] == T
    else:
        np.testing.assert_array_equal(load_ref, [T] * 4 + [0] * (E - 4))

    (y, load, balance), (g_params, g_x) = block_with_grad(params, bias, x, cot)
    (_, y_ref), (ref_params, ref_x) = reference_with_grad()(params, x, jnp.asarray(experts), cot)

    # Forward: every token's output (dropless), and the statistics the block records.
    assert float(jnp.abs(y_ref).mean()) > 0.1
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-5, atol=1e-5)
    assert load.dtype == jnp.int32 and int(load.sum()) == T * K
    np.testing.assert_array_equal(np.asarray(load), load_ref)
    assert float(balance) == pytest.approx(reference_balance_loss(cfg, params, x, experts), rel=1e-5)

    # Gradients wrt the input and every parameter (experts, router, shared expert).
    np.testing.assert_allclose(np.asarray(g_x), np.asarray(ref_x), rtol=1e-4, atol=1e-5)
    flat_ref = dict(jax.tree_util.tree_leaves_with_path(ref_params))
    for path, g in jax.tree_util.tree_leaves_with_path(g_params):
        np.testing.assert_allclose(
            np.asarray(g), np.asarray(flat_ref[path]), rtol=1e-4, atol=1e-5, err_msg=jax.tree_util.keystr(path)
        )
    # Experts that received no tokens get exactly zero gradient; the others do not.
    unused = load_ref == 0
    for name in ("wi_0", "wi_1", "wo"):
        g = np.asarray(g_params[name])
        assert not np.any(g[unused]) and np.all(np.abs(g[~unused]).max(axis=(1, 2)) > 0), name


def test_bias_only_changes_selection():
    """With the bias picking the same experts, the output does not depend on the bias value."""
    cfg, params, block_with_grad = setup()
    x = jnp.asarray(np.random.default_rng(2).standard_normal((B, S, cfg.emb_dim)), jnp.float32)
    (y_a, load_a, _), _ = block_with_grad(params, jnp.zeros(cfg.num_experts).at[:4].set(10.0), x, x)
    (y_b, load_b, _), _ = block_with_grad(params, jnp.zeros(cfg.num_experts).at[:4].set(50.0), x, x)
    np.testing.assert_array_equal(np.asarray(load_a), np.asarray(load_b))
    np.testing.assert_allclose(np.asarray(y_a), np.asarray(y_b), rtol=1e-6, atol=1e-6)


def test_capacity_baseline_drops_exactly_the_overflow():
    """capacity_factor > 0: each expert keeps its first C copies (top-1 choices first); the block
    then equals the reference with the dropped copies' outputs removed."""
    from MaxText.moe.capacity import capacity, dropped_copies
    from MaxText.train.loss import dropped_copies_from_load

    cfg, params, block_with_grad = setup("capacity_factor=1.0")
    E, K, T = cfg.num_experts, cfg.num_experts_per_tok, B * S
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((B, S, cfg.emb_dim)), jnp.float32)
    bias = jnp.asarray(routing_bias("zipf", E), jnp.float32)
    experts = reference_experts(cfg, params, bias, x)
    # Slot k is the token's k-th best choice by selection score (what top-k returns).
    x64 = np.asarray(x, np.float64).reshape(T, -1)
    sel = 1 / (1 + np.exp(-(x64 @ np.asarray(params["router"], np.float64)))) + np.asarray(bias, np.float64)
    experts = np.take_along_axis(experts, np.argsort(-np.take_along_axis(sel, experts, 1), axis=1), axis=1)
    C = capacity(T, K, E, 1.0)
    # Reference queue: slot-major order, an expert keeps its first C copies.
    kept = np.zeros((T, K), bool)
    seen = np.zeros(E, int)
    for k in range(K):
        for t in range(T):
            e = experts[t, k]
            kept[t, k] = seen[e] < C
            seen[e] += 1
    assert int(dropped_copies(jnp.asarray(experts), E, 1.0)) == (~kept).sum() > 0
    (y, load, _), _ = block_with_grad(params, bias, x, x)
    # The training metric recovers the same count from the recorded expert loads.
    assert int(dropped_copies_from_load({"router": load}, T, cfg)) == (~kept).sum()
    # Per-token reference: weights normalised over all K choices, dropped copies contribute nothing.
    x_TD = x.reshape(T, -1)
    e_TK = jnp.asarray(experts)
    s_TE = jax.nn.sigmoid(x_TD @ params["router"])
    w_TK = jnp.take_along_axis(s_TE, e_TK, axis=1)
    w_TK = w_TK / w_TK.sum(axis=1, keepdims=True) * cfg.routed_scaling_factor * jnp.asarray(kept)
    h_TKF = jax.nn.silu(jnp.einsum("td,tkdf->tkf", x_TD, params["wi_0"][e_TK])) * jnp.einsum(
        "td,tkdf->tkf", x_TD, params["wi_1"][e_TK]
    )
    y_ref = jnp.einsum("tkf,tkfd,tk->td", h_TKF, params["wo"][e_TK], w_TK)
    shared = params["shared_experts"]
    y_ref += (jax.nn.silu(x_TD @ shared["wi_0"]) * (x_TD @ shared["wi_1"])) @ shared["wo"]
    np.testing.assert_allclose(np.asarray(y).reshape(T, -1), np.asarray(y_ref), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["blocked", "ragged_dot", "tokamax"])
def test_backends_on_rows_already_grouped_by_expert(backend):
    """The received-rows layout of moe_ep_comm=te: rows sorted by expert, each group padded with
    zero rows to a multiple of the alignment, known only by its group sizes. Every row must come
    out as its expert's SwiGLU, padding rows as zero, with the blocked backend's blocks of 8/4/2."""
    from MaxText.moe.experts import BACKENDS
    from MaxText.moe.te_exchange import group_layout

    cfg = make_config("moe_block_rows=8", "moe_min_block_rows=2")
    E, D, F, align = 4, 6, 5, 4
    rng = np.random.default_rng(0)
    w0, w1 = (jnp.asarray(rng.standard_normal((E, D, F)), jnp.float32) for _ in range(2))
    wo = jnp.asarray(rng.standard_normal((E, F, D)), jnp.float32)
    sizes = [5, 0, 11, 2]  # real rows per expert; groups padded to multiples of 4
    padded = [-(-n // align) * align for n in sizes]
    expert_of_row = np.repeat(np.arange(E), padded)
    real = np.concatenate([np.arange(p) < n for n, p in zip(sizes, padded, strict=True)])
    x = jnp.asarray(rng.standard_normal((sum(padded) + 3, D)) * np.append(real, [0, 0, 0])[:, None], jnp.float32)

    y = BACKENDS[backend](x, w0, w1, wo, group_layout(jnp.asarray(padded, jnp.int32)), cfg)

    for r in range(x.shape[0]):
        if r < len(real) and real[r]:
            e = expert_of_row[r]
            expected = (jax.nn.silu(x[r] @ w0[e]) * (x[r] @ w1[e])) @ wo[e]
            np.testing.assert_allclose(np.asarray(y[r]), np.asarray(expected), rtol=1e-5, atol=1e-5)
        else:
            assert not np.any(np.asarray(y[r])), f"padding row {r} must stay zero"


def _nan_past_groups(a, sizes_E):
    return jnp.where((jnp.arange(a.shape[0]) < sizes_E.sum())[:, None], a, jnp.nan)


def _unwritten_past_groups(ragged_dot):
    """``tokamax_matmul._ragged_dot`` as the GPU kernels behave: the rows past the last group of
    the output, and of the input's gradient, are left unwritten (NaN here: the worst they hold)."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
    def kernel(x, w, sizes_E, kernels):
        return _nan_past_groups(ragged_dot(x, w, sizes_E, kernels), sizes_E)

    def forward(x, w, sizes_E, kernels):
        return kernel(x, w, sizes_E, kernels), (x, w, sizes_E)

    def backward(kernels, residuals, ct):
        x, w, sizes_E = residuals
        _, vjp = jax.vjp(lambda x, w: ragged_dot(x, w, sizes_E, kernels), x, w)
        dx, dw = vjp(ct)
        return _nan_past_groups(dx, sizes_E), dw, None

    kernel.defvjp(forward, backward)
    return kernel


@pytest.mark.parametrize("capacity", [None, 40])
def test_tokamax_rows_left_unwritten_past_the_groups_are_never_read(capacity, monkeypatch):
    """The down projection's output is not zeroed past the last group (``zero_past_groups``):
    with kernels that leave NaN there and in the input's gradient, each token's weighted sum over
    its active copies (inactive ones point past the groups, as do copies outside a pass's window
    when ``capacity`` takes several passes) and every gradient equal a per-token reference."""
    from MaxText.moe import tokamax_matmul
    from MaxText.moe.experts import swiglu_experts

    monkeypatch.setattr(tokamax_matmul, "_ragged_dot", _unwritten_past_groups(tokamax_matmul._ragged_dot))
    cfg = make_config("moe_matmul=tokamax")
    T, E, K, D, F = 24, 6, 3, 8, 5
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
    experts = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(T)]), jnp.int32)
    active = jnp.asarray(rng.random((T, K)) < 0.7)
    weights = jnp.asarray(rng.random((T, K)), jnp.float32)
    wi_0, wi_1 = (jnp.asarray(rng.standard_normal((E, D, F)) / 3, jnp.float32) for _ in range(2))
    wo = jnp.asarray(rng.standard_normal((E, F, D)) / 3, jnp.float32)
    cot = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)

    def moe(x, weights, wi_0, wi_1, wo):
        y = swiglu_experts(x, experts, active, weights, wi_0, wi_1, wo, cfg, "tokamax", capacity)
        return jnp.sum(y * cot), y

    def reference(x, weights, wi_0, wi_1, wo):
        h_TKF = jax.nn.silu(jnp.einsum("td,tkdf->tkf", x, wi_0[experts])) * jnp.einsum("td,tkdf->tkf", x, wi_1[experts])
        y = jnp.einsum("tkf,tkfd,tk->td", h_TKF, wo[experts], weights * active)
        return jnp.sum(y * cot), y

    args = (x, weights, wi_0, wi_1, wo)
    (_, y), grads = jax.jit(jax.value_and_grad(moe, argnums=range(5), has_aux=True))(*args)
    (_, y_ref), ref_grads = jax.value_and_grad(reference, argnums=range(5), has_aux=True)(*args)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-5, atol=1e-5)
    for name, g, g_ref in zip(("x", "weights", "wi_0", "wi_1", "wo"), grads, ref_grads, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=1e-4, atol=1e-5, err_msg=name)
