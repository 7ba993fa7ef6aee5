"""The whole tiny model's gradient against central finite differences in float64."""

import contextlib
import io
from collections import Counter
from functools import partial

import flax.linen as nn
import jax
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

from MaxText.layers.saveable import SAVEABLE
from MaxText.models.deepseek import DeepSeekV3
from MaxText.moe.block import BIAS
from MaxText.train.loss import compute_loss
from tests.conftest import make_config

# (path in the params tree, index of the entry to perturb)
PROBES = [
    (("token_embedding",), (3, 5)),
    (("dense_layers", "layers", "attention", "wq_b"), (0, 7, 1, 20)),
    (("moe_layers", "layers", "attention", "wkv_a"), (0, 10, 35)),
    (("moe_layers", "layers", "moe", "wi_0"), (0, "busiest", 11, 4)),
    (("moe_layers", "layers", "moe", "router"), (0, 9, 3)),
    (("moe_layers", "layers", "moe", "shared_experts", "wo"), (0, 5, 17)),
    (("moe_layers", "layers", "pre_ffn_norm", "scale"), (0, 6)),
    (("mtp_1", "projection"), (100, 3)),
    (("output_head",), (12, 40)),
]


def _get(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def _set(tree, path, value):
    if len(path) == 1:
        return {**tree, path[0]: value}
    return {**tree, path[0]: _set(tree[path[0]], path[1:], value)}


@pytest.mark.parametrize("probe", range(len(PROBES)))
def test_gradient_matches_finite_differences(probe, gradient_setup):
    loss_fn, params, grads = gradient_setup
    path, index = PROBES[probe]
    leaf = np.asarray(_get(params, path))
    if "busiest" in index:  # an expert that tokens were actually routed to in this batch
        expert_grads = np.abs(np.asarray(_get(grads, path))[index[0]]).sum(axis=(1, 2))
        index = (index[0], int(expert_grads.argmax()), *index[2:])
    eps = 1e-6

    def loss_at(delta):
        moved = leaf.copy()
        moved[index] += delta
        return float(loss_fn(_set(params, path, moved)))

    numeric = (loss_at(eps) - loss_at(-eps)) / (2 * eps)
    analytic = float(np.asarray(_get(grads, path))[index])
    assert abs(numeric - analytic) <= 1e-6 + 1e-4 * abs(numeric), (path, numeric, analytic)
    assert abs(analytic) > 1e-9, f"probe {path} has no gradient; pick a live entry"


@pytest.fixture(scope="module")
def gradient_setup():
    with jax.enable_x64(True):
        config = make_config(
            "dtype=float64",
            "weight_dtype=float64",
            "max_target_length=12",
            "load_balance_loss_weight=0.01",
            "base_num_decoder_layers=2",  # one dense and one MoE layer (plus the MTP module's MoE layer)
        )
        model = DeepSeekV3(config)
        rng = np.random.default_rng(0)
        B, S = 2, config.max_target_length
        tokens = rng.integers(0, config.vocab_size, (B, S + 1))
        tokens[0, 0] = 3  # the embedding row probed below
        batch = {
            "inputs": tokens[:, :-1],
            "targets": tokens[:, 1:],
            "inputs_position": np.broadcast_to(np.arange(S), (B, S)),
            "inputs_segmentation": np.ones((B, S), np.int32),
            "targets_segmentation": np.ones((B, S), np.int32),
        }
        variables = jax.jit(model.init)(  # one compile instead of op-by-op (about 30 s)
            jax.random.key(0), batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"]
        )
        variables = nn.unbox(variables)
        params = jax.tree.map(np.asarray, variables["params"])
        bias = jax.tree.map(lambda b: np.asarray(b) + rng.uniform(0, 0.05, b.shape), variables[BIAS])
        loss_fn = jax.jit(lambda p: compute_loss(model, config, p, bias, batch).loss)
        grads = jax.jit(jax.grad(lambda p: compute_loss(model, config, p, bias, batch).loss))(params)
        yield loss_fn, params, grads


def _remat_setup(*overrides: str):
    """The tiny model (one dense and one MoE layer, grouped GEMMs through ``ragged_dot`` and
    attention through ``flash`` so that the routed experts' projections and the attention kernel's
    residuals are named ones) under ``overrides``: (model, config, batch, variables)."""
    config = make_config(
        *overrides,
        "max_target_length=8",
        "mtp_num_layers=0",
        "base_num_decoder_layers=2",
        "moe_matmul=ragged_dot",
        "attention=flash",
    )
    model = DeepSeekV3(config)
    tokens = np.arange(16).reshape(2, 8) % config.vocab_size
    batch = {
        "inputs": tokens,
        "targets": (tokens + 1) % config.vocab_size,
        "inputs_position": np.broadcast_to(np.arange(8), (2, 8)),
        "inputs_segmentation": np.ones((2, 8), np.int32),
        "targets_segmentation": np.ones((2, 8), np.int32),
    }
    variables = nn.unbox(
        jax.jit(model.init)(jax.random.key(0), tokens, batch["inputs_position"], batch["inputs_segmentation"])
    )
    return model, config, batch, variables


@pytest.mark.slow
def test_remat_policies_give_the_same_gradients():
    """Recomputation changes what is stored for the backward pass, never the result."""
    grads = {}
    for policy in ("none", "full", "minimal", "names"):
        model, config, batch, variables = _remat_setup(f"remat_policy={policy}")
        grads[policy] = jax.jit(jax.grad(partial(_loss, model, config, variables[BIAS], batch)))(variables["params"])
    for policy in ("full", "minimal", "names"):
        for a, b in zip(jax.tree.leaves(grads["none"]), jax.tree.leaves(grads[policy]), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=policy)


def _kept_shapes(names: list[str]) -> Counter:
    """The shapes of what the tiny model keeps for its backward pass under ``remat_policy=names``."""
    model, config, batch, variables = _remat_setup("remat_policy=names", f"remat_names=[{','.join(names)}]")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        print_saved_residuals(partial(_loss, model, config, variables[BIAS], batch), variables["params"])
    return Counter(line.split()[0] for line in printed.getvalue().splitlines() if "argument" not in line)


def test_remat_names_keep_exactly_the_tensors_they_name():
    """Dropping one name from ``remat_names`` drops exactly that tensor (in every layer that makes
    it) from what the step keeps, and keeps nothing else instead."""
    c = make_config()
    H, F = c.base_num_query_heads, c.base_moe_mlp_dim
    copies = 2 * 8 * c.num_experts_per_tok

    def per_token(*tails):  # [layers 1, batch 2, sequence 8, ...] in the dense and the MoE stack
        return [(1, 2, 8, *tail) for tail in tails for _ in range(2)]

    expected = {
        "query_latent": per_token((c.q_lora_rank,)),
        "key_value_latent": per_token((c.kv_lora_rank + c.qk_rope_head_dim,)),
        "query": per_token((H, c.qk_head_dim)),
        "key_value": per_token((H, c.qk_nope_head_dim + c.v_head_dim)),
        # flash's output and its log-sum-exp [layers, batch, heads, sequence]
        "attention": per_token((H, c.v_head_dim)) + [(1, 2, H, 8)] * 2,
        "attention_out": per_token((c.emb_dim,)),
        "router_logits": per_token((c.num_experts,))[:1],
        "mlp_gate_up": per_token((c.base_mlp_dim,), (c.shared_experts * F,)),
        "routed_gate_up": None,  # [layers, rows, F]: one row per routed copy (and the layout's trailing row)
    }
    assert set(expected) == set(SAVEABLE)
    everything = _kept_shapes(list(SAVEABLE))
    for name, want in expected.items():
        fewer = _kept_shapes([n for n in SAVEABLE if n != name])
        assert not fewer - everything, (name, fewer - everything)
        shapes = [
            tuple(int(d) for d in s.split("[")[1].rstrip("]").split(",")) for s in (everything - fewer).elements()
        ]
        if want is None:
            assert len(shapes) == 2 and all(s[0] == 1 and s[1] >= copies and s[2] == F for s in shapes), shapes
        else:
            assert sorted(shapes) == sorted(want), (name, shapes)


def _loss(model, config, bias, batch, params):
    return compute_loss(model, config, params, bias, batch).loss
