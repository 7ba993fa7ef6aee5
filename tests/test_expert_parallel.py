"""Expert parallelism on 8 simulated devices (fsdp 2 x expert 4) equals one device, dropless.

Every routed copy must be computed wherever its expert lives, including when every token of the
global batch picks the same expert (all of its copies land on one device).
"""

import functools
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.moe.block import MoEBlock
from MaxText.parallel.mesh import make_mesh
from MaxText.parallel.sharding import axis_rules
from tests.conftest import make_config
from tests.test_moe_block import random_params

B, S = 4, 16
MESH = ("ici_fsdp_parallelism=2", "ici_expert_parallelism=4")


def block_and_grads(config, params, bias, x):
    def loss(p, x_):
        variables = {"params": p, "moe_bias": {"router": bias}}
        y, state = MoEBlock(config).apply(variables, x_, mutable=["moe_load", "moe_loss"])
        return jnp.sum(y * jnp.cos(x_)), (y, state["moe_load"]["router"])

    return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)


def routing_bias(kind: str, num_experts: int) -> np.ndarray:
    if kind == "all_to_one":
        return np.eye(num_experts)[0] * 10.0  # every token's top-1 is expert 0
    if kind == "zipf":
        return 0.8 / (np.arange(num_experts) + 1.0) ** 1.2
    return np.random.default_rng(3).standard_normal(num_experts) * 0.05


@functools.cache
def compiled(backend: str):
    """(config, params, one-device step, expert-parallel step), compiled once per backend."""
    config = make_config(f"moe_matmul={backend}", "moe_block_rows=8", "moe_min_block_rows=2", *MESH)
    fn = partial(block_and_grads, config)
    mesh = make_mesh(config, jax.devices())
    params, jitted = random_params(config), jax.jit(fn)

    def expert_parallel(*args):
        with jax.set_mesh(mesh), nn.logical_axis_rules(axis_rules(config)):
            assert "shard_map" in str(jax.make_jaxpr(fn)(*args))  # the expert-parallel path is taken
            return jitted(*args)

    return config, params, jax.jit(fn), expert_parallel


@pytest.mark.parametrize("backend", ["blocked", "ragged_dot"])
@pytest.mark.parametrize("kind", ["balanced", "zipf", "all_to_one"])
def test_expert_parallel_matches_one_device(kind, backend):
    config, params, one_device, expert_parallel = compiled(backend)
    x = jnp.asarray(np.random.default_rng(7).standard_normal((B, S, config.emb_dim)), jnp.float32)
    bias = jnp.asarray(routing_bias(kind, config.num_experts), jnp.float32)

    (_, (y_one, load_one)), grads_one = one_device(params, bias, x)
    (_, (y_ep, load_ep)), grads_ep = expert_parallel(params, bias, x)

    if kind == "all_to_one":
        assert int(load_one[0]) == B * S  # every token of the global batch chose expert 0
    np.testing.assert_array_equal(np.asarray(load_ep), np.asarray(load_one))
    np.testing.assert_allclose(np.asarray(y_ep), np.asarray(y_one), rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(grads_ep), jax.tree.leaves(grads_one), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
