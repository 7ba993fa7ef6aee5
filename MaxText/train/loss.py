"""The training loss: next-token cross-entropy + MTP losses + the MoE balance loss.

    loss = CE(main) + mtp_loss_scaling_factor x mean_k CE(MTP depth k) + load_balance_loss_weight x sum of balance losses

Positions whose target is padding (``targets_segmentation == 0``) carry no loss. MTP depth k at
position i predicts ``targets[i + k]``; it counts only when that target lies in the same
document and inside the sequence.

Each cross-entropy is a sum over tokens divided by the token count of the whole optimizer batch
(``loss_token_counts``), not of one micro-batch: with gradient accumulation the micro-batches'
losses and gradients then add up to exactly the whole batch's, however their padding differs
(averaging per-micro-batch means would weigh a token of a half-empty micro-batch twice).

The output head is applied here, not in the model (``HeadInputs``), over ``vocab_chunks`` slices
of the sequence and split over the vocabulary (``layers/vocab_parallel.py``): at the 671B a
[4096, 129,280] float32 logits array is 2.1 GB per sequence and head, held several times over
(logits, log-softmax, gradient) when taken whole.

Shape legend: B batch, S sequence, D model dim, V vocabulary, N MTP depth.
"""

from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from MaxText.config import Config
from MaxText.layers.vocab_parallel import head_nll_sum
from MaxText.models.deepseek import DeepSeekV3, shift_left
from MaxText.moe.block import BIAS, LOAD, LOSS
from MaxText.moe.capacity import capacity


class LossParts(NamedTuple):
    loss: jax.Array
    lm_loss: jax.Array
    mtp_loss: jax.Array
    aux_loss: jax.Array
    expert_load: Any  # tree of [.., E] token counts, same structure as the moe_bias collection
    dropped_tokens: jax.Array  # token copies the capacity baseline dropped (0 when dropless)


def mtp_weights(targets_segmentation_BS: jax.Array, k: int) -> jax.Array:
    """1 where MTP depth k has a valid target: inside the sequence and in the same document."""
    S = targets_segmentation_BS.shape[1]
    inside_S = jnp.arange(S) < S - k
    shifted_BS = shift_left(targets_segmentation_BS, k)
    return (inside_S & (shifted_BS == targets_segmentation_BS) & (targets_segmentation_BS != 0)).astype(jnp.float32)


class TokenCounts(NamedTuple):
    """Tokens that carry each loss in the whole optimizer batch: the denominators of its means."""

    lm: jax.Array  # main head
    mtp: jax.Array  # [N] one per MTP depth


def loss_token_counts(batch: dict[str, jax.Array], config: Config) -> TokenCounts:
    segments_BS = batch["targets_segmentation"]
    mtp = [mtp_weights(segments_BS, k).sum() for k in range(1, config.mtp_num_layers + 1)]
    return TokenCounts(
        (segments_BS != 0).sum().astype(jnp.float32), jnp.stack(mtp) if mtp else jnp.zeros((0,), jnp.float32)
    )


def compute_loss(
    model: DeepSeekV3,
    config: Config,
    params: Any,
    moe_bias: Any,
    batch: dict[str, jax.Array],
    counts: TokenCounts | None = None,
    num_micro_batches: int = 1,
) -> LossParts:
    """The loss of ``batch``, one of ``num_micro_batches`` equal parts of an optimizer batch whose
    token ``counts`` are given (default: ``batch`` is the whole batch). The parts' losses add up
    to the whole batch's loss."""
    counts = loss_token_counts(batch, config) if counts is None else counts
    (normed_BSD, mtp_normed_NBSD), stats = model.apply(
        {"params": params, BIAS: moe_bias},
        batch["inputs"],
        batch["inputs_position"],
        batch["inputs_segmentation"],
        logits=False,
        mutable=[LOAD, LOSS],
    )
    targets_BS, segments_BS = batch["targets"], batch["targets_segmentation"]
    nll_sum = partial(head_nll_sum, head_DV=params["output_head"], chunks=config.vocab_chunks, axes=config.vocab_axes())
    lm_loss = nll_sum(normed_BSD, targets_BS=targets_BS, weights_BS=(segments_BS != 0).astype(jnp.float32))
    lm_loss /= jnp.maximum(counts.lm, 1)

    mtp_loss = jnp.zeros((), lm_loss.dtype)
    for k in range(1, config.mtp_num_layers + 1):
        nll = nll_sum(
            mtp_normed_NBSD[k - 1], targets_BS=shift_left(targets_BS, k), weights_BS=mtp_weights(segments_BS, k)
        )
        mtp_loss += nll / jnp.maximum(counts.mtp[k - 1], 1)
    mtp_loss /= max(config.mtp_num_layers, 1)

    # Each micro-batch's balance loss is a mean over its sequences; equal micro-batches average.
    balance = sum(jnp.sum(x) for x in jax.tree.leaves(stats.get(LOSS, {}))) / num_micro_batches
    aux_loss = config.load_balance_loss_weight * jnp.asarray(balance, lm_loss.dtype)
    loss = lm_loss + config.mtp_loss_scaling_factor * mtp_loss + aux_loss
    load = stats.get(LOAD, {})
    return LossParts(loss, lm_loss, mtp_loss, aux_loss, load, dropped_copies_from_load(load, targets_BS.size, config))


def dropped_copies_from_load(load: Any, tokens: int, config: Config) -> jax.Array:
    """Token copies the capacity baseline dropped: each expert keeps at most C of its copies."""
    if config.capacity_factor <= 0:
        return jnp.zeros((), jnp.int32)  # dropless: every copy is computed
    C = capacity(tokens, config.num_experts_per_tok, config.num_experts, config.capacity_factor)
    return sum(jnp.maximum(leaf - C, 0).sum() for leaf in jax.tree.leaves(load))
