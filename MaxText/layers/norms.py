"""RMSNorm with float32 statistics and a learned scale (no bias), as DeepSeek-V3 uses."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from MaxText.config import Config
from MaxText.layers.common import activation_dtype, float32_or_wider, weight_dtype


class RMSNorm(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param(
            "scale",
            nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
            (x.shape[-1],),
            weight_dtype(self.config),
        )
        x = x.astype(float32_or_wider(x.dtype))
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.config.normalization_layer_epsilon)
        return (x * scale.astype(x.dtype)).astype(activation_dtype(self.config))
