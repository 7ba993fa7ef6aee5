"""The routed experts' grouped matmul on tokamax's GPU kernels (``moe_matmul: tokamax``).

``tokamax.ragged_dot`` multiplies rows sorted by expert with their expert's weight, [P, I] x
[E, I, O] with group sizes -> [P, O], in one kernel launch per GEMM (Pallas: Mosaic GPU with
wgmma on sm_90a and tcgen05 on sm_100a, or Triton). The kernels read the group sizes on the
device, so unlike the ``blocked`` backend's loop over blocks nothing goes back to the host, and
XLA's latency-hiding scheduler can run the step's collectives ahead of them.

Each matmul is three GEMMs, forward, input gradient and weight gradient; ``KERNELS`` says which
tokamax kernel runs each one, per GPU generation (the CUDA compute capability's major version),
as checked by compiling them for H100 and GB200 targets (``tests/test_tokamax_matmul.py``). Off
a GPU (the CPU tests) the three run tokamax's XLA reference, ``jax.lax.ragged_dot``.

Alignment: the Mosaic kernels tile rows by up to 256 and need both matrix dims at least 128 and a
multiple of 64 (their shared-memory swizzles; smaller dims fail to compile). The layout's rows
come padded to ``ROW_ALIGN`` (``experts.layout_alignment``); feature dims that are not aligned
(the tiny models only: DeepSeek-V3's 7,168 and 2,048 are) are padded with zeros here. Rows past
the last group are not written by the kernels: they are zeroed on the way in and, unless the
caller reads none of them (``zero_past_groups``), on the way out, so that padding rows stay zero
forward and backward.

Shape legend: P rows (sorted by expert), I input dim, O output dim, E experts.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import jax
import jax.numpy as jnp

# The layout's rows are padded to a multiple of this (the kernels' largest row tile).
ROW_ALIGN = 256
# Matrix dims: a multiple of DIM_ALIGN and at least DIM_MIN.
DIM_ALIGN, DIM_MIN = 64, 128
# The ``dtype`` values whose operands the Mosaic kernels take (16-bit; ``auto`` is bfloat16 on GPU).
DTYPES = ("auto", "bfloat16")


@dataclass(frozen=True)
class GemmKernels:
    """The tokamax implementation ("mosaic", "triton" or "xla") of each GEMM of a grouped matmul."""

    forward: str  # y = x W_e
    data_grad: str  # dx = dy W_e^T
    weight_grad: str  # dW_e = x_e^T dy_e (groups along the contracted rows)


# Per CUDA compute capability major version. tokamax 0.0.12's sm_100 Mosaic kernel takes only the
# default dimension numbers ("Only default ragged_dot_dimension_numbers supported"), so the weight
# gradient runs its Triton kernel on Blackwell; on Hopper the Mosaic kernels cover all three.
KERNELS: dict[int, GemmKernels] = {
    9: GemmKernels("mosaic", "mosaic", "mosaic"),  # H100, H200: wgmma
    10: GemmKernels("mosaic", "mosaic", "triton"),  # B200, GB200, GB300: tcgen05
}
# Any other GPU (Ampere, consumer Blackwell): Triton's kernels, which compile for every generation.
OTHER_GPU = GemmKernels("triton", "triton", "triton")
# Off a GPU: tokamax's XLA reference for all three (jax.lax.ragged_dot).
REFERENCE = GemmKernels("xla", "xla", "xla")


def import_error() -> str | None:
    """Why tokamax cannot be used here, in one line, or None."""
    from MaxText.layers.common import import_error as error_of

    return error_of("tokamax")


def kernels_for(device: jax.Device) -> GemmKernels:
    """The kernels for ``device``: a GPU's by its compute capability, else the XLA reference."""
    if device.platform != "gpu":
        return REFERENCE
    major = int(float(device.compute_capability))
    return KERNELS.get(major, OTHER_GPU)


def traced_device() -> jax.Device:
    """The device the program is traced for: tokamax asks JAX's default device (answered with the
    target's compile device during a GPU-target compile: ``aot/targets.py``)."""
    from jax.extend import backend

    return backend.get_default_device()


@functools.cache
def _quiet_tokamax() -> None:
    """Once, before tokamax is first called. It reads its options from absl flags and, on first
    use, parses the process's sys.argv for them, failing on any dash option it does not know (a
    tool's, pytest's): its defaults are what this module wants, so the flags are taken as parsed.
    It also logs a warning with the op's whole repr (pages of text) for every call whose shapes
    its autotuning cache lacks, then runs its heuristic configuration: that is the expected path
    here (docs/moe.md), so those records are dropped."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    logging.getLogger("absl").addFilter(lambda record: "Autotuning cache miss" not in str(record.msg))


def op_class(name: str) -> type:
    """tokamax's ragged-dot op class of an implementation name ("mosaic", "triton", "xla")."""
    _quiet_tokamax()
    if name == "mosaic":
        from tokamax._src.ops.ragged_dot.pallas_mosaic_gpu import PallasMosaicGpuRaggedDot

        return PallasMosaicGpuRaggedDot
    if name == "triton":
        from tokamax._src.ops.ragged_dot.pallas_triton import PallasTritonRaggedDot

        return PallasTritonRaggedDot
    from tokamax._src.ops.ragged_dot import base

    return base.RaggedDot


@functools.cache
def _ragged_dot_op(kernels: GemmKernels):
    """A tokamax ragged-dot op whose forward and two gradients run the named kernels."""
    from tokamax._src.ops.ragged_dot import base

    grads = functools.partial(
        base.vjp, dlhs_ragged_dot=op_class(kernels.data_grad)(), drhs_ragged_dot=op_class(kernels.weight_grad)()
    )
    return op_class(kernels.forward)(vjp=grads)


def aligned_dim(n: int) -> int:
    """``n`` padded to what the kernels take."""
    return max(DIM_MIN, -(-n // DIM_ALIGN) * DIM_ALIGN)


def _pad_to(a: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    if a.shape == shape:
        return a
    return jnp.pad(a, [(0, n - m) for m, n in zip(a.shape, shape, strict=True)])


def grouped_matmul(
    x_PI: jax.Array,
    w_EIO: jax.Array,
    sizes_E: jax.Array,
    kernels: GemmKernels | None = None,
    zero_past_groups: bool = True,
) -> jax.Array:
    """``y[p] = x[p] @ w[e(p)]`` for the rows of each group (rows ``[start_e, start_e + sizes_E[e])``
    in order), zero past the last group; differentiable. ``kernels`` default: the traced device's.
    ``zero_past_groups=False`` leaves the output's rows past the last group as the kernel leaves
    them (unspecified), for a caller that never reads them: zeroing them is a pass over the
    whole [P, O] output that XLA does not fuse into a gather reading the rows (a 0.08 s pass per
    step at the GB200 recipe's down projection; its modelled step 0.05 s shorter without it)."""
    rows, d_in = x_PI.shape
    experts, _, d_out = w_EIO.shape
    kernels = kernels or kernels_for(traced_device())
    in_groups_P = (jnp.arange(rows) < sizes_E.sum())[:, None]
    x = _pad_to(jnp.where(in_groups_P, x_PI, 0), (-(-rows // ROW_ALIGN) * ROW_ALIGN, aligned_dim(d_in)))
    w = _pad_to(w_EIO.astype(x_PI.dtype), (experts, aligned_dim(d_in), aligned_dim(d_out)))
    y = _ragged_dot(x, w, sizes_E.astype(jnp.int32), kernels)[:rows, :d_out]
    return jnp.where(in_groups_P, y, 0) if zero_past_groups else y


@functools.partial(jax.jit, static_argnames="kernels")
def _ragged_dot(x: jax.Array, w: jax.Array, sizes_E: jax.Array, kernels: GemmKernels) -> jax.Array:
    """tokamax's op behind a jit of its own: every call with the same shapes (the exchange's
    chunks, the layers, the MTP module, and their gradients) shares one traced program, which JAX
    lowers once per step. Each call lowered a Mosaic GPU kernel of its own before: 132 lowerings,
    61 of the 67 s that lowering the GB200 recipe's 4-layer cut took."""
    import tokamax

    return tokamax.ragged_dot(x, w, sizes_E, implementation=[_ragged_dot_op(kernels)])
