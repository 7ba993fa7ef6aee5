"""SwiGLU feed-forward: ``wo(silu(wi_0 x) * wi_1 x)`` (gate_proj, up_proj, down_proj in HF names).

Shape legend: B batch, S sequence, D model dim, F hidden dim.
"""

import flax.linen as nn
import jax

from MaxText.config import Config
from MaxText.layers.common import project
from MaxText.layers.remat import saved
from MaxText.parallel.sharding import constrain


class SwiGLU(nn.Module):
    config: Config
    hidden_dim: int

    @nn.compact
    def __call__(self, x_BSD: jax.Array) -> jax.Array:
        c, D, F = self.config, x_BSD.shape[-1], self.hidden_dim
        gate_BSF = saved(project(self, "wi_0", c, x_BSD, (D, F), ("embed", "mlp")), "mlp_gate_up")
        up_BSF = saved(project(self, "wi_1", c, x_BSD, (D, F), ("embed", "mlp")), "mlp_gate_up")
        h_BSF = constrain(nn.silu(gate_BSF) * up_BSF, ("activation_batch", "activation_length", "activation_mlp"))
        return project(self, "wo", c, h_BSF, (F, D), ("mlp", "embed"))
