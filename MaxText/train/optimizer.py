"""AdamW with linear warmup + cosine decay and global-norm clipping (optax).

Weight decay applies to matrices and embeddings only: RMSNorm scales (leaf name ``scale``) are
excluded, and the router's correction bias is not a gradient-trained parameter at all.
"""

from typing import Any

import jax
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


def make_optimizer(config: Config) -> optax.GradientTransformation:
    adamw = optax.adamw(
        learning_rate_schedule(config),
        b1=config.adam_b1,
        b2=config.adam_b2,
        eps=config.adam_eps,
        weight_decay=config.adam_weight_decay,
        mask=weight_decay_mask,
    )
    if config.gradient_clipping_threshold > 0:
        return optax.chain(optax.clip_by_global_norm(config.gradient_clipping_threshold), adamw)
    return adamw
