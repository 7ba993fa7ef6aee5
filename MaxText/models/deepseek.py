"""The DeepSeek-V3 decoder: embedding, dense then MoE layer stacks, output head, MTP modules.

Every size and switch comes from config keys; nothing here depends on a model's name.

Shape legend: B batch, S sequence, D model dim, V vocabulary, N MTP depth.
"""

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from MaxText.config import Config
from MaxText.layers.common import activation_dtype, constrain, float32_or_wider, kernel_init, param, weight_dtype
from MaxText.layers.norms import RMSNorm
from MaxText.models.decoder import ACTIVATION_AXES, LayerStack
from MaxText.models.mtp import MTPModule


class ModelOutput(NamedTuple):
    logits_BSV: jax.Array  # main next-token logits (float32 or wider)
    mtp_logits_NBSV: jax.Array | None  # MTP depth k predicts token i+k+1 at position i (k = 1..N)


def shift_left(x_BS: jax.Array, k: int) -> jax.Array:
    """``x[:, i + k]`` at position i; the last k positions wrap around (callers mask them)."""
    return jnp.roll(x_BS, -k, axis=1)


class DeepSeekV3(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, tokens_BS: jax.Array, positions_BS: jax.Array, segment_ids_BS: jax.Array) -> ModelOutput:
        c = self.config
        V, D = c.vocab_size, c.emb_dim
        embedding_VD = self.param("token_embedding", kernel_init(c, ("vocab", "embed")), (V, D), weight_dtype(c))

        def embed(ids_BS: jax.Array) -> jax.Array:
            return constrain(jnp.asarray(embedding_VD, activation_dtype(c))[ids_BS], ACTIVATION_AXES)

        head_DV = param(self, "output_head", c, (D, V), ("embed", "vocab"))

        def logits(normed_BSD: jax.Array) -> jax.Array:
            out = jnp.einsum("bsd,dv->bsv", normed_BSD, head_DV, preferred_element_type=float32_or_wider(head_DV.dtype))
            return constrain(out, ("activation_batch", "activation_length", "activation_vocab"))

        x_BSD = embed(tokens_BS)
        if c.first_num_dense_layers > 0:
            x_BSD = LayerStack(c, False, c.first_num_dense_layers, name="dense_layers")(
                x_BSD, positions_BS, segment_ids_BS
            )
        if c.num_moe_layers > 0:
            x_BSD = LayerStack(c, True, c.num_moe_layers, name="moe_layers")(x_BSD, positions_BS, segment_ids_BS)
        main_logits = logits(RMSNorm(c, name="final_norm")(x_BSD))

        mtp_logits = []
        h_BSD = x_BSD
        for k in range(1, c.mtp_num_layers + 1):
            mtp = MTPModule(c, name=f"mtp_{k}")
            h_BSD, normed_BSD = mtp(h_BSD, embed(shift_left(tokens_BS, k)), positions_BS, segment_ids_BS)
            mtp_logits.append(logits(normed_BSD))
        return ModelOutput(main_logits, jnp.stack(mtp_logits) if mtp_logits else None)
