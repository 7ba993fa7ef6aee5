"""The train state and its creation directly in its final sharding.

The state is created inside ``jax.jit`` with ``out_shardings`` derived from the parameters'
logical axes, so no device ever holds the full model; the abstract shapes come from
``jax.eval_shape`` first.
"""

from functools import partial
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

    @property
    def variables(self) -> dict[str, Any]:
        """The model's variables, ``{"params": ..., BIAS: ...}``, as the model and the accounting read them."""
        return {"params": self.params, BIAS: self.moe_bias}


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


def _shapes_and_shardings(model: DeepSeekV3, config: Config, optimizer: optax.GradientTransformation, mesh: Mesh):
    """(shapes, a NamedSharding per leaf) of the train state, from one abstract trace of the
    model's initialisation (call under the mesh and rules)."""
    boxed = jax.eval_shape(lambda r: _init_variables(model, config, r), jax.random.key(config.seed))
    var_shardings = logical_to_shardings(boxed, mesh, config)
    params = _shapes(boxed["params"])
    opt_shapes = jax.eval_shape(optimizer.init, params)
    opt_shardings = optax.tree_utils.tree_map_params(
        optimizer,
        lambda _, sharding: sharding,
        opt_shapes,
        var_shardings["params"],
        transform_non_params=lambda _: replicated(mesh),
    )
    shapes = TrainState(jax.ShapeDtypeStruct((), jnp.int32), params, _shapes(boxed[BIAS]), opt_shapes)
    return shapes, TrainState(replicated(mesh), var_shardings["params"], var_shardings[BIAS], opt_shardings)


def _shapes(boxed_tree: Any) -> Any:
    """The shapes inside logical-axis boxes (``nn.unbox`` would apply sharding constraints, which
    abstract shapes under a mesh cannot take)."""
    is_box = lambda x: isinstance(x, nn.Partitioned)  # noqa: E731
    return jax.tree.map(lambda x: x.value if is_box(x) else x, boxed_tree, is_leaf=is_box)


def _new_state(model: DeepSeekV3, config: Config, optimizer: optax.GradientTransformation, rng: jax.Array):
    variables = nn.unbox(_init_variables(model, config, rng))
    params = variables["params"]
    return TrainState(jnp.zeros((), jnp.int32), params, variables[BIAS], optimizer.init(params))


def create_train_state(
    model: DeepSeekV3,
    config: Config,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    abstract: TrainState | None = None,
) -> StateSetup:
    """The initialised state, each leaf created on its devices with the sharding of ``abstract``
    (``abstract_train_state``'s; pass it when you have it, so the model's initialisation is not
    traced a second time)."""
    if abstract is None:
        abstract = abstract_train_state(model, config, optimizer, mesh)
    shardings = jax.tree.map(lambda leaf: leaf.sharding, abstract)
    with jax.set_mesh(mesh), nn.logical_axis_rules(axis_rules(config)):
        new_state = jax.jit(partial(_new_state, model, config, optimizer), out_shardings=shardings)
        state = new_state(jax.random.key(config.seed))
    return StateSetup(state, shardings)


def abstract_train_state(
    model: DeepSeekV3, config: Config, optimizer: optax.GradientTransformation, mesh: Mesh
) -> TrainState:
    """The train state as shapes, dtypes and shardings, nothing allocated: what a restore fills.
    Built under the mesh's abstract form, so that the few eager operations on the way (the
    optimizer's step count, the key) run on the host's default device: the mesh may then be one of
    compile-only devices (a GPU target compiled on a CPU host)."""
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), nn.logical_axis_rules(axis_rules(config)):
        shapes, shardings = _shapes_and_shardings(model, config, optimizer, mesh)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)
