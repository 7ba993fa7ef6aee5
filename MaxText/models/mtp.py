"""Multi-token prediction (MTP), DeepSeek-V3 section 2.2.

Module k (1-based) predicts the token k+1 places ahead. At position i it combines the previous
depth's hidden state h_i (the main model's last hidden state, before the final norm, for k=1)
with the shared embedding of token i+k:

    h'_i = W_eh [RMSNorm(Emb(t_{i+k})) ; RMSNorm(h_i)]      (embedding half first)

then runs one full decoder layer with the MoE FFN. Its logits come from the shared output head
after the module's own final norm (applied by the caller, which owns the head).

Shape legend: B batch, S sequence, D model dim.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from MaxText.config import Config
from MaxText.layers.common import param
from MaxText.layers.norms import RMSNorm
from MaxText.models.decoder import DecoderLayer


class MTPModule(nn.Module):
    config: Config

    @nn.compact
    def __call__(
        self, h_BSD: jax.Array, embedded_BSD: jax.Array, positions_BS: jax.Array, segment_ids_BS: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """Returns this depth's hidden state (fed to the next depth) and its normalised form for the head."""
        c = self.config
        D = h_BSD.shape[-1]
        both_BS2D = jnp.concatenate(
            [RMSNorm(c, name="embedding_norm")(embedded_BSD), RMSNorm(c, name="hidden_norm")(h_BSD)], axis=-1
        )
        w_eh = param(self, "projection", c, (2 * D, D), (None, "embed"))
        x_BSD = jnp.einsum("bsk,kd->bsd", both_BS2D, w_eh)
        x_BSD, _ = DecoderLayer(c, use_moe=True, name="layer")(x_BSD, positions_BS, segment_ids_BS)
        return x_BSD, RMSNorm(c, name="final_norm")(x_BSD)
