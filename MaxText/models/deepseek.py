"""The DeepSeek-V3 decoder: embedding, dense then MoE layer stacks, output head, MTP modules.

With pipeline stages (``ici/dcn_pipeline_parallelism``) the MoE stack runs through the pipeline;
everything else runs on each stage's share of the batch (the rules split it over ``stage`` too).

Every size and switch comes from config keys; nothing here depends on a model's name.

Shape legend: B batch, S sequence, D model dim, V vocabulary, N MTP depth.
"""

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from MaxText.config import Config
from MaxText.layers.common import activation_dtype, kernel_init, param, weight_dtype
from MaxText.layers.norms import RMSNorm
from MaxText.layers.vocab_parallel import embed_lookup, head_logits
from MaxText.models.decoder import ACTIVATION_AXES, LayerStack
from MaxText.models.mtp import MTPModule
from MaxText.parallel.sharding import constrain


class ModelOutput(NamedTuple):
    logits_BSV: jax.Array  # main next-token logits (float32 or wider)
    mtp_logits_NBSV: jax.Array | None  # MTP depth k predicts token i+k+1 at position i (k = 1..N)


class HeadInputs(NamedTuple):
    """What the output head reads (``logits=False``): the loss applies the head itself, a slice of
    the sequence at a time (``vocab_chunks``), so the [B, S, V] logits are never whole."""

    normed_BSD: jax.Array
    mtp_normed_NBSD: jax.Array | None


def output_logits(normed_BSD: jax.Array, head_DV: jax.Array) -> jax.Array:
    """The output head: [B, S, D] x [D, V] -> [B, S, V] logits in float32 (or wider)."""
    return constrain(head_logits(normed_BSD, head_DV), ("activation_batch", "activation_length", "activation_vocab"))


def shift_left(x_BS: jax.Array, k: int) -> jax.Array:
    """``x[:, i + k]`` at position i; the last k positions wrap around (callers mask them)."""
    return jnp.roll(x_BS, -k, axis=1)


class DeepSeekV3(nn.Module):
    config: Config

    @nn.compact
    def __call__(
        self, tokens_BS: jax.Array, positions_BS: jax.Array, segment_ids_BS: jax.Array, logits: bool = True
    ) -> ModelOutput | HeadInputs:
        """Next-token logits of the main head and every MTP depth, or with ``logits=False`` the
        normalised hidden states they are computed from."""
        c = self.config
        V, D = c.vocab_size, c.emb_dim
        embedding_VD = self.param("token_embedding", kernel_init(c, ("vocab", "embed")), (V, D), weight_dtype(c))

        def embed(ids_BS: jax.Array) -> jax.Array:
            # Split over the vocabulary, the tokens gathered to the rows (vocab_parallel.py): a
            # lookup into the table's sharded embed dim would have to move the [B, S, D] result
            # from embed-sharded to batch-sharded, which XLA can only do by replicating it.
            return constrain(
                embed_lookup(embedding_VD, ids_BS, activation_dtype(c), c.vocab_chunks, c.vocab_axes()),
                ACTIVATION_AXES,
            )

        head_DV = param(self, "output_head", c, (D, V), ("embed", "vocab"))

        x_BSD = embed(tokens_BS)
        if c.first_num_dense_layers > 0:
            x_BSD = LayerStack(c, False, c.first_num_dense_layers, name="dense_layers")(
                x_BSD, positions_BS, segment_ids_BS
            )
        if c.num_moe_layers > 0:
            x_BSD = LayerStack(c, True, c.num_moe_layers, pipeline=True, name="moe_layers")(
                x_BSD, positions_BS, segment_ids_BS
            )
        normed = [RMSNorm(c, name="final_norm")(x_BSD)]

        h_BSD = x_BSD
        for k in range(1, c.mtp_num_layers + 1):
            mtp = MTPModule(c, name=f"mtp_{k}")
            h_BSD, normed_BSD = mtp(h_BSD, embed(shift_left(tokens_BS, k)), positions_BS, segment_ids_BS)
            normed.append(normed_BSD)
        if not logits:
            return HeadInputs(normed[0], jnp.stack(normed[1:]) if len(normed) > 1 else None)
        all_logits = [output_logits(n, head_DV) for n in normed]
        return ModelOutput(all_logits[0], jnp.stack(all_logits[1:]) if len(all_logits) > 1 else None)
