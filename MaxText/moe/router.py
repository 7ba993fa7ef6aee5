"""DeepSeek-V3 routing: group-limited top-k over sigmoid (or softmax) scores in float32.

The score-correction bias (auxiliary-loss-free balancing) only decides *which* experts a token
goes to; the combine weights are the unbiased scores of those experts, normalised to sum to 1
and multiplied by ``routed_scaling_factor``.

Shape legend: T tokens, E experts, G routing groups, K experts per token.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from MaxText.config import Config


class Routing(NamedTuple):
    weights_TK: jax.Array  # combine weights of the chosen experts
    experts_TK: jax.Array  # chosen expert ids (int32)
    scores_TE: jax.Array  # unbiased router scores of every expert


def router_scores(logits_TE: jax.Array, score_func: str) -> jax.Array:
    return jax.nn.sigmoid(logits_TE) if score_func == "sigmoid" else jax.nn.softmax(logits_TE, axis=-1)


def group_limited_mask(selection_TE: jax.Array, num_groups: int, topk_groups: int) -> jax.Array:
    """True for experts in each token's ``topk_groups`` best groups.

    A group's score is the sum of its two best selection scores (DeepSeek-V3's ``noaux_tc``).
    """
    T, E = selection_TE.shape
    grouped_TGe = selection_TE.reshape(T, num_groups, E // num_groups)
    best_two = jax.lax.top_k(grouped_TGe, min(2, E // num_groups))[0]
    group_score_TG = best_two.sum(axis=-1)
    _, top_groups = jax.lax.top_k(group_score_TG, topk_groups)
    keep_TG = jnp.zeros((T, num_groups), dtype=bool).at[jnp.arange(T)[:, None], top_groups].set(True)
    return jnp.repeat(keep_TG, E // num_groups, axis=-1)


def route(logits_TE: jax.Array, correction_bias_E: jax.Array, config: Config) -> Routing:
    """Choose ``num_experts_per_tok`` experts per token and their combine weights."""
    scores_TE = router_scores(logits_TE, config.routed_score_func)
    selection_TE = scores_TE + correction_bias_E if config.routed_bias else scores_TE
    if config.n_routing_groups > 1:
        keep_TE = group_limited_mask(selection_TE, config.n_routing_groups, config.topk_routing_group)
        selection_TE = jnp.where(keep_TE, selection_TE, -jnp.inf)
    _, experts_TK = jax.lax.top_k(selection_TE, config.num_experts_per_tok)
    weights_TK = jnp.take_along_axis(scores_TE, experts_TK, axis=-1)
    if config.routed_norm_topk_prob:
        weights_TK = weights_TK / (weights_TK.sum(axis=-1, keepdims=True) + 1e-20)
    return Routing(weights_TK * config.routed_scaling_factor, experts_TK.astype(jnp.int32), scores_TE)


def tokens_per_expert(experts_TK: jax.Array, num_experts: int, valid_T: jax.Array | None = None) -> jax.Array:
    """[E] how many (token, slot) pairs chose each expert, counting only ``valid_T`` tokens (padding
    is routed and computed like any token, but must not steer the correction bias)."""
    ones_TK = jnp.ones(experts_TK.shape, jnp.int32)
    if valid_T is not None:
        ones_TK *= valid_T[:, None].astype(jnp.int32)
    return jnp.zeros((num_experts,), jnp.int32).at[experts_TK.reshape(-1)].add(ones_TK.reshape(-1))


def sequence_balance_loss(
    scores_BSE: jax.Array, experts_BSK: jax.Array, valid_BS: jax.Array | None = None
) -> jax.Array:
    """DeepSeek-V3's sequence-wise balance loss ``sum_i f_i P_i``, averaged over sequences.

    ``f_i = E / (K S) * #tokens of the sequence routed to i`` (no gradient) and
    ``P_i`` = the sequence's mean of ``s_i / sum_j s_j``, where S counts the sequence's real
    tokens only (``valid_BS``; padding takes no part). A sequence of padding alone contributes 0,
    and every sequence counts in the mean, so equal micro-batches average to the whole batch's loss.
    """
    B, S, E = scores_BSE.shape
    K = experts_BSK.shape[-1]
    valid_BS = jnp.ones((B, S), scores_BSE.dtype) if valid_BS is None else valid_BS.astype(scores_BSE.dtype)
    tokens_B1 = jnp.maximum(valid_BS.sum(axis=1, keepdims=True), 1)
    copies_BM = jnp.repeat(valid_BS, K, axis=1)  # [B, S*K], each token's K copies in order
    counts_BE = (
        jnp.zeros((B, E), scores_BSE.dtype).at[jnp.arange(B)[:, None], experts_BSK.reshape(B, S * K)].add(copies_BM)
    )
    f_BE = jax.lax.stop_gradient(counts_BE * E / (K * tokens_B1))
    p_BE = ((scores_BSE / scores_BSE.sum(axis=-1, keepdims=True)) * valid_BS[..., None]).sum(axis=1) / tokens_B1
    return (f_BE * p_BE).sum(axis=-1).mean()
