"""How many NVLink domains a token's routed copies reach, under balanced group-limited routing.

Why it matters: an exchange that sends each (token, expert) copy on its own (NCCL's all-to-all,
this repository's ragged all-to-all) moves ``K x (domains - 1) / domains`` copies of a token across
the network, whatever the routing. A hierarchical exchange (DeepSeek's DeepEP, Megatron's HybridEP)
sends a token once to each remote domain that holds one of its experts and forwards it over NVLink
there, so the network carries one copy per distinct remote domain. Node-limited routing bounds that
count: DeepSeek-V3 picks its K = 8 experts from the best ``topk_routing_group`` = 4 of
``n_routing_groups`` = 8 groups, so a token reaches at most 4 domains when groups match domains.

The count is sampled from the repository's own router (``MaxText/moe/router.py``: scores, the
group mask, top-k) on ``SAMPLES`` tokens of independent random logits, the balance that the
correction bias aims at and that published throughput runs force. It cannot be had from counting
alone: a group is chosen for the sum of its two best scores, so its best expert is nearly always
among the token's K, and a token's 8 experts land in 3.96 of its 4 groups on average (choosing the
8 uniformly among the 4 groups' experts would say 3.63). Expert-parallel rank ``r`` holds experts
``[r E / ep, (r + 1) E / ep)`` and a domain consecutive ranks; the token starts on any rank with
equal chance. ``tests/test_plan.py`` checks the sample against a per-token reference of the
routing rule and, without groups, against the hypergeometric count.
"""

from __future__ import annotations

import functools

SAMPLES = 8192  # tokens: the mean's standard error is below 0.01 domains


@functools.cache
def expected_domains(
    num_experts: int, top_k: int, groups: int, top_groups: int, domains: int, score_func: str
) -> float:
    """Expected number of distinct domains (of ``domains`` equal ones holding consecutive experts)
    that hold at least one of a token's ``top_k`` experts, under the repository's router."""
    import jax
    import jax.numpy as jnp

    from MaxText.moe.router import group_limited_mask, router_scores

    if num_experts % domains or num_experts % groups or not 1 <= top_groups <= groups:
        raise ValueError(f"{num_experts} experts do not split into {domains} domains and {groups} groups")
    with jax.default_device(jax.devices("cpu")[0]):
        scores = router_scores(jax.random.normal(jax.random.key(0), (SAMPLES, num_experts)), score_func)
        if groups > 1:
            scores = jnp.where(group_limited_mask(scores, groups, top_groups), scores, -jnp.inf)
        domain = jnp.sort(jax.lax.top_k(scores, top_k)[1] // (num_experts // domains), axis=-1)
        distinct = 1 + jnp.sum(domain[:, 1:] != domain[:, :-1], axis=-1)
        return float(jnp.mean(distinct))


def remote_domains(num_experts: int, top_k: int, groups: int, top_groups: int, domains: int, score_func: str) -> float:
    """Expected distinct domains other than the token's own that its copies reach: what a
    hierarchical exchange sends across the network per token (the origin is uniform and independent
    of the routing, so each reached domain is the token's own with chance 1 / domains)."""
    if domains == 1:
        return 0.0
    reached = expected_domains(num_experts, top_k, groups, top_groups, domains, score_func)
    return reached * (domains - 1) / domains
