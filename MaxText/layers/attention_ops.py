"""Softmax attention behind one function, with the backend chosen by the ``attention`` key.

Every backend computes the same thing, ``softmax(q k^T * scale + mask) v`` per head, with a causal
mask and a document mask from the segment ids (a key is visible when its id equals the query's;
0 = padding, which sees only padding, so no row is ever empty), and the scale of
``rotary.softmax_scale`` (YaRN's mscale included):

- ``dot``: the [B, H, S, T] scores in float32, masked, softmaxed, times the values. The
  reference; memory O(S^2) (8.6 GB per sequence per layer at H 128, S 4096, again in backward).
- ``flash``: blockwise online softmax in pure JAX with a hand-written backward
  (``flash_attention.py``); memory O(S x block); portable (CPU, GPU, TPU).
- ``cudnn``: cuDNN's fused flash attention, called through JAX's cuDNN entry
  (``jax._src.cudnn.fused_attention_stablehlo``), which takes MLA's unequal head dims (qk 192,
  v 128; cuDNN >= 9.10 on Hopper and later): the public ``jax.nn.dot_product_attention`` wants
  values as wide as keys, and zero-padding them costs half as much again of the value matmul's work
  (qk 192 against v 128). Documents are a boolean [B, 1, S, T]
  mask (cuDNN turns it into a bias: O(S^2) per sequence, not per head). GPU only, bfloat16/float16
  only, head dims <= 256 and multiples of 8.
- ``te``: Transformer Engine's fused attention (cuDNN underneath) in its packed THD layout: the
  documents of a row become cuDNN's variable-length segments, so no mask is materialised and
  qk/v head dims may differ. The segment count per row is a static shape,
  ``attention_max_segments``: rows packed with more documents are not masked correctly. GPU only;
  imported only here, when chosen.
- ``auto``: on GPU with 16-bit activations ``te`` when it imports, else ``cudnn``; otherwise
  ``flash`` from S >= ``FLASH_MIN_LENGTH`` and ``dot`` below it (blocks would be the whole sequence).

The interface takes per-head keys [B, T, H, K]. MLA's rotary key is shared by the heads; it is
broadcast before the call (B x T x H x 64 values, small next to the scores) because cuDNN and TE
take per-head keys, and one shape for every backend keeps them interchangeable.

Shape legend: B batch, S query positions, T key positions, H heads, K qk head dim, V value head dim.
"""

from collections.abc import Callable
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp

from MaxText.config import Config, ConfigError
from MaxText.layers.common import float32_or_wider, import_error
from MaxText.layers.flash_attention import flash_attention
from MaxText.layers.rotary import softmax_scale
from MaxText.parallel.platform import GPU_PLATFORMS, trace_platform
from MaxText.parallel.sharding import without_manual_axes

# From this length dot's scores start to cost memory (H x 4 MB at 1,024 in float32); below it dot's
# one program is small, and flash's blocks would cover most of the sequence.
FLASH_MIN_LENGTH = 1024
HALF_DTYPES = ("bfloat16", "float16")

# Every backend runs under this name (JAX's op names carry it): the ahead-of-time compile counts
# the attention core's FLOPs by it.
ATTENTION_SCOPE = "attention_core"

# An attention backend: (q [B,S,H,K], k [B,T,H,K], v [B,T,H,V], segment ids [B,S], config) -> [B,S,H,V].
AttentionBackend = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, Config], jax.Array]


def attention_mask(segment_ids_BS: jax.Array) -> jax.Array:
    """[B, 1, S, S] boolean: causal, and only within the same document (segment id; 0 = padding)."""
    S = segment_ids_BS.shape[1]
    causal_SS = jnp.tril(jnp.ones((S, S), dtype=bool))
    return causal_SS[None, None] & _same_document(segment_ids_BS)


def _same_document(segment_ids_BS: jax.Array) -> jax.Array:
    """[B, 1, S, S] boolean: query and key in the same document."""
    return (segment_ids_BS[:, :, None] == segment_ids_BS[:, None, :])[:, None]


def segment_positions(segment_ids_BS: jax.Array) -> jax.Array:
    """[B, S] position of each token inside its run of equal segment ids (0 at each run's start)."""
    S = segment_ids_BS.shape[1]
    index_S = jnp.arange(S)
    starts_BS = jnp.concatenate(
        [jnp.ones_like(segment_ids_BS[:, :1], bool), segment_ids_BS[:, 1:] != segment_ids_BS[:, :-1]], axis=1
    )
    start_BS = jax.lax.cummax(jnp.where(starts_BS, index_S, 0), axis=1)
    return (index_S - start_BS).astype(jnp.int32)


# ---------------------------------------------------------------- backends


def dot_attention(q_BSHK, k_BTHK, v_BTHV, segment_ids_BS, config: Config) -> jax.Array:
    """The full score matrix in float32 (or wider): the reference every other backend is tested against."""
    acc = float32_or_wider(q_BSHK.dtype)
    scores_BHST = jnp.einsum("bshk,bthk->bhst", q_BSHK, k_BTHK, preferred_element_type=acc)
    scores_BHST *= softmax_scale(config)
    scores_BHST = jnp.where(attention_mask(segment_ids_BS), scores_BHST, jnp.finfo(acc).min)
    probs_BHST = jax.nn.softmax(scores_BHST, axis=-1).astype(v_BTHV.dtype)
    return jnp.einsum("bhst,bthv->bshv", probs_BHST, v_BTHV)


def _flash(q_BSHK, k_BTHK, v_BTHV, segment_ids_BS, config: Config) -> jax.Array:
    scale = softmax_scale(config)
    return flash_attention(
        q_BSHK, k_BTHK, v_BTHV, segment_ids_BS, scale, config.attention_block_q, config.attention_block_kv
    )


def _cudnn(q_BSHK, k_BTHK, v_BTHV, segment_ids_BS, config: Config, implementation: str = "cudnn") -> jax.Array:
    """cuDNN flash attention with the causal flag, the document mask and the softmax scale.
    ``implementation="xla"`` runs the same arguments through ``jax.nn.dot_product_attention``'s XLA
    path (values zero-padded to the keys' width, the output sliced back), which is how CPU tests
    check them; the GPU compile checks the cuDNN call itself (tests/test_aot_gpu.py)."""
    mask_BHST, scale = _same_document(segment_ids_BS), softmax_scale(config)
    if implementation == "cudnn":
        from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention

        return dot_product_attention(
            q_BSHK, k_BTHK, v_BTHV, mask=mask_BHST, scale=scale, mask_type=MaskType.CAUSAL, qkv_layout="BTNH"
        )
    width = max(q_BSHK.shape[-1], v_BTHV.shape[-1])

    def widen(x):  # zero dims add nothing to q.k and give outputs that are sliced off
        return jnp.pad(x, [(0, 0)] * 3 + [(0, width - x.shape[-1])])

    out_BSHW = jax.nn.dot_product_attention(
        widen(q_BSHK), widen(k_BTHK), widen(v_BTHV), mask=mask_BHST, scale=scale, is_causal=True, implementation="xla"
    )
    return out_BSHW[..., : v_BTHV.shape[-1]]


def _transformer_engine(q_BSHK, k_BTHK, v_BTHV, segment_ids_BS, config: Config) -> jax.Array:
    from transformer_engine.jax.attention import (
        AttnBiasType,
        AttnMaskType,
        AttnSoftmaxType,
        QKVLayout,
        SequenceDescriptor,
        fused_attn,
    )

    sequences = SequenceDescriptor.from_segment_ids_and_pos(segment_ids_BS, segment_positions(segment_ids_BS))
    return fused_attn(
        (q_BSHK, k_BTHK, v_BTHV),
        None,
        sequences,
        None,
        AttnBiasType.NO_BIAS,
        AttnMaskType.PADDING_CAUSAL_MASK,
        QKVLayout.THD_THD_THD,
        AttnSoftmaxType.VANILLA_SOFTMAX,
        scaling_factor=softmax_scale(config),
        dropout_probability=0.0,
        is_training=True,
        max_segments_per_seq=config.attention_max_segments,
    )


BACKENDS: dict[str, AttentionBackend] = {
    "dot": dot_attention,
    "flash": _flash,
    "cudnn": _cudnn,
    "te": _transformer_engine,
}
CUSTOM_PARTITIONED = ("cudnn", "te")  # kernels JAX partitions by a rule of their own (custom_partitioning)


# ---------------------------------------------------------------- choice and checks


def transformer_engine_attention_error() -> str | None:
    """Why Transformer Engine's ``transformer_engine.jax.attention`` cannot be used here, or None if it can."""
    return import_error("transformer_engine.jax.attention")


def resolve_attention(config: Config, seq_len: int, platform: str | None = None, te: bool | None = None) -> str:
    """The backend the ``attention`` key names for this length and platform (default: the traced-for
    one); ``te`` says whether Transformer Engine is available (None: whether it imports)."""
    if config.attention != "auto":
        return config.attention
    platform = platform or trace_platform()
    if platform in GPU_PLATFORMS and config.dtype in HALF_DTYPES:
        te = transformer_engine_attention_error() is None if te is None else te
        return "te" if te else "cudnn"
    return "flash" if seq_len >= FLASH_MIN_LENGTH else "dot"


def check_attention(config: Config, platform: str, seq_len: int | None = None) -> None:
    """Fail early with a one-line ConfigError when the chosen backend cannot run here."""
    seq_len = config.max_target_length if seq_len is None else seq_len
    backend = resolve_attention(config, seq_len, platform)
    if backend not in ("cudnn", "te"):
        return
    what = "cuDNN fused attention" if backend == "cudnn" else "Transformer Engine fused attention"
    if platform not in GPU_PLATFORMS:
        raise ConfigError(
            f"config key 'attention': {backend} ({what}) runs on GPU only, not on {platform}; choose flash or dot"
        )
    if config.dtype not in HALF_DTYPES:
        raise ConfigError(
            f"config key 'attention': {backend} ({what}) needs dtype bfloat16 or float16, got {config.dtype}; "
            "choose flash or dot for this dtype"
        )
    if backend == "te" and (reason := transformer_engine_attention_error()):
        raise ConfigError(
            f"config key 'attention': 'te' needs Transformer Engine for JAX, which does not import here ({reason}); "
            "install requirements-gpu.txt in a CUDA image (docker/Dockerfile.gpu) or choose cudnn/flash"
        )
    width = max(config.qk_head_dim, config.v_head_dim)
    if backend == "cudnn" and (width > 256 or width % 8):
        raise ConfigError(
            f"config key 'attention': cudnn takes head dims up to 256 in multiples of 8, got "
            f"{width} (qk_nope_head_dim + qk_rope_head_dim, v_head_dim); choose te or flash"
        )


def attend(q_BSHK, k_BTHK, v_BTHV, segment_ids_BS, config: Config) -> jax.Array:
    """Causal, document-masked softmax attention [B, S, H, V] by the backend ``attention`` picks."""
    seq_len = q_BSHK.shape[1]
    check_attention(config, trace_platform(), seq_len)
    backend = resolve_attention(config, seq_len)
    run = partial(BACKENDS[backend], config=config)
    mesh = jax.sharding.get_abstract_mesh()
    if backend in CUSTOM_PARTITIONED and not mesh.empty and mesh.manual_axes:
        run = on_each_shard(run)
    with jax.named_scope(ATTENTION_SCOPE):
        return run(q_BSHK, k_BTHK, v_BTHV, segment_ids_BS)


def on_each_shard(run: Callable) -> Callable:
    """``run`` on each device's rows and heads, in a shard_map over the mesh axes not yet manual.
    Inside a partly manual region (a pipeline stage: manual over ``stage``) JAX cannot partition
    the cuDNN and Transformer Engine kernels (custom_partitioning: its cuDNN rule reads the spec of
    a NamedSharding and is handed a GSPMD one); split by hand, there is nothing left to partition."""
    mesh = jax.sharding.get_abstract_mesh()
    qkv = without_manual_axes(nn.logical_to_mesh_axes(("activation_batch", None, "activation_heads", None)))
    rows = without_manual_axes(nn.logical_to_mesh_axes(("activation_batch", None)))
    return jax.shard_map(
        run,
        in_specs=(qkv, qkv, qkv, rows),
        out_specs=qkv,
        axis_names=set(mesh.axis_names) - set(mesh.manual_axes),
        check_vma=False,
    )
