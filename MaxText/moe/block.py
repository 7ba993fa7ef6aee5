"""The DeepSeekMoE block: routed experts (dropless) plus always-on shared experts.

``y = sum_k w_k * E_k(x) + S(x)``, experts are SwiGLU ``wo(silu(wi_0 x) * wi_1 x)``.

Besides its output, each block records two things for the training step, in collections that
mirror the ``moe_bias`` collection leaf for leaf (the leaf is named ``router`` everywhere):
``moe_load`` (tokens per expert in this batch, for the bias update and load metrics) and
``moe_loss`` (the sequence-wise balance loss). Both count real tokens only: padding (segment id
0) is routed and computed like any token, but it must neither steer the correction bias nor
weigh in the balance loss.

Shape legend: B batch, S sequence, T = B*S tokens, D model dim, E experts, F expert hidden,
K experts per token, M = T*K routed rows.
"""

import math
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp

from MaxText.config import Config
from MaxText.layers.common import activation_dtype, float32_or_wider, kernel_init, param, weight_dtype
from MaxText.layers.mlp import SwiGLU
from MaxText.layers.remat import saved
from MaxText.moe.expert_parallel import WI_AXES, WO_AXES
from MaxText.moe.experts import routed_experts
from MaxText.moe.router import Routing, route, sequence_balance_loss, tokens_per_expert
from MaxText.parallel.sharding import batch_mesh_axes, constrain

# Collections written by every MoE block (see the module docstring).
BIAS, LOAD, LOSS = "moe_bias", "moe_load", "moe_loss"
MOE_COLLECTIONS = (BIAS, LOAD, LOSS)


def route_token_shards(logits_TE: jax.Array, bias_E: jax.Array, config: Config) -> Routing:
    """``route`` on each device's own tokens (a ``shard_map`` over the batch axes). Routing is per
    token, but XLA's SPMD partitioner may gather the operand of ``top_k`` (a TopK custom call) over
    every device: on the GB300 recipe's 1,024 devices it gathered the global [T, E] scores
    (4.3 GB) twice per MoE layer and ran top-k on all of them."""
    mesh = jax.sharding.get_abstract_mesh()
    names = batch_mesh_axes()
    ways = math.prod(mesh.shape[a] for a in names) if names else 1
    if ways == 1 or logits_TE.shape[0] % ways:
        return route(logits_TE, bias_E, config)
    spec = jax.sharding.PartitionSpec(names)
    return jax.shard_map(
        partial(route, config=config), in_specs=(spec, jax.sharding.PartitionSpec()), out_specs=spec, check_vma=False
    )(logits_TE, bias_E)


class MoEBlock(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, x_BSD: jax.Array, segment_ids_BS: jax.Array | None = None) -> jax.Array:
        """``segment_ids_BS`` (0 = padding) keeps padding out of the statistics; None: all tokens are real."""
        c = self.config
        B, S, D = x_BSD.shape
        E, F = c.num_experts, c.base_moe_mlp_dim
        router_dtype = float32_or_wider(activation_dtype(c))

        # Router in float32; the correction bias is state, updated outside the gradient.
        gate_DE = self.param("router", kernel_init(c, ("embed", None)), (D, E), weight_dtype(c))
        bias = self.variable(BIAS, "router", nn.with_logical_partitioning(jnp.zeros, (None,)), (E,), router_dtype)
        logits_BSE = jnp.einsum("bsd,de->bse", x_BSD.astype(router_dtype), gate_DE.astype(router_dtype))
        logits_BSE = saved(logits_BSE, "router_logits")
        routing = route_token_shards(logits_BSE.reshape(B * S, E), bias.value, c)

        # Dropless routed experts (dispatch, grouped SwiGLU, weighted combine) by the chosen backend.
        wi_0 = param(self, "wi_0", c, (E, D, F), WI_AXES)
        wi_1 = param(self, "wi_1", c, (E, D, F), WI_AXES)
        wo = param(self, "wo", c, (E, F, D), WO_AXES)
        x_TD = x_BSD.reshape(B * S, D)
        y_TD = routed_experts(x_TD, routing.experts_TK, routing.weights_TK, wi_0, wi_1, wo, c)
        y_BSD = y_TD.reshape(B, S, D)

        if c.shared_experts > 0:
            y_BSD += SwiGLU(c, c.shared_experts * F, name="shared_experts")(x_BSD)

        # Statistics for the training step, over real tokens only.
        K = c.num_experts_per_tok
        valid_BS = None if segment_ids_BS is None else segment_ids_BS != 0
        valid_T = None if valid_BS is None else valid_BS.reshape(B * S)
        self.variable(LOAD, "router", jnp.zeros, (E,), jnp.int32).value = tokens_per_expert(
            routing.experts_TK, E, valid_T
        )
        balance = sequence_balance_loss(
            routing.scores_TE.reshape(B, S, E), routing.experts_TK.reshape(B, S, K), valid_BS
        )
        self.variable(LOSS, "router", jnp.zeros, (), router_dtype).value = balance
        return constrain(y_BSD.astype(x_BSD.dtype), ("activation_batch", "activation_length", "activation_embed"))
