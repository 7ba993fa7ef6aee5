"""One optimizer step as a pure function: gradients (accumulated over micro-batches), AdamW,
then the auxiliary-loss-free bias update from the whole global batch's expert loads.

The step is jitted by the loop with explicit shardings; inside it every array is global, so
expert loads summed here are loads over the global batch.

A step whose loss or gradient norm is not finite is skipped inside the step: parameters,
optimizer state (its update count, so the learning-rate schedule, included) and MoE biases keep
their values, ``TrainState.step`` still counts the batch, and the metrics say ``skipped: 1``
(the loop stops a run that skips too many in a row: ``train/health.py``).
"""

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax

from MaxText.config import Config
from MaxText.models.deepseek import DeepSeekV3
from MaxText.parallel.sharding import interleaved_split
from MaxText.train.loss import LossParts, compute_loss, loss_token_counts
from MaxText.train.optimizer import learning_rate_schedule
from MaxText.train.state import TrainState

Metrics = dict[str, jax.Array]


def update_correction_bias(bias: Any, load: Any, rate: float, rule: str = "sign") -> Any:
    """``b_i += rate * sign(mean(load) - load_i)`` per router (DeepSeek-V3, section 2.1.2), or with
    ``rule="proportional"`` ``b_i += rate * (mean(load) - load_i) / mean(load)``: steps that
    shrink as the loads even out, so a large rate converges instead of oscillating by +-rate."""

    def update(b_E: jax.Array, load_E: jax.Array) -> jax.Array:
        load_E = load_E.astype(b_E.dtype)
        mean = load_E.mean(axis=-1, keepdims=True)
        if rule == "sign":
            return b_E + rate * jnp.sign(mean - load_E)
        return b_E + rate * (mean - load_E) / jnp.maximum(mean, 1)

    return jax.tree.map(update, bias, load)


def load_max_over_mean_per_router(load: Any) -> jax.Array:
    """[routers] most-loaded expert / mean load for each MoE layer (MoE stack first, then MTP);
    1.0 is perfect balance."""
    ratios = [
        (x.max(axis=-1) / jnp.maximum(x.mean(axis=-1), 1e-9)).reshape(-1)
        for x in (leaf.astype(jnp.float32) for leaf in jax.tree.leaves(load))
    ]
    return jnp.concatenate(ratios) if ratios else jnp.ones((1,))


def correction_bias_range(bias: Any) -> Metrics:
    """The lowest and highest correction bias over every router (after this step's update): a
    bias that keeps growing shows the router fighting the balance."""
    leaves = [leaf.reshape(-1) for leaf in jax.tree.leaves(bias)]
    if not leaves:
        return {}
    every = jnp.concatenate(leaves)
    return {"routed_bias_min": every.min(), "routed_bias_max": every.max()}


def keep_if_finite(finite: jax.Array, new: Any, old: Any) -> Any:
    """``new`` where ``finite``, else ``old``, leaf by leaf: a step whose loss or gradient norm is
    not finite changes no parameter, optimizer moment or count, and no MoE bias (one select per
    leaf, fused into the update; no host round-trip)."""
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)


def applied_updates(state: TrainState) -> jax.Array:
    """The optimizer's count of applied updates (the learning-rate schedule's position): skipped
    steps do not advance it, while ``TrainState.step`` counts every batch consumed (and stands in
    for an optimizer without a schedule)."""
    is_schedule = lambda x: isinstance(x, optax.ScaleByScheduleState)  # noqa: E731
    counts = [x.count for x in jax.tree.leaves(state.opt_state, is_leaf=is_schedule) if is_schedule(x)]
    return counts[0] if counts else state.step


def split_micro_batches(batch: dict[str, jax.Array], n: int) -> dict[str, jax.Array]:
    """[global, S] -> [n, global / n, S], micro-batch i taking rows i, i + n, ... so that each
    micro-batch keeps the batch sharding of the global batch."""
    return {k: interleaved_split(v, n) for k, v in batch.items()}


def train_step(
    model: DeepSeekV3,
    config: Config,
    optimizer: optax.GradientTransformation,
    state: TrainState,
    batch: dict[str, jax.Array],
) -> tuple[TrainState, Metrics]:
    n = config.gradient_accumulation_steps
    counts = loss_token_counts(batch, config)  # of the whole batch: every micro-batch divides by them

    def loss_fn(params, micro_batch) -> tuple[jax.Array, LossParts]:
        parts = compute_loss(model, config, params, state.moe_bias, micro_batch, counts, n)
        return parts.loss, parts

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
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
        # Losses and gradients are already scaled to the whole batch: the sum over micro-batches is its.
        (grads, parts), _ = jax.lax.scan(accumulate, zeros, micro_batches)

    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    moe_bias = state.moe_bias
    if config.routed_bias and config.routed_bias_update_rate > 0:
        moe_bias = update_correction_bias(
            moe_bias, parts.expert_load, config.routed_bias_update_rate, config.routed_bias_update_rule
        )
    grad_norm = optax.global_norm(grads)
    finite = jnp.isfinite(parts.loss) & jnp.isfinite(grad_norm)
    params, moe_bias, opt_state = keep_if_finite(
        finite, (params, moe_bias, opt_state), (state.params, state.moe_bias, state.opt_state)
    )

    load_ratios = load_max_over_mean_per_router(parts.expert_load)
    metrics = {
        "loss": parts.loss,
        "lm_loss": parts.lm_loss,
        "mtp_loss": parts.mtp_loss,
        "aux_loss": parts.aux_loss,
        "grad_norm": grad_norm,
        "skipped": (~finite).astype(jnp.int32),
        "learning_rate": learning_rate_schedule(config)(applied_updates(state)),
        "expert_load_max_over_mean": load_ratios.mean(),
        "expert_load_max_over_mean_per_layer": load_ratios,
        **correction_bias_range(moe_bias),
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
