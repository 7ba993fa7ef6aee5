"""Math time per GPU per step: FLOPs by GEMM class at a named fraction of peak, plus the
memory-bound kernels between them and host overhead.

Model FLOPs per GPU per step are ``gbs * S * flops_per_token / num_gpus`` for every class (balanced
routing spreads the expert work evenly). ``full`` remat runs each layer's forward twice, so every
class executes 4/3 of its model FLOPs; ``minimal`` and ``none`` recompute no matmul. GEMMs run at
the precision's peak (FP8 for fp8 and mxfp8); attention cores run in BF16 at every precision, sped
up on systems with faster softmax exponentials (a stack with ``gemms_at_dense_rate`` times every
class as the compiled program's roofline does: at the dense rate, attention at the bfloat16 one).
Non-GEMM kernels stream the activations through HBM ``Stack.elementwise_passes`` times. Host time
is launch and synchronisation time a stack without CUDA graphs spends per layer per micro-batch.

FP8 comes in two forms (``fp8_kernels``). ``fused``: the GEMMs run on FP8 tensor cores at the FP8
row of ``GEMM_EFFICIENCY`` (what the published FP8 runs did; the calibration). ``emulated``: this
repository's FP8 path (``quantization/``): every GEMM operand is quantized and dequantized by XLA
(``QUANTIZE_BYTES`` per element: the inputs and the output gradients of each quantized GEMM twice,
``fp8_gemm_io`` elements per token, and each weight once per direction per micro-batch), and the
GEMMs run at the bfloat16 rate (MX operands are exact in bfloat16).
"""

from __future__ import annotations

from MaxText.planner import circular
from MaxText.planner.constants import ACTIVATION_BYTES, GEMM_EFFICIENCY, QUANTIZE_BYTES, Stack
from MaxText.planner.layout import Layout
from MaxText.planner.model import ModelSpec, dense_rerun_names
from MaxText.planner.systems import System

# Extra executed FLOPs over model FLOPs. ``selective`` reruns the MLA up-projections (about 3% of
# the dense class for DeepSeek-V3), left out here; ``names`` reruns what its names do not keep
# (``rerun_share``, ``model.dense_rerun_names``).
RECOMPUTE = {"none": 0.0, "minimal": 0.0, "selective": 0.0, "names": 0.0, "full": 1.0 / 3.0}
# Kernel classes whose outputs a policy may not keep, the share of their forward the backward
# pass then runs again (the routed experts' gate and up: 2 of their 3 GEMMs; the attention kernel:
# all of it), and the ``remat_names`` name that keeps them under ``names``.
RERUN_SHARE = {"grouped": 2 / 3, "attention": 1.0}
NAMED_KERNELS = {"grouped": "routed_gate_up", "attention": "attention"}


def rerun_share(kind: str, spec: ModelSpec, layout: Layout, stack: Stack) -> float:
    """The share of ``kind``'s training FLOPs that the backward pass runs again, beyond
    ``RECOMPUTE``: the routed experts' input projections under ``minimal`` (kernel calls, not the
    dots it keeps) on a stack that reruns them; under ``names`` any kernel class it does not name,
    and the dense GEMMs whose outputs it does not keep (``model.dense_rerun_names``)."""
    if layout.remat in ("minimal", "selective"):
        reruns = kind == "grouped" and stack.routed_recompute
    elif layout.remat == "names":
        if kind == "dense":  # the GEMMs whose outputs the names do not keep, over the class's training FLOPs
            rerun = dense_rerun_names(spec.config) if spec.config is not None else 0.0
            return rerun / spec.flops["dense"] if spec.flops["dense"] else 0.0
        named = spec.config.remat_names if spec.config is not None else ()
        reruns = kind in NAMED_KERNELS and NAMED_KERNELS[kind] not in named
    else:
        reruns = False
    return RECOMPUTE["full"] * RERUN_SHARE[kind] if reruns else 0.0


def model_flops_per_gpu(spec: ModelSpec, layout: Layout) -> float:
    return layout.gbs * spec.seq_len * spec.flops_per_token / layout.num_gpus


def gemm_precision(precision: str, fp8_kernels: str) -> str:
    """The tensor cores' precision: emulated FP8 multiplies bfloat16 operands."""
    return "bf16" if fp8_kernels == "emulated" else precision


def math_times(
    spec: ModelSpec,
    layout: Layout,
    system: System,
    stack: Stack,
    precision: str,
    fp8_kernels: str = "fused",
    exchange_buffer_factor: float = 2.0,
) -> dict[str, float]:
    """Seconds per step by kernel class: dense, grouped, attention (GEMMs), elementwise, host, the
    MoE buffers' passes of a sort-based dispatch (``Stack.moe_buffer_passes``), and the
    quantization passes of emulated FP8."""
    tokens = layout.gbs * spec.seq_len / layout.num_gpus
    extra = 1.0 + RECOMPUTE[layout.remat]
    emulated = precision != "bf16" and fp8_kernels == "emulated"
    runs_at = gemm_precision(precision, fp8_kernels)
    row = "bf16" if runs_at == "bf16" else "fp8"
    times = {}
    for kind, flops in spec.flops.items():
        kind_row = "bf16" if kind == "attention" else row  # attention cores run in bfloat16 at every precision
        efficiency = GEMM_EFFICIENCY["dense" if stack.gemms_at_dense_rate else kind][kind_row]
        if kind == "attention":
            speedup = 1.0 if stack.gemms_at_dense_rate else system.attention_speedup
            rate = system.peak_flops("bf16") * speedup * efficiency
        else:
            rate = system.peak_flops(runs_at) * efficiency * (stack.grouped_scale if kind == "grouped" else 1.0)
        times[kind] = tokens * flops * (extra + rerun_share(kind, spec, layout, stack)) / rate
    times["elementwise"] = tokens * spec.act_none * ACTIVATION_BYTES * stack.elementwise_passes * extra / system.hbm_bw
    if stack.moe_buffer_passes:  # the exchange's slots and layouts take the factor; one device's layout, K rows
        factor = exchange_buffer_factor if layout.ep > 1 else 1.0
        row_bytes = factor * spec.top_k * spec.d_model * ACTIVATION_BYTES
        times["moe buffers"] = tokens * spec.moe_layers * row_bytes * stack.moe_buffer_passes / system.hbm_bw
    lanes = spec.config.num_pipeline_lanes if circular.applies(spec, layout, stack) else 1
    times["host"] = layout.microbatches * lanes * (spec.layers / layout.pp) * stack.host_s_per_layer
    if emulated:
        weights = spec.params_dense / (layout.tp * layout.pp) + spec.params_expert / layout.expert_shards
        moved = 2 * tokens * spec.fp8_gemm_io * extra + 2 * weights * layout.microbatches
        times["quantize"] = moved * QUANTIZE_BYTES / system.hbm_bw
    return times


def optimizer_time(state_bytes: float, system: System) -> float:
    """The AdamW update reads and writes the local state once (memory bound)."""
    return 2 * state_bytes / system.hbm_bw
