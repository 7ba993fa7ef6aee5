"""SwiGLU feed-forward: ``wo(silu(wi_0 x) * wi_1 x)`` (gate_proj, up_proj, down_proj in HF names).

Shape legend: B batch, S sequence, D model dim, F hidden dim.
"""

import flax.linen as nn
import jax

from MaxText.config import Config
from MaxText.layers.common import constrain, param
from MaxText.quantization import linear, recipe_of


class SwiGLU(nn.Module):
    config: Config
    hidden_dim: int

    @nn.compact
    def __call__(self, x_BSD: jax.Array) -> jax.Array:
        D, F = x_BSD.shape[-1], self.hidden_dim
        fp8 = recipe_of(self.config)  # the three GEMMs in FP8 (None: in dtype)
        wi_0 = param(self, "wi_0", self.config, (D, F), ("embed", "mlp"))
        wi_1 = param(self, "wi_1", self.config, (D, F), ("embed", "mlp"))
        wo = param(self, "wo", self.config, (F, D), ("mlp", "embed"))
        gate_BSF = linear(x_BSD, wi_0, fp8)
        up_BSF = linear(x_BSD, wi_1, fp8)
        h_BSF = constrain(nn.silu(gate_BSF) * up_BSF, ("activation_batch", "activation_length", "activation_mlp"))
        return linear(h_BSF, wo, fp8)
