"""Small helpers every layer shares: dtypes and logically-partitioned parameters.

Layers name *logical* axes only (``embed``, ``heads``, ``exp`` ...); ``logical_axis_rules``
in base.yml decides which mesh axes they land on.
"""

import functools
import importlib
from collections.abc import Sequence

import flax.linen as nn
import jax.numpy as jnp

from MaxText.config import Config
from MaxText.quantization import linear, recipe_of


def activation_dtype(config: Config) -> jnp.dtype:
    """The dtype activations and matmul inputs use (``dtype: auto`` must be resolved first)."""
    if config.dtype == "auto":
        raise ValueError("dtype 'auto' must be resolved with Config.with_platform before building the model")
    return jnp.dtype(config.dtype)


def weight_dtype(config: Config) -> jnp.dtype:
    return jnp.dtype(config.weight_dtype)


def float32_or_wider(dtype: jnp.dtype) -> jnp.dtype:
    """Router logits, softmax and norm statistics run in at least float32."""
    return jnp.promote_types(jnp.float32, dtype)


def kernel_init(config: Config, logical_axes: Sequence[str]) -> nn.initializers.Initializer:
    """Normal init with std ``init_weights_std`` (0.006 in the report), tagged with its logical axes."""
    init = nn.initializers.normal(stddev=config.init_weights_std)
    return nn.with_logical_partitioning(init, tuple(logical_axes))


def param(module: nn.Module, name: str, config: Config, shape: Sequence[int], logical_axes: Sequence[str]):
    """Declare a matrix parameter of ``weight_dtype``; returns it cast to the activation dtype."""
    value = module.param(name, kernel_init(config, logical_axes), tuple(shape), weight_dtype(config))
    return jnp.asarray(value, activation_dtype(config))


def project(
    module: nn.Module,
    name: str,
    config: Config,
    x: jnp.ndarray,
    shape: Sequence[int],
    logical_axes: Sequence[str],
    contract: int = 1,
) -> jnp.ndarray:
    """``x`` contracted over its last ``contract`` dims with a new weight ``name`` (declared as
    ``param`` does): a tensordot, or FP8 GEMMs when ``quantization`` asks (``quantization.linear``;
    its cuDNN GEMMs leave the weight gradient split as the weight is stored where the mesh allows)."""
    w = param(module, name, config, shape, logical_axes)
    return linear(x, w, recipe_of(config), contract, logical_axes)


@functools.cache  # an import that failed once fails again; don't retry it at every trace
def import_error(module: str) -> str | None:
    """Why an optional (GPU-only) module such as ``transformer_engine.jax`` cannot be imported
    here, in one line, or None if it can."""
    try:
        importlib.import_module(module)
    except Exception as err:  # ImportError, or a CUDA library missing underneath it
        return f"{type(err).__name__}: {err}".splitlines()[0]
    return None
