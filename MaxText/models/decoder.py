"""One pre-norm decoder layer and the scanned stacks of them.

``x += MLA(norm(x)); x += FFN(norm(x))`` where FFN is the dense SwiGLU or the MoE block.
Layers of one kind are stacked with ``nn.scan`` (weights get a leading ``layers`` axis), so
compile time does not grow with depth; ``remat_policy`` chooses what each layer keeps for the
backward pass.
"""

import flax.linen as nn
import jax

from MaxText.config import Config
from MaxText.layers.attention import MLA
from MaxText.layers.common import constrain
from MaxText.layers.mlp import SwiGLU
from MaxText.layers.norms import RMSNorm
from MaxText.moe.block import MOE_COLLECTIONS, MoEBlock

ACTIVATION_AXES = ("activation_batch", "activation_length", "activation_embed")

REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "minimal": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class DecoderLayer(nn.Module):
    config: Config
    use_moe: bool

    @nn.compact
    def __call__(self, x_BSD: jax.Array, positions_BS: jax.Array, segment_ids_BS: jax.Array):
        c = self.config
        x_BSD = constrain(x_BSD, ACTIVATION_AXES)
        x_BSD += MLA(c, name="attention")(RMSNorm(c, name="pre_attention_norm")(x_BSD), positions_BS, segment_ids_BS)
        h_BSD = RMSNorm(c, name="pre_ffn_norm")(x_BSD)
        if self.use_moe:
            x_BSD += MoEBlock(c, name="moe")(h_BSD, segment_ids_BS)
        else:
            x_BSD += SwiGLU(c, c.base_mlp_dim, name="mlp")(h_BSD)
        return constrain(x_BSD, ACTIVATION_AXES), None  # (scan carry, per-layer output)


class LayerStack(nn.Module):
    """``num_layers`` identical decoder layers, scanned."""

    config: Config
    use_moe: bool
    num_layers: int

    @nn.compact
    def __call__(self, x_BSD: jax.Array, positions_BS: jax.Array, segment_ids_BS: jax.Array) -> jax.Array:
        layer = DecoderLayer
        if self.config.remat_policy != "none":
            layer = nn.remat(layer, policy=REMAT_POLICIES[self.config.remat_policy], prevent_cse=False)
        stacked = nn.scan(
            layer,
            variable_axes={"params": 0, **{name: 0 for name in MOE_COLLECTIONS}},
            split_rngs={"params": True},
            in_axes=(nn.broadcast, nn.broadcast),
            length=self.num_layers,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        x_BSD, _ = stacked(self.config, self.use_moe, name="layers")(x_BSD, positions_BS, segment_ids_BS)
        return x_BSD
