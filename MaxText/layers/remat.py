"""What each layer keeps for its backward pass (``remat_policy``), and the names that let a policy
pick tensors one by one.

``minimal`` keeps every matmul output JAX sees as a ``dot_general``: MLA's up-projections
(``wq_b``, ``wkv_b``: 0.94 GB per layer for DeepSeek-V3 at 8,192 tokens per GPU, rerun in 0.65 ms
on a GB300) are kept, while the routed experts' grouped GEMMs (kernel calls, not dots) and the
attention kernel are rerun. ``names`` keeps exactly the tensors ``remat_names`` lists
(``layers/saveable.py``), so the bytes go where recomputing costs the most time per byte.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
from jax.ad_checkpoint import checkpoint_name

from MaxText.layers.saveable import SAVEABLE

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
