"""The routed experts behind one function: dispatch, grouped SwiGLU matmuls, weighted combine.

Backends are chosen by ``moe_matmul`` and share one signature; the seam is the whole routed-expert
computation rather than a single grouped matmul because a backend's best layout decides the
dispatch too (the blocked backend pads groups to whole blocks in the same gather that sorts).

- ``blocked``: block-padded groups and a scan of dense matmuls (ours; portable; CPU default).
- ``ragged_dot``: XLA's grouped matmul over the sorted, unpadded layout (GPU/TPU).
- ``te``: Transformer Engine's grouped GEMM (GPU; imported only when chosen).
- ``auto``: ``te`` on GPU when it imports, else ``ragged_dot`` on GPU/TPU, else ``blocked``.

``capacity_factor > 0`` replaces all of them with the token-dropping baseline (``capacity.py``).
With an expert mesh axis larger than 1, the backend runs per device inside ``shard_map`` on that
device's experts (``expert_parallel.py``).

Shape legend: T tokens, K experts per token, E experts, D model dim, F expert hidden dim,
P padded rows.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp

from MaxText.config import Config, ConfigError
from MaxText.moe.blocked import block_matmul
from MaxText.moe.capacity import capacity_experts
from MaxText.moe.dispatch import block_layout, from_blocks, to_blocks
from MaxText.moe.expert_parallel import allgather_experts, expert_axis

RoutedExperts = Callable[..., jax.Array]


def _blocked(x_TD, experts_TK, active_TK, wi_0, wi_1, wo, config: Config) -> jax.Array:
    layout = block_layout(experts_TK, wi_0.shape[0], config.moe_block_rows, active_TK)
    xp_PD = to_blocks(x_TD, layout)
    blocks = (layout.expert_NB, layout.used_blocks)
    gate_PF = block_matmul(xp_PD, wi_0, *blocks)
    up_PF = block_matmul(xp_PD, wi_1, *blocks)
    return from_blocks(block_matmul(jax.nn.silu(gate_PF) * up_PF, wo, *blocks), layout)


def _ragged_dot(x_TD, experts_TK, active_TK, wi_0, wi_1, wo, config: Config) -> jax.Array:
    layout = block_layout(experts_TK, wi_0.shape[0], 1, active_TK)  # sorted, no padding
    xs_PD = to_blocks(x_TD, layout)
    sizes_E = layout.sizes_E
    gate_PF = jax.lax.ragged_dot(xs_PD, wi_0, sizes_E)
    up_PF = jax.lax.ragged_dot(xs_PD, wi_1, sizes_E)
    return from_blocks(jax.lax.ragged_dot(jax.nn.silu(gate_PF) * up_PF, wo, sizes_E), layout)


def _transformer_engine(x_TD, experts_TK, active_TK, wi_0, wi_1, wo, config: Config) -> jax.Array:
    """TE's grouped GEMM over the sorted layout. TE wants the groups to cover every row, so the
    layout's trailing zero rows join the last group (zero rows give zero outputs)."""
    from transformer_engine.jax.dense import grouped_dense

    layout = block_layout(experts_TK, wi_0.shape[0], 1, active_TK)
    xs_PD = to_blocks(x_TD, layout)
    sizes_E = layout.sizes_E.at[-1].add(xs_PD.shape[0] - layout.sizes_E.sum())
    gate_PF = grouped_dense(xs_PD, wi_0, sizes_E)
    up_PF = grouped_dense(xs_PD, wi_1, sizes_E)
    return from_blocks(grouped_dense(jax.nn.silu(gate_PF) * up_PF, wo, sizes_E), layout)


BACKENDS: dict[str, RoutedExperts] = {"blocked": _blocked, "ragged_dot": _ragged_dot, "te": _transformer_engine}


def transformer_engine_error() -> str | None:
    """Why Transformer Engine's JAX API cannot be used here, or None if it can."""
    try:
        import transformer_engine.jax  # noqa: F401
    except Exception as err:  # ImportError, or a CUDA library missing underneath it
        return f"{type(err).__name__}: {err}".splitlines()[0]
    return None


def resolve_backend(name: str, platform: str | None = None) -> str:
    """``auto`` becomes the best backend for the platform (default: JAX's current backend):
    Transformer Engine on GPU when it imports, else ``ragged_dot`` on GPU/TPU, else ``blocked``."""
    if name != "auto":
        return name
    platform = platform or jax.default_backend()
    if platform in ("gpu", "cuda"):
        return "te" if transformer_engine_error() is None else "ragged_dot"
    return "ragged_dot" if platform in ("rocm", "tpu") else "blocked"


def check_backend(config: Config, platform: str) -> None:
    """Fail early, with what to install, when the chosen backend cannot run here."""
    if resolve_backend(config.moe_matmul, platform) == "te" and (reason := transformer_engine_error()):
        raise ConfigError(
            f"config key 'moe_matmul': 'te' needs Transformer Engine for JAX, which does not import here ({reason}); "
            "install requirements-gpu.txt in a CUDA image (docker/Dockerfile.gpu) or choose blocked/ragged_dot"
        )


def routed_experts(
    x_TD: jax.Array,
    experts_TK: jax.Array,
    weights_TK: jax.Array,
    wi_0: jax.Array,
    wi_1: jax.Array,
    wo: jax.Array,
    config: Config,
) -> jax.Array:
    """``sum_k weights[t, k] * SwiGLU_{experts[t, k]}(x[t])`` for every token: [T, D] -> [T, D].

    Dropless unless ``capacity_factor > 0`` asks for the token-dropping baseline."""
    if config.capacity_factor > 0:
        y_TKD = capacity_experts(x_TD, experts_TK, wi_0, wi_1, wo, config.capacity_factor)
        return jnp.einsum("tkd,tk->td", y_TKD, weights_TK.astype(y_TKD.dtype))
    backend = BACKENDS[resolve_backend(config.moe_matmul)]
    axis = expert_axis()
    if axis is not None:
        return allgather_experts(x_TD, experts_TK, weights_TK, wi_0, wi_1, wo, config, backend, axis)
    y_TKD = backend(x_TD, experts_TK, None, wi_0, wi_1, wo, config)
    return jnp.einsum("tkd,tk->td", y_TKD, weights_TK.astype(y_TKD.dtype))
