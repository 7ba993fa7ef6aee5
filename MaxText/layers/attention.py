"""Multi-head latent attention (MLA), DeepSeek-V2/V3.

Queries go through a low-rank bottleneck (``q_lora_rank``, RMS-normalised) unless it is 0; keys
and values come from one compressed latent (``kv_lora_rank``, RMS-normalised) plus a small rotary
key (``qk_rope_head_dim``) that is computed once and shared by every head. Each head's query and
key are ``[nope ; rope]`` parts; values have their own width (``v_head_dim``).

This is the training form (the latent is expanded to per-head keys and values); the
"absorbed" form that caches only the latent is an inference optimisation. The softmax attention
itself is ``attention_ops.attend``, whose backend the ``attention`` key picks; the shared rotary
key is broadcast to every head before the call (see there why).

Shape legend: B batch, S/T query/key positions, D model dim, H heads, R a low rank,
K qk head dim, V value head dim.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from MaxText.config import Config
from MaxText.layers.attention_ops import attend
from MaxText.layers.common import project
from MaxText.layers.norms import RMSNorm
from MaxText.layers.remat import saved
from MaxText.layers.rotary import apply_rope
from MaxText.parallel.sharding import constrain


class MLA(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, x_BSD: jax.Array, positions_BS: jax.Array, segment_ids_BS: jax.Array) -> jax.Array:
        c = self.config
        D, H = x_BSD.shape[-1], c.base_num_query_heads
        nope, rope, V = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        # The projections run in FP8 when `quantization` asks (`project`); the attention core never.

        # Queries: [B, S, H, nope + rope], optionally through the low-rank bottleneck.
        if c.q_lora_rank > 0:
            cq_BSR = saved(project(self, "wq_a", c, x_BSD, (D, c.q_lora_rank), ("embed", "q_lora")), "query_latent")
            cq_BSR = RMSNorm(c, name="q_norm")(cq_BSR)
            q_BSHK = project(self, "wq_b", c, cq_BSR, (c.q_lora_rank, H, nope + rope), ("q_lora", "heads", "head_dim"))
            q_BSHK = saved(q_BSHK, "query")
        else:
            q_BSHK = saved(project(self, "wq", c, x_BSD, (D, H, nope + rope), ("embed", "heads", "head_dim")), "query")
        q_nope, q_rope = q_BSHK[..., :nope], q_BSHK[..., nope:]
        q_rope = apply_rope(q_rope, positions_BS, c)

        # Keys and values from the compressed latent; the rotary key is shared by all heads.
        kv_a = saved(
            project(self, "wkv_a", c, x_BSD, (D, c.kv_lora_rank + rope), ("embed", "kv_lora")), "key_value_latent"
        )
        latent_BSR = RMSNorm(c, name="kv_norm")(kv_a[..., : c.kv_lora_rank])
        k_rope_BS1 = apply_rope(kv_a[..., None, c.kv_lora_rank :], positions_BS, c)
        kv_BSHK = project(self, "wkv_b", c, latent_BSR, (c.kv_lora_rank, H, nope + V), ("kv_lora", "heads", "head_dim"))
        kv_BSHK = saved(kv_BSHK, "key_value")
        k_nope, v_BTHV = kv_BSHK[..., :nope], kv_BSHK[..., nope:]

        # Causal, document-masked softmax attention over per-head [nope ; rope] queries and keys.
        q_BSHK = jnp.concatenate([q_nope, q_rope], axis=-1)
        k_BTHK = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope_BS1, (*k_nope.shape[:-1], rope))], axis=-1)
        out_BSHV = attend(q_BSHK, k_BTHK, v_BTHV, segment_ids_BS, c)
        out_BSHV = constrain(out_BSHV, ("activation_batch", "activation_length", "activation_heads", None))

        return saved(
            project(self, "wo", c, out_BSHV, (H, V, D), ("heads", "head_dim", "embed"), contract=2), "attention_out"
        )
