"""The whole tiny model's gradient against central finite differences in float64."""

from functools import partial

import flax.linen as nn
import jax
import numpy as np
import pytest

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


@pytest.mark.slow
def test_remat_policies_give_the_same_gradients():
    """Recomputation changes what is stored for the backward pass, never the result."""
    grads = {}
    for policy in ("none", "full"):
        config = make_config(
            f"remat_policy={policy}", "max_target_length=8", "mtp_num_layers=0", "base_num_decoder_layers=2"
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
        grads[policy] = jax.jit(jax.grad(partial(_loss, model, config, variables[BIAS], batch)))(variables["params"])
    for a, b in zip(jax.tree.leaves(grads["none"]), jax.tree.leaves(grads["full"]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def _loss(model, config, bias, batch, params):
    return compute_loss(model, config, params, bias, batch).loss
