"""Expert parallelism on 8 simulated devices (fsdp 2 x expert 4) equals one device, dropless.

Every routed copy must be computed wherever its expert lives, including when every token of the
global batch picks the same expert (all of its copies land on one device), for every backend and
every exchange that runs on CPU. ``ragged_all_to_all`` is not implemented by XLA:CPU, so its test
runs the exchange's own code against an emulation of the collective built from ``all_gather``
(``emulated_ragged_all_to_all``, written from the collective's documented semantics).
"""

import functools
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.config import ConfigError
from MaxText.moe.block import MoEBlock
from MaxText.moe.experts import check_backend
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


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    """On device ``me``: from every source s, rows ``[input_offsets_s[me], + send_sizes_s[me])`` of
    s's operand land at ``output_offsets_s[me]`` of ``me``'s output; ``me`` expects ``recv_sizes[s]``
    of them (a receiver expecting fewer loses the rest, so inconsistent sizes fail the test)."""
    me = jax.lax.axis_index(axis_name)
    operands = jax.lax.all_gather(operand, axis_name)  # [ep, N, ...]
    starts, sizes, targets = (
        jax.lax.all_gather(a, axis_name)[:, me] for a in (input_offsets, send_sizes, output_offsets)
    )
    rows = jnp.arange(output.shape[0])
    for s in range(operands.shape[0]):
        j = rows - targets[s]
        arrives = (j >= 0) & (j < jnp.minimum(sizes[s], recv_sizes[s]))
        source_rows = operands[s][jnp.clip(starts[s] + j, 0, operand.shape[0] - 1)]
        output = jnp.where(arrives.reshape(-1, *([1] * (output.ndim - 1))), source_rows, output)
    return output


@functools.cache
def compiled(backend: str, exchange: str):
    """(config, params, one-device step, expert-parallel step), compiled once per backend and exchange."""
    config = make_config(
        f"moe_matmul={backend}", f"moe_ep_comm={exchange}", "moe_block_rows=8", "moe_min_block_rows=2", *MESH
    )
    fn = partial(block_and_grads, config)
    mesh = make_mesh(config, jax.devices())
    params, jitted = random_params(config), jax.jit(fn)

    def expert_parallel(*args):
        with jax.set_mesh(mesh), nn.logical_axis_rules(axis_rules(config)):
            assert "shard_map" in str(jax.make_jaxpr(fn)(*args))  # the expert-parallel path is taken
            return jitted(*args)

    return config, params, jax.jit(fn), expert_parallel


CASES = [
    ("blocked", "allgather"),
    ("ragged_dot", "allgather"),
    ("blocked", "all_to_all"),
    ("ragged_dot", "all_to_all"),
    ("blocked", "ragged_all_to_all"),
]


@pytest.mark.parametrize("backend, exchange", CASES, ids=["-".join(c) for c in CASES])
@pytest.mark.parametrize("kind", ["balanced", "zipf", "all_to_one"])
def test_expert_parallel_matches_one_device(kind, backend, exchange, monkeypatch):
    if exchange == "ragged_all_to_all":
        monkeypatch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)
    config, params, one_device, expert_parallel = compiled(backend, exchange)
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


@pytest.mark.parametrize("exchange", ["ragged_all_to_all", "te"])
def test_gpu_only_exchanges_are_refused_on_cpu_with_a_reason(exchange):
    config = make_config(f"moe_ep_comm={exchange}", *MESH)
    with pytest.raises(ConfigError, match=f"'moe_ep_comm': '?{exchange}'? .*(GPU|Transformer Engine)"):
        check_backend(config, "cpu")
