"""AdamW with linear warmup + cosine decay and global-norm clipping (optax).

Weight decay applies to matrices and embeddings only: RMSNorm scales (leaf name ``scale``) are
excluded, and the router's correction bias is not a gradient-trained parameter at all.

The AdamW moments are kept in ``opt_state_dtype`` (DeepSeek-V3 keeps them in bfloat16: a quarter
of the state's bytes saved with float32 weights); the update itself is computed in float32.

The routers (leaf name ``router``) can learn at a fraction of the rate (``router_learning_rate_scale``):
Adam moves every weight at the full rate however small and steady its gradient, so in a short,
fast run a router's small preference for its best-trained experts grows into a gap between
experts, shared by every token, faster than the correction bias can follow.
"""

from typing import Any

import jax
import jax.numpy as jnp
import optax

from MaxText.config import Config


def learning_rate_schedule(config: Config) -> optax.Schedule:
    """0 -> learning_rate over warmup_steps, then cosine to learning_rate x final_fraction at the
    schedule's end (``learning_rate_schedule_steps``, by default ``steps``)."""
    total = config.schedule_steps
    warmup = min(config.warmup_steps, total)
    decay_steps = max(total - warmup, 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=config.learning_rate,
        warmup_steps=warmup,
        decay_steps=warmup + decay_steps,
        end_value=config.learning_rate * config.learning_rate_final_fraction,
    )


def weight_decay_mask(params: Any) -> Any:
    """True for parameters that get weight decay (everything but norm scales)."""

    def decays(path, _) -> bool:
        return getattr(path[-1], "key", None) != "scale"

    return jax.tree_util.tree_map_with_path(decays, params)


def scale_leaves_named(name: str, factor: float) -> optax.GradientTransformation:
    """Multiply the updates of every leaf called ``name`` by ``factor``."""

    def update(updates, state, params=None):
        def scale(path, u):
            return u * factor if getattr(path[-1], "key", None) == name else u

        return jax.tree_util.tree_map_with_path(scale, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def moments_in(dtype: jnp.dtype, adam: optax.GradientTransformation) -> optax.GradientTransformation:
    """``adam`` (optax's ``scale_by_adam``) with its moments stored in ``dtype``: each update
    reads them, computes in the gradients' dtype, and rounds them back."""

    def cast(state):
        as_dtype = lambda tree: jax.tree.map(lambda t: t.astype(dtype), tree)  # noqa: E731
        return state._replace(mu=as_dtype(state.mu), nu=as_dtype(state.nu))

    def update(updates, state, params=None):
        updates, state = adam.update(updates, state, params)
        return updates, cast(state)

    return optax.GradientTransformation(lambda params: cast(adam.init(params)), update)


def make_optimizer(config: Config) -> optax.GradientTransformation:
    """AdamW (optax's ``adamw``, built from its parts so the moments' dtype can be set)."""
    adam = optax.scale_by_adam(b1=config.adam_b1, b2=config.adam_b2, eps=config.adam_eps)
    if config.moment_dtype != config.weight_dtype:
        adam = moments_in(jnp.dtype(config.moment_dtype), adam)
    adamw = optax.chain(
        adam,
        optax.add_decayed_weights(config.adam_weight_decay, weight_decay_mask),
        optax.scale_by_learning_rate(learning_rate_schedule(config)),
    )
    parts = [adamw]
    if config.gradient_clipping_threshold > 0:
        parts.insert(0, optax.clip_by_global_norm(config.gradient_clipping_threshold))
    if config.router_learning_rate_scale != 1:
        parts.append(scale_leaves_named("router", config.router_learning_rate_scale))
    return optax.chain(*parts) if len(parts) > 1 else adamw
