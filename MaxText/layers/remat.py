"""What each layer keeps for its backward pass (``remat_policy``), and the names that let a policy
pick tensors one by one.

``minimal`` keeps every matmul output JAX sees as a ``dot_general``: MLA's up-projections
(``wq_b``, ``wkv_b``: 0.94 GB per layer for DeepSeek-V3 at 8,192 tokens per GPU, rerun in 0.65 ms
on a GB300) are kept, while the routed experts' grouped GEMMs (kernel calls, not dots) and the
attention kernel are rerun. ``names`` keeps exactly the tensors ``remat_names`` lists
(``SAVEABLE``), so the bytes go where recomputing costs the most time per byte.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
from jax.ad_checkpoint import checkpoint_name

# The tensors the layers name (``saved``), with what keeping one costs and saves, per layer.
SAVEABLE: dict[str, str] = {
    "query_latent": "MLA's query down-projection (wq_a), before its norm: [tokens, q_lora_rank]",
    "key_value_latent": "MLA's key/value down-projection (wkv_a), before its norm: [tokens, kv_lora_rank + rope]",
    "query": "the queries from the up-projection (wq_b, or wq without a query latent): [tokens, heads, qk dims]",
    "key_value": "the keys and values from the up-projection (wkv_b): [tokens, heads, nope + v dims]",
    "attention": "the attention kernel's output [tokens, heads, v dims] and softmax statistics, what its "
    "backward reads besides its inputs (cudnn and flash; te and dot keep nothing and rerun)",
    "attention_out": "the attention's output projection (wo): [tokens, embed]",
    "router_logits": "the router's scores before the sigmoid: [tokens, experts]",
    "mlp_gate_up": "a dense MLP's or the shared experts' gate and up projections: 2 x [tokens, mlp]",
    "routed_gate_up": "the routed experts' gate and up grouped GEMMs: 2 x [routed rows, moe_mlp]",
}
# Forward kernels whose outputs are what their backward reads besides their inputs (the output
# and the softmax statistics): kept with ``attention``, by the primitive, since their backward
# reads the primitive's own outputs (a name on the value the layer sees would be a second copy).
# JAX's cuDNN flash attention; the repository's ``flash`` names its residuals itself. Transformer
# Engine's kernel is not here (nothing in this repository compiles it): under ``names`` its
# forward reruns in the backward pass, as under ``minimal``.
ATTENTION_KERNELS = ("dot_product_attention_fwd_wrapper",)

POLICIES: dict[str, Callable[..., bool]] = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "minimal": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def saved(x: jax.Array, name: str) -> jax.Array:
    """``x`` named ``name`` (a ``SAVEABLE`` key) for the ``names`` remat policy."""
    assert name in SAVEABLE, name
    return checkpoint_name(x, name)


def _attention_kernel_outputs(prim, *_, **__) -> bool:
    return prim.name in ATTENTION_KERNELS


def remat_policy(policy: str, names: Sequence[str]) -> Callable[..., bool] | None:
    """The ``jax.checkpoint`` policy of ``remat_policy`` (None: no remat) with ``remat_names``."""
    if policy == "none":
        return None
    if policy != "names":
        return POLICIES[policy]
    by_name = jax.checkpoint_policies.save_only_these_names(*names)
    if "attention" not in names:
        return by_name
    return jax.checkpoint_policies.save_from_both_policies(by_name, _attention_kernel_outputs)
