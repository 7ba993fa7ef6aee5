"""One optimizer step as a pure function: gradients (accumulated over micro-batches), AdamW,
then the auxiliary-loss-free bias update from the whole global batch's expert loads.

The step is jitted by the loop with explicit shardings; inside it every array is global, so
expert loads summed here are loads over the global batch.
"""

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax

from MaxText.config import Config
from MaxText.models.deepseek import DeepSeekV3
from MaxText.train.loss import LossParts, compute_loss
from MaxText.train.optimizer import learning_rate_schedule
from MaxText.train.state import TrainState

Metrics = dict[str, jax.Array]


def update_correction_bias(bias: Any, load: Any, rate: float) -> Any:
    """``b_i += rate * sign(mean(load) - load_i)`` per router (DeepSeek-V3, section 2.1.2)."""

    def update(b_E: jax.Array, load_E: jax.Array) -> jax.Array:
        load_E = load_E.astype(b_E.dtype)
        return b_E + rate * jnp.sign(load_E.mean(axis=-1, keepdims=True) - load_E)

    return jax.tree.map(update, bias, load)


def load_max_over_mean_per_router(load: Any) -> jax.Array:
    """[routers] most-loaded expert / mean load for each MoE layer (MoE stack first, then MTP);
    1.0 is perfect balance."""
    ratios = [
        (x.max(axis=-1) / jnp.maximum(x.mean(axis=-1), 1e-9)).reshape(-1)
        for x in (leaf.astype(jnp.float32) for leaf in jax.tree.leaves(load))
    ]
    return jnp.concatenate(ratios) if ratios else jnp.ones((1,))


def split_micro_batches(batch: dict[str, jax.Array], n: int) -> dict[str, jax.Array]:
    """[global, S] -> [n, global / n, S], micro-batch i taking rows i, i + n, ... so that each
    micro-batch keeps the batch sharding of the global batch."""
    return {k: v.reshape(v.shape[0] // n, n, *v.shape[1:]).swapaxes(0, 1) for k, v in batch.items()}


def train_step(
    model: DeepSeekV3,
    config: Config,
    optimizer: optax.GradientTransformation,
    state: TrainState,
    batch: dict[str, jax.Array],
) -> tuple[TrainState, Metrics]:
    def loss_fn(params, micro_batch) -> tuple[jax.Array, LossParts]:
        parts = compute_loss(model, config, params, state.moe_bias, micro_batch)
        return parts.loss, parts

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    n = config.gradient_accumulation_steps
    if n == 1:
        (_, parts), grads = grad_fn(state.params, batch)
    else:

        def accumulate(carry, micro_batch):
            (_, parts), grads = grad_fn(state.params, micro_batch)
            return jax.tree.map(jnp.add, carry, (grads, parts)), None

        micro_batches = split_micro_batches(batch, n)
        (_, parts_shape), grads_shape = jax.eval_shape(
            grad_fn, state.params, jax.tree.map(lambda x: x[0], micro_batches)
        )
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (grads_shape, parts_shape))
        (grads, parts), _ = jax.lax.scan(accumulate, zeros, micro_batches)
        grads = jax.tree.map(lambda g: g / n, grads)
        parts = parts._replace(**{f: getattr(parts, f) / n for f in ("loss", "lm_loss", "mtp_loss", "aux_loss")})

    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    moe_bias = state.moe_bias
    if config.routed_bias and config.routed_bias_update_rate > 0:
        moe_bias = update_correction_bias(moe_bias, parts.expert_load, config.routed_bias_update_rate)

    load_ratios = load_max_over_mean_per_router(parts.expert_load)
    metrics = {
        "loss": parts.loss,
        "lm_loss": parts.lm_loss,
        "mtp_loss": parts.mtp_loss,
        "aux_loss": parts.aux_loss,
        "grad_norm": optax.global_norm(grads),
        "learning_rate": learning_rate_schedule(config)(state.step),
        "expert_load_max_over_mean": load_ratios.mean(),
        "expert_load_max_over_mean_per_layer": load_ratios,
        "dropped_tokens": parts.dropped_tokens,
    }
    return TrainState(state.step + 1, params, moe_bias, opt_state), metrics


def make_train_step(model: DeepSeekV3, config: Config, optimizer: optax.GradientTransformation) -> Callable:
    return partial(train_step, model, config, optimizer)


def jit_train_step(
    model: DeepSeekV3, config: Config, optimizer: optax.GradientTransformation, state_shardings, batch_shardings
) -> Callable:
    """The step compiled with explicit shardings; the old state is donated (its buffers hold the new one)."""
    return jax.jit(
        make_train_step(model, config, optimizer),
        in_shardings=(state_shardings, batch_shardings),
        out_shardings=(state_shardings, None),
        donate_argnums=(0,),
    )


def eval_step(model: DeepSeekV3, config: Config, state: TrainState, batch: dict[str, jax.Array]) -> Metrics:
    """The main head's cross-entropy on one batch, with its token count so that the loop can
    average several batches by tokens (the MTP and balance terms are training aids, not reported)."""
    parts = compute_loss(model, config, state.params, state.moe_bias, batch)
    tokens = (batch["targets_segmentation"] != 0).sum()
    return {"lm_loss_sum": parts.lm_loss * tokens, "tokens": tokens}


def make_eval_step(model: DeepSeekV3, config: Config) -> Callable:
    return partial(eval_step, model, config)
