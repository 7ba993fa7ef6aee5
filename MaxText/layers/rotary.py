"""Rotary position embedding with YaRN context extension, as DeepSeek-V3 uses it.

YaRN (arXiv 2309.00071) keeps high frequencies (many rotations over the original context)
as they are, divides low frequencies by ``rope_factor``, and ramps linearly in between. It
also sharpens attention: the softmax scale is multiplied by ``mscale(rope_mscale_all_dim)^2``
and cos/sin by ``mscale(rope_mscale) / mscale(rope_mscale_all_dim)`` (1 for the release).

The rotation acts on pairs of dims: interleaved pairs ``(2i, 2i+1)`` (``rope_interleave``, the
layout of the released weights) or halves ``(i, i + d/2)``.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

from MaxText.config import Config
from MaxText.layers.common import float32_or_wider


def yarn_mscale(scale: float, mscale: float) -> float:
    """Attention magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 when not extending)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_correction_dim(num_rotations: float, dim: int, base: float, max_position: int) -> float:
    """The rotary dim index whose wavelength fits ``num_rotations`` times into ``max_position``."""
    return dim * math.log(max_position / (num_rotations * 2 * math.pi)) / (2 * math.log(base))


def rope_inv_freq(config: Config) -> np.ndarray:
    """Inverse frequencies [qk_rope_head_dim // 2], YaRN-corrected when ``rope_type: yarn``."""
    dim, base = config.qk_rope_head_dim, config.rope_max_timescale
    inv_freq = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if config.rope_type != "yarn":
        return inv_freq
    length = config.original_max_position_embeddings
    low = max(math.floor(_yarn_correction_dim(config.beta_fast, dim, base, length)), 0)
    high = min(math.ceil(_yarn_correction_dim(config.beta_slow, dim, base, length)), dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero in the ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    return inv_freq / config.rope_factor * ramp + inv_freq * (1.0 - ramp)


def rope_magnitude(config: Config) -> float:
    """The factor YaRN applies to cos and sin."""
    if config.rope_type != "yarn":
        return 1.0
    return yarn_mscale(config.rope_factor, config.rope_mscale) / yarn_mscale(
        config.rope_factor, config.rope_mscale_all_dim
    )


def softmax_scale(config: Config) -> float:
    """``qk_head_dim^-0.5``, times ``mscale^2`` under YaRN."""
    scale = config.qk_head_dim**-0.5
    if config.rope_type == "yarn":
        scale *= yarn_mscale(config.rope_factor, config.rope_mscale_all_dim) ** 2
    return scale


def apply_rope(x_BSNd: jax.Array, positions_BS: jax.Array, config: Config) -> jax.Array:
    """Rotate the last dim of ``x`` [B, S, N, d] by position (N heads, or 1 for the shared key)."""
    compute_dtype = float32_or_wider(x_BSNd.dtype)
    inv_freq = jnp.asarray(rope_inv_freq(config), dtype=compute_dtype)
    angles_BSh = positions_BS.astype(compute_dtype)[..., None] * inv_freq
    magnitude = rope_magnitude(config)
    cos = (jnp.cos(angles_BSh) * magnitude)[:, :, None, :]
    sin = (jnp.sin(angles_BSh) * magnitude)[:, :, None, :]
    x = x_BSNd.astype(compute_dtype)
    if config.rope_interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(x.shape)
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BSNd.dtype)
