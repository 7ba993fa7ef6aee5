"""One pre-norm decoder layer and the scanned stacks of them.

``x += MLA(norm(x)); x += FFN(norm(x))`` where FFN is the dense SwiGLU or the MoE block.
Layers of one kind are stacked with ``nn.scan`` (weights get a leading ``layers`` axis), so
compile time does not grow with depth; ``remat_policy`` chooses what each layer keeps for the
backward pass. With a ``stage`` mesh axis, the stack marked ``pipeline`` runs through the
circular pipeline instead (``parallel/pipeline.py``) with the same weights, stored in the same
``[layers, ...]`` layout, split over the stages, and the same statistics.

Shape legend: B batch, S sequence, D model dim, M pipeline micro-batches.
"""

from functools import partial

import flax.linen as nn
import jax

from MaxText.config import Config
from MaxText.layers.attention import MLA
from MaxText.layers.mlp import SwiGLU
from MaxText.layers.norms import RMSNorm
from MaxText.layers.remat import remat_policy
from MaxText.moe.block import BIAS, LOAD, LOSS, MOE_COLLECTIONS, MoEBlock
from MaxText.parallel.axes import STAGE_AXIS
from MaxText.parallel.pipeline import circular_pipeline, from_stages, to_stages
from MaxText.parallel.sharding import constrain, interleaved_join, interleaved_split

ACTIVATION_AXES = ("activation_batch", "activation_length", "activation_embed")
PIPELINE_LAYERS = "pipeline_layers"  # the logical name of the pipelined stack's layer dim (split over stage)


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
    """``num_layers`` identical decoder layers, scanned; with ``pipeline`` and more than one
    pipeline stage, run through the circular pipeline (initialised by the scan all the same)."""

    config: Config
    use_moe: bool
    num_layers: int
    pipeline: bool = False

    @nn.compact
    def __call__(self, x_BSD: jax.Array, positions_BS: jax.Array, segment_ids_BS: jax.Array) -> jax.Array:
        c = self.config
        # The mesh decides: a pipelined run's weights run unpipelined where no mesh splits the
        # stages (one device: tools/forward.py on its checkpoint).
        stages = jax.sharding.get_abstract_mesh().shape.get(STAGE_AXIS, 1)
        if self.pipeline and stages > 1 and not self.is_initializing():
            return self.pipelined(stages, x_BSD, positions_BS, segment_ids_BS)
        layer, policy = DecoderLayer, remat_policy(c.remat_policy, c.remat_names)
        if policy is not None:
            layer = nn.remat(layer, policy=policy, prevent_cse=False)
        stacked = nn.scan(
            layer,
            variable_axes={"params": 0, **{name: 0 for name in MOE_COLLECTIONS}},
            split_rngs={"params": True},
            in_axes=(nn.broadcast, nn.broadcast),
            length=self.num_layers,
            metadata_params={nn.PARTITION_NAME: PIPELINE_LAYERS if self.pipeline else "layers"},
        )
        x_BSD, _ = stacked(c, self.use_moe, name="layers")(x_BSD, positions_BS, segment_ids_BS)
        return x_BSD

    def pipelined(self, stages: int, x_BSD: jax.Array, positions_BS: jax.Array, segment_ids_BS: jax.Array) -> jax.Array:
        """The scan's layers through ``circular_pipeline`` over ``stages`` on M micro-batches (rows i, i + M, ...
        of the batch, so each keeps the batch's split), each in ``num_pipeline_lanes`` lanes; the
        MoE loads summed and the balance loss averaged over the micro-batches' lanes, as one batch
        would give (equal lanes: it is a mean over sequences). Each layer is the scan's layer
        applied to its slice of the stacked variables, under the remat policy."""
        c = self.config
        M, lanes = c.pipeline_microbatches, c.num_pipeline_lanes
        layer = DecoderLayer(c, self.use_moe, parent=None)
        collections = [name for name in ("params", BIAS) if self.has_variable(name, "layers")]
        stack = nn.unbox({name: self.get_variable(name, "layers") for name in collections})

        def one_layer(variables, x, side):
            (y, _), state = layer.apply(variables, x, *side, mutable=[LOAD, LOSS])
            return y, (state.get(LOAD, {}), state.get(LOSS, {}))

        split = partial(interleaved_split, n=M)
        staged = to_stages(stack, stages, c.num_pipeline_repeats)
        y_MBSD, (load, loss) = circular_pipeline(
            one_layer,
            staged,
            split(x_BSD),
            (split(positions_BS), split(segment_ids_BS)),
            lanes=lanes,
            remat_policy=remat_policy(c.remat_policy, c.remat_names),
        )
        if self.is_mutable_collection(LOAD):
            self.put_variable(LOAD, "layers", from_stages(load))
        if self.is_mutable_collection(LOSS):  # each lane's loss is a mean over its sequences
            self.put_variable(LOSS, "layers", jax.tree.map(lambda a: a / (M * lanes), from_stages(loss)))
        return constrain(interleaved_join(y_MBSD), ACTIVATION_AXES)
