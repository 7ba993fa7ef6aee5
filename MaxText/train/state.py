"""The train state and its creation directly in its final sharding.

The state is created inside ``jax.jit`` with ``out_shardings`` derived from the parameters'
logical axes, so no device ever holds the full model; the abstract shapes come from
``jax.eval_shape`` first.
"""

from typing import Any, NamedTuple

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from MaxText.config import Config
from MaxText.models.deepseek import DeepSeekV3
from MaxText.moe.block import BIAS
from MaxText.parallel.sharding import axis_rules, logical_to_shardings, replicated


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: Any
    moe_bias: Any  # router score-correction biases; updated from expert loads, not gradients
    opt_state: Any


class StateSetup(NamedTuple):
    state: TrainState
    shardings: TrainState  # the same tree with a NamedSharding per leaf


def dummy_inputs(config: Config, batch: int = 1) -> tuple[jax.Array, jax.Array, jax.Array]:
    S = config.max_target_length
    tokens = jnp.zeros((batch, S), jnp.int32)
    return tokens, jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (batch, S)), jnp.ones((batch, S), jnp.int32)


def _init_variables(model: DeepSeekV3, config: Config, rng: jax.Array) -> dict[str, Any]:
    variables = model.init(rng, *dummy_inputs(config))
    return {"params": variables["params"], BIAS: variables.get(BIAS, {})}


def create_train_state(
    model: DeepSeekV3, config: Config, optimizer: optax.GradientTransformation, mesh: Mesh
) -> StateSetup:
    rng = jax.random.key(config.seed)
    with jax.set_mesh(mesh), nn.logical_axis_rules(axis_rules(config)):
        boxed = jax.eval_shape(lambda r: _init_variables(model, config, r), rng)
        var_shardings = logical_to_shardings(boxed, mesh, config)
        variables = jax.jit(lambda r: nn.unbox(_init_variables(model, config, r)), out_shardings=var_shardings)(rng)

        abstract_opt = jax.eval_shape(optimizer.init, variables["params"])
        opt_shardings = optax.tree_utils.tree_map_params(
            optimizer,
            lambda _, sharding: sharding,
            abstract_opt,
            var_shardings["params"],
            transform_non_params=lambda _: replicated(mesh),
        )
        opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(variables["params"])

    state = TrainState(jnp.zeros((), jnp.int32), variables["params"], variables[BIAS], opt_state)
    shardings = TrainState(replicated(mesh), var_shardings["params"], var_shardings[BIAS], opt_shardings)
    return StateSetup(jax.device_put(state, shardings), shardings)
