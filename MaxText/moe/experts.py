"""The routed experts behind one function: dispatch, grouped SwiGLU matmuls, weighted combine.

A backend runs the experts' SwiGLU MLPs over the dispatch layout, chosen by ``moe_matmul``; the
layout (the copies sorted by expert, each expert padded to the smallest block for ``blocked``) is
built once per MoE block by the same gather that sorts. Backends built on a grouped matmul compose
three of them; ``blocked`` fuses the whole SwiGLU into one loop over blocks.

- ``tokamax``: tokamax's grouped GEMM kernels over the sorted, unpadded layout (Mosaic GPU or
  Triton per GPU generation: ``tokamax_matmul.py``); one kernel launch per GEMM, no host
  round-trip. GPU only (its XLA reference runs the CPU tests). The default on GPU.
- ``blocked``: blocks of halving sizes and one loop of dense per-block SwiGLUs (ours; portable;
  the default on CPU, and with FP8, whose GEMMs it holds). On GPU its loop's trip counts are data,
  which XLA:GPU reads on the host every iteration.
- ``ragged_dot``: XLA's grouped matmul over the sorted, unpadded layout. A real grouped matmul
  on TPU; XLA:GPU (jaxlib 0.10.2) rewrites it into one dense matmul over every local expert
  (the rows masked per expert), so it does ``E_local`` x the expert FLOPs there
  (``tools/aot_compile.py --target`` shows it).
- ``te``: Transformer Engine's grouped GEMM (GPU; imported only when chosen). Never ``auto``'s
  choice: it copies the group sizes to the host every call (a stream synchronisation), and it has
  not run in this repository's tests.
- ``auto``: ``tokamax`` on GPU with bfloat16 activations, ``blocked`` with FP8 or float32;
  ``ragged_dot`` on TPU; ``blocked`` on CPU.

``capacity_factor > 0`` replaces all of them with the token-dropping baseline (``capacity.py``).
With an expert mesh axis larger than 1, the backend runs per device on that device's experts, and
``moe_ep_comm`` picks how tokens travel to them (``expert_parallel.py``, ``te_exchange.py``).

Shape legend: T tokens, K experts per token, E experts, D model dim, F expert hidden dim,
P padded rows.
"""

import contextlib
from collections.abc import Callable
from functools import partial

import jax

from MaxText.config import Config, ConfigError
from MaxText.layers.common import import_error
from MaxText.layers.remat import saved
from MaxText.moe import tokamax_matmul
from MaxText.moe.blocked import blocked_swiglu, expert_blocks, level_rows
from MaxText.moe.capacity import capacity_experts
from MaxText.moe.dispatch import (
    BlockLayout,
    block_layout,
    combine,
    in_rounds,
    row_weights,
    sort_copies,
    sum_copies,
    to_blocks,
)
from MaxText.moe.expert_parallel import dispatch_quantized, expert_axis, expert_parallel_experts
from MaxText.moe.te_exchange import ALIGN_ROWS
from MaxText.parallel.platform import GPU_PLATFORMS, trace_platform
from MaxText.quantization import recipe_of

# The routed experts run under this name (JAX's op names carry it, the exchange included): the
# ahead-of-time compile counts their FLOPs by it.
EXPERTS_SCOPE = "routed_experts"

# A grouped matmul: rows of the layout times their expert's weight, [P, I] x [E, I, O] -> [P, O];
# the last argument, ``zero_past_groups``, False where the caller reads no row past the last group
# (those rows are then whatever the kernel leaves there: unspecified).
GroupedMatmul = Callable[[jax.Array, jax.Array, BlockLayout, bool], jax.Array]
# A backend: rows of the layout through their expert's SwiGLU, [P, D] x (wi_0, wi_1, wo) -> [P, D],
# each row's output scaled by ``weight_P`` when given (its router weight); with
# ``zero_past_groups=False`` the output's rows past the last group are unspecified (the caller
# zeroes what it reads of them: ``swiglu_experts``, the last row).
ExpertsBackend = Callable[..., jax.Array]


def _blocked(xp_PD, wi_0, wi_1, wo, layout: BlockLayout, config: Config, weight_P=None, zero_past_groups=True):
    del zero_past_groups  # its padding rows come out zero either way
    # Levels larger than the layout are left out (a small layout: few tokens or a small capacity).
    rows = tuple(B for B in level_rows(config.moe_block_rows, config.moe_min_block_rows) if B <= xp_PD.shape[0])
    blocks = expert_blocks(layout.start_E, layout.padded_E, rows, xp_PD.shape[0])
    yp_PD = blocked_swiglu(rows, recipe_of(config), xp_PD, wi_0, wi_1, wo, blocks)
    return yp_PD if weight_P is None else yp_PD * weight_P[:, None].astype(yp_PD.dtype)


def _swiglu_of(matmul: GroupedMatmul) -> ExpertsBackend:
    """The SwiGLU as three grouped matmuls over the unpadded sorted rows. The router weight
    scales the hidden activations ([P, F], fused with the SwiGLU's product) rather than the
    output ([P, D], D / F = 3.5x larger for DeepSeek-V3): the same product, one pass over the
    layout fewer forward and a smaller reduction for the weights' gradient."""

    def swiglu(xp_PD, wi_0, wi_1, wo, layout, config, weight_P=None, zero_past_groups=True):
        gate_PF = saved(matmul(xp_PD, wi_0, layout, True), "routed_gate_up")
        up_PF = saved(matmul(xp_PD, wi_1, layout, True), "routed_gate_up")
        h_PF = jax.nn.silu(gate_PF) * up_PF
        if weight_P is not None:
            h_PF = h_PF * weight_P[:, None].astype(h_PF.dtype)
        return matmul(h_PF, wo, layout, zero_past_groups)

    return swiglu


def _ragged_dot(x_PI: jax.Array, w_EIO: jax.Array, layout: BlockLayout, zero_past_groups: bool) -> jax.Array:
    return jax.lax.ragged_dot(x_PI, w_EIO, layout.sizes_E)  # zero past the last group either way


def _transformer_engine(x_PI: jax.Array, w_EIO: jax.Array, layout: BlockLayout, zero_past_groups: bool) -> jax.Array:
    """TE wants the groups to cover every row: the layout's trailing zero rows join the last group
    (zero rows give zero outputs)."""
    from transformer_engine.jax.dense import grouped_dense

    return grouped_dense(x_PI, w_EIO, layout.sizes_E.at[-1].add(x_PI.shape[0] - layout.sizes_E.sum()))


def _tokamax(x_PI: jax.Array, w_EIO: jax.Array, layout: BlockLayout, zero_past_groups: bool) -> jax.Array:
    return tokamax_matmul.grouped_matmul(x_PI, w_EIO, layout.sizes_E, zero_past_groups=zero_past_groups)


BACKENDS: dict[str, ExpertsBackend] = {
    "tokamax": _swiglu_of(_tokamax),
    "blocked": _blocked,
    "ragged_dot": _swiglu_of(_ragged_dot),
    "te": _swiglu_of(_transformer_engine),
}


def swiglu_experts(
    x_TD, experts_TK, active_TK, weights_TK, wi_0, wi_1, wo, config: Config, backend: str, capacity: int | None = None
) -> jax.Array:
    """Each token's expert outputs summed with its weights, [T, D], computed in the backend's
    layout (``blocked`` pads each expert to its smallest block; the others use the sorted rows
    unpadded). Copies whose ``active_TK`` is false (None: all active) contribute nothing and cost
    nothing.

    ``capacity`` (None: every copy) sizes the layout for that many copies: a device that receives
    more than its share under expert parallelism runs further passes over the rest (``in_rounds``),
    so memory follows the share, not the worst case, and nothing is dropped."""
    M, rows, E = experts_TK.size, row_multiple(backend, config), wi_0.shape[0]
    copies = sort_copies(experts_TK, E, active_TK)  # once for every pass
    align = layout_alignment(backend)

    def one_pass(q):
        layout = block_layout(experts_TK, E, rows, active_TK, capacity, q * (capacity or 0), copies, align)
        weight_P = row_weights(weights_TK, layout)
        xp_PD = to_blocks(x_TD, layout)
        yp_PD = BACKENDS[backend](xp_PD, wi_0, wi_1, wo, layout, config, weight_P=weight_P, zero_past_groups=False)
        # Only the last row past the groups is read (inactive copies point there): zero it alone,
        # in place, rather than the whole output.
        yp_PD = yp_PD.at[-1].set(0)
        return sum_copies(yp_PD, layout.copy_P, layout.valid_P, layout.row_TK)

    if capacity is None or capacity >= M:
        return one_pass(0)
    return in_rounds(one_pass, copies.sizes_E.sum(), capacity, -(-M // capacity))


def row_multiple(backend: str, config: Config) -> int:
    """What the backend's layout pads each expert's rows to a multiple of."""
    return config.moe_min_block_rows if backend == "blocked" else 1


def layout_alignment(backend: str) -> int:
    """What the backend's layout pads its total rows to a multiple of (a kernel's row tile)."""
    return tokamax_matmul.ROW_ALIGN if backend == "tokamax" else 1


def transformer_engine_error() -> str | None:
    """Why Transformer Engine's ``transformer_engine.jax`` cannot be used here, or None if it can."""
    return import_error("transformer_engine.jax")


def _resolve_auto(
    name: str, platform: str | None, te: bool | None, gpu_choice: str, tpu_choice: str, cpu_choice: str
) -> str:
    """``auto`` becomes Transformer Engine on GPU when it is available (``te``; None: when it
    imports), else the platform's choice (platform default: the one the trace is for)."""
    if name != "auto":
        return name
    platform = platform or trace_platform()
    if platform in GPU_PLATFORMS:
        te = transformer_engine_error() is None if te is None else te
        return "te" if te else gpu_choice
    return tpu_choice if platform == "tpu" else cpu_choice


def resolve_backend(
    name: str, platform: str | None = None, te: bool | None = None, fp8: bool = False, dtype: str = "auto"
) -> str:
    """The grouped-matmul backend ``moe_matmul`` names. ``auto`` is tokamax on GPU (Transformer
    Engine or not: ``te`` is chosen by name only, see the module docstring), ragged_dot on TPU,
    blocked on CPU; blocked wherever the GEMMs are FP8 (``fp8``: ``quantization`` on; the only
    backend with FP8 GEMMs, ``config.check_rules`` refuses the others by name) or the activations
    are float32/64 on GPU (``dtype``; tokamax's Mosaic kernels take 16-bit operands)."""
    del te  # kept for the callers that resolve the exchange alongside
    if name != "auto":
        return name
    platform = platform or trace_platform()
    if fp8:
        return "blocked"
    if platform in GPU_PLATFORMS:
        return "tokamax" if dtype in tokamax_matmul.DTYPES else "blocked"
    return "ragged_dot" if platform == "tpu" else "blocked"


def config_backend(config: Config, platform: str | None = None, te: bool | None = None) -> str:
    """``moe_matmul`` of ``config`` as ``resolve_backend`` resolves it, FP8 included."""
    return resolve_backend(config.moe_matmul, platform, te, fp8=config.quantization != "none", dtype=config.dtype)


def resolve_exchange(name: str, platform: str | None = None, te: bool | None = None) -> str:
    """The expert-parallel exchange ``moe_ep_comm`` names: ``auto`` is Transformer Engine's NCCL EP,
    else exact-size ragged_all_to_all on GPU/TPU, else allgather."""
    return _resolve_auto(name, platform, te, "ragged_all_to_all", "ragged_all_to_all", "allgather")


def check_backend(config: Config, platform: str) -> None:
    """Fail early, saying what to install or choose instead, when the chosen backend or
    expert-parallel exchange cannot run here."""
    backend = config_backend(config, platform)
    if backend == "tokamax":
        _check_tokamax(config, platform)
    if backend == "te" and (reason := transformer_engine_error()):
        raise ConfigError(
            f"config key 'moe_matmul': 'te' needs Transformer Engine for JAX, which does not import here ({reason}); "
            "install requirements-gpu.txt in a CUDA image (docker/Dockerfile.gpu) or choose blocked/ragged_dot"
        )
    exchange = resolve_exchange(config.moe_ep_comm, platform)
    if exchange == "te" and config.moe_exchange_chunks > 1:
        raise ConfigError(
            f"config key 'moe_exchange_chunks': {config.moe_exchange_chunks}, but moe_ep_comm resolves to te, whose "
            "exchange is not chunked; set 1, or moe_ep_comm=ragged_all_to_all"
        )
    if exchange == "ragged_all_to_all" and platform == "cpu":
        raise ConfigError(
            "config key 'moe_ep_comm': ragged_all_to_all runs on GPU/TPU only (XLA:CPU does not implement "
            "ragged-all-to-all); choose all_to_all or allgather on CPU"
        )
    if exchange == "te" and (reason := transformer_engine_error()):
        raise ConfigError(
            f"config key 'moe_ep_comm': 'te' needs Transformer Engine for JAX with NCCL EP, which does not import "
            f"here ({reason}); install requirements-gpu.txt in a CUDA image (docker/Dockerfile.gpu) or choose "
            "ragged_all_to_all/all_to_all/allgather"
        )
    blocked = backend == "blocked"
    if exchange == "te" and blocked and ALIGN_ROWS % config.moe_min_block_rows:
        raise ConfigError(
            f"config key 'moe_min_block_rows': must divide {ALIGN_ROWS} (moe_ep_comm=te pads each expert's "
            f"received rows to a multiple of it), got {config.moe_min_block_rows}"
        )


def _check_tokamax(config: Config, platform: str) -> None:
    if platform not in GPU_PLATFORMS:
        raise ConfigError(
            f"config key 'moe_matmul': tokamax runs GPU kernels (Mosaic GPU, Triton) and this run is on {platform}; "
            "choose blocked (the CPU default) or ragged_dot here"
        )
    if reason := tokamax_matmul.import_error():
        raise ConfigError(f"config key 'moe_matmul': tokamax does not import here ({reason}); install requirements.txt")
    if config.dtype not in tokamax_matmul.DTYPES:
        raise ConfigError(
            f"config key 'moe_matmul': tokamax's kernels take bfloat16 operands, and dtype is {config.dtype}; "
            "set dtype=bfloat16 or choose blocked"
        )


def moe_context(config: Config, mesh: jax.sharding.Mesh, tokens_per_device: int) -> contextlib.AbstractContextManager:
    """What the training loop must run inside for the chosen exchange: Transformer Engine's NCCL EP
    is bootstrapped once, eagerly, for the mesh; every other exchange needs nothing. Enter it
    inside the mesh and the logical axis rules."""
    axis = expert_axis()
    if axis is None or config.capacity_factor > 0 or resolve_exchange(config.moe_ep_comm) != "te":
        return contextlib.nullcontext()
    from MaxText.moe.te_exchange import ep_context

    return ep_context(config, mesh, tokens_per_device, axis)


def routed_experts(
    x_TD: jax.Array,
    experts_TK: jax.Array,
    weights_TK: jax.Array,
    wi_0: jax.Array,
    wi_1: jax.Array,
    wo: jax.Array,
    config: Config,
) -> jax.Array:
    """``sum_k weights[t, k] * SwiGLU_{experts[t, k]}(x[t])`` for every token: [T, D] -> [T, D].

    Dropless unless ``capacity_factor > 0`` asks for the token-dropping baseline."""
    with jax.named_scope(EXPERTS_SCOPE):
        return _routed_experts(x_TD, experts_TK, weights_TK, wi_0, wi_1, wo, config)


def _routed_experts(x_TD, experts_TK, weights_TK, wi_0, wi_1, wo, config: Config) -> jax.Array:
    if config.capacity_factor > 0:
        return combine(capacity_experts(x_TD, experts_TK, wi_0, wi_1, wo, config.capacity_factor), weights_TK)
    backend = config_backend(config)
    local_experts = partial(swiglu_experts, backend=backend)
    axis = expert_axis()
    if axis is None:
        return local_experts(dispatch_quantized(x_TD, config), experts_TK, None, weights_TK, wi_0, wi_1, wo, config)
    exchange = resolve_exchange(config.moe_ep_comm)
    if exchange == "te":
        from MaxText.moe.te_exchange import te_experts

        # Transformer Engine's NCCL EP dispatch carries the activation dtype: with FP8 the rows
        # are quantized as the other exchanges send them, and travel in it (exact for mxfp8).
        x_TD = dispatch_quantized(x_TD, config)

        return te_experts(x_TD, experts_TK, weights_TK, wi_0, wi_1, wo, config, BACKENDS[backend], axis)
    args = (x_TD, experts_TK, weights_TK, wi_0, wi_1, wo, config, local_experts, axis)
    return expert_parallel_experts(*args, exchange)
