"""Step time, TFLOPS/GPU, MFU and scaling efficiency of one layout: the parts combined.

    compute  = GEMMs + elementwise + MoE buffers + host          (compute.py)
    exposed  = tensor-parallel collectives                       (on the critical path)
             + the vocabulary split's token traffic x (1 - vocab_hidden)
             + dispatch x (1 - dispatch_overlap)                 } less what exchange_compute_overlap x
               (hierarchical_overlap for the two-hop exchange)    }
             + pipeline sends x (1 - dispatch_overlap)            } compute hides (DualPipe's schedule);
                                                                    this repository's sends: all exposed
             + max(0, fsdp - fsdp_overlap x compute)             (gathers hide behind other layers;
                                                                   fsdp x (1 - fsdp_hidden) for a stack
                                                                   whose schedule's share is measured)
    step     = (compute + exposed) x (1 + bubble) + max(0, dp - dp_overlap x compute / m) + optimizer
                                                                  (dp x (1 - dp_hidden) likewise)
    bubble   = (pp - 1) / (vpp x m)                              (m micro-batches: interleaved 1F1B's and
                                                                   this repository's, circular.py)

TFLOPS/GPU are model FLOPs (Megatron's count, ``model.py``) over the step time; MFU divides by the
precision's dense peak (bf16's for emulated FP8, whose GEMMs run in bf16). ``comm_fraction`` is
communication over communication + compute kernel
time, overlapped or not (the "share of accumulated kernel time" NVIDIA quotes). Scaling efficiency
compares TFLOPS/GPU with the same layout restricted to one NVLink domain (its ``ici`` part, the
per-GPU batch unchanged), whether or not the model would fit there.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from MaxText.planner import circular
from MaxText.planner.comms import Collective, collectives
from MaxText.planner.compute import gemm_precision, math_times, model_flops_per_gpu, optimizer_time
from MaxText.planner.constants import ACTIVATION_BYTES, Stack
from MaxText.planner.layout import Layout
from MaxText.planner.memory import memory_per_gpu
from MaxText.planner.model import ModelSpec
from MaxText.planner.systems import System

OCP_MX_BLOCK = 32  # the MX block of a model without a config (the OCP specification's)
DEEPSEEK_TILE = 128  # DeepSeek-V3's activation quantization tile (1 x 128 elements, one float32 scale)


def fp8_dispatch_bytes(spec: ModelSpec, stack: Stack, precision: str) -> float | None:
    """Bytes per element of a stack's FP8 dispatch at ``precision`` (None: bf16): the
    repository's recipes (``quantization/dispatch.py``), ``fp8`` as its ``fp8_blockwise`` (1 x 128
    tiles with a float32 scale, DeepSeek-V3's own), ``mxfp8`` as MX."""
    if not stack.fp8_dispatch or precision == "bf16":
        return None
    from MaxText.quantization.dispatch import dispatch_bytes_per_element
    from MaxText.quantization.quantize import Recipe

    c = spec.config
    if precision == "fp8":
        recipe = Recipe("fp8_blockwise", c.fp8_block if c is not None else DEEPSEEK_TILE)
    else:
        recipe = Recipe("mxfp8", c.mxfp8_block if c is not None else OCP_MX_BLOCK)
    return dispatch_bytes_per_element(recipe, ACTIVATION_BYTES)


@dataclass(frozen=True)
class Estimate:
    layout: Layout
    system: System
    stack: Stack
    precision: str
    fp8_kernels: str  # "fused" (FP8 tensor cores, as published) or "emulated" (this repository's FP8)
    memory: dict[str, float]
    math: dict[str, float]
    comms: list[Collective]
    exposed: dict[str, float]
    bubble: float
    step_time: float
    tflops: float
    tokens_per_s: float
    scaling_efficiency: float | None = None
    split_problem: str | None = None  # why this repository cannot split the model as the layout says

    @property
    def fits(self) -> bool:
        return self.memory["total"] <= self.system.hbm_bytes * self.stack.usable_hbm

    @property
    def mfu(self) -> float:
        return self.tflops * 1e12 / self.system.peak_flops(gemm_precision(self.precision, self.fp8_kernels))

    @property
    def compute_time(self) -> float:
        return sum(self.math.values())

    @property
    def comm_fraction(self) -> float:
        comm = sum(c.seconds for c in self.comms)
        return comm / (comm + self.compute_time)

    @property
    def dominant(self) -> str:
        return "communication" if sum(self.exposed.values()) > self.compute_time else "compute"

    @property
    def runnable(self) -> bool:
        return (
            self.layout.runnable
            and self.stack.runs_here
            and self.precision in self.precisions_here
            and self.split_problem is None
        )

    @property
    def precisions_here(self) -> tuple[str, ...]:
        """What this repository runs: bf16, and mxfp8 as emulation (its blockwise FP8 emulates in
        float32: numerics only, no speed to plan for)."""
        return ("bf16", "mxfp8") if self.fp8_kernels == "emulated" else ("bf16",)

    def not_runnable_reason(self) -> str | None:
        if not self.stack.runs_here:
            return f"stack '{self.stack.name}' is not this repository's"
        if self.precision not in self.precisions_here:
            if self.fp8_kernels == "fused":
                return (
                    "this repository's FP8 GEMMs are emulated, not fused FP8 kernels (plan with --fp8-kernels emulated)"
                )
            return "this repository's fp8_blockwise emulates its GEMMs in float32 (numerics only); mxfp8 is planned"
        if self.split_problem:
            return self.split_problem
        if not self.layout.runnable:
            return "remat policy or micro-batch this repository does not have"
        return None

    def as_dict(self) -> dict:
        return {
            "layout": self.layout.describe(),
            "system": self.system.name,
            "stack": self.stack.name,
            "precision": self.precision,
            "fp8_kernels": self.fp8_kernels if self.precision != "bf16" else None,
            "num_gpus": self.layout.num_gpus,
            "fits": self.fits,
            "runnable": self.runnable,
            "not_runnable_reason": self.not_runnable_reason(),
            "memory_gb": {k: v / 1e9 for k, v in self.memory.items()},
            "hbm_gb": self.system.hbm_bytes / 1e9,
            "usable_hbm_gb": self.system.hbm_bytes * self.stack.usable_hbm / 1e9,
            "step_time_s": self.step_time,
            "tflops_per_gpu": self.tflops,
            "mfu": self.mfu,
            "tokens_per_s_per_gpu": self.tokens_per_s,
            "scaling_efficiency": self.scaling_efficiency,
            "compute_s": self.math,
            "collectives": [
                {
                    "name": c.name,
                    "nvlink_gb": c.bytes_nvlink / 1e9,
                    "network_gb": c.bytes_network / 1e9,
                    "seconds": c.seconds,
                }
                for c in self.comms
            ],
            "exposed_s": self.exposed,
            "bubble_fraction": self.bubble,
            "comm_fraction_of_kernel_time": self.comm_fraction,
            "dominant": self.dominant,
            "overlay": self.layout.overlay() if self.layout.runnable else None,
        }


def _time(
    spec: ModelSpec,
    layout: Layout,
    system: System,
    stack: Stack,
    precision: str,
    fp8_kernels: str,
    state_bytes: float,
    exchange_buffer_factor: float = 2.0,
):
    math = math_times(spec, layout, system, stack, precision, fp8_kernels, exchange_buffer_factor)
    compute = sum(math.values())
    comms = collectives(spec, layout, system, stack, fp8_dispatch_bytes(spec, stack, precision))
    by_kind = {
        k: sum(c.seconds for c in comms if c.kind == k)
        for k in ("dispatch", "tensor", "vocab", "fsdp", "dp", "pipeline")
    }
    m = layout.microbatches
    # this repository's stage transfers: counted exposed (XLA's schedule hides a part; docs/pipeline.md)
    sends = by_kind["pipeline"] * (1 if circular.applies(spec, layout, stack) else 1 - stack.dispatch_overlap)
    dispatch = by_kind["dispatch"] * (1 - stack.exchange_overlap)
    hidden = min(dispatch + sends, stack.exchange_compute_overlap * compute)  # under another chunk's math
    share = 1 - hidden / (dispatch + sends) if dispatch + sends else 0.0
    exposed = {
        "dispatch": dispatch * share,
        "tensor": by_kind["tensor"] + by_kind["vocab"] * (1 - stack.vocab_hidden),
        "pipeline": sends * share,
        "fsdp": max(0.0, by_kind["fsdp"] - stack.fsdp_overlap * compute)
        if stack.fsdp_hidden is None
        else by_kind["fsdp"] * (1 - stack.fsdp_hidden),
        "dp": max(0.0, by_kind["dp"] - stack.dp_overlap * compute / m)
        if stack.dp_hidden is None
        else by_kind["dp"] * (1 - stack.dp_hidden),
        "optimizer": optimizer_time(state_bytes, system),
    }
    bubble = (layout.pp - 1) / (layout.vpp * m)
    in_step = compute + exposed["dispatch"] + exposed["tensor"] + exposed["pipeline"] + exposed["fsdp"]
    step = in_step * (1 + bubble) + exposed["dp"] + exposed["optimizer"]
    return math, comms, exposed, bubble, step


def estimate(
    spec: ModelSpec,
    layout: Layout,
    system: System,
    stack: Stack,
    precision: str = "bf16",
    exchange_buffer_factor: float = 2.0,
    scaling: bool = True,
    fp8_kernels: str = "fused",
) -> Estimate:
    """Cost one layout (``layout.check`` first; the sharded state raises on splits that do not
    divide). ``fp8_kernels``: how FP8 precisions run (compute.py): ``fused`` FP8 tensor-core
    kernels, as the published runs, or ``emulated``, this repository's path."""
    layout.check(spec.num_experts, spec.heads, spec.kv_heads)
    memory = memory_per_gpu(spec, layout, stack, precision, exchange_buffer_factor, fp8_kernels)
    math, comms, exposed, bubble, step = _time(
        spec, layout, system, stack, precision, fp8_kernels, memory["state"], exchange_buffer_factor
    )
    tflops = model_flops_per_gpu(spec, layout) / step / 1e12
    tokens_per_s = layout.gbs * spec.seq_len / layout.num_gpus / step
    scaling_efficiency = None
    if scaling:
        one_domain = replace(layout, dcn={})
        one_domain = replace(one_domain, gbs=one_domain.mbs * one_domain.replicas * layout.microbatches)
        if one_domain.num_gpus < layout.num_gpus:
            _, _, _, _, ref_step = _time(
                spec, one_domain, system, stack, precision, fp8_kernels, memory["state"], exchange_buffer_factor
            )
            ref_tflops = model_flops_per_gpu(spec, one_domain) / ref_step / 1e12
            scaling_efficiency = tflops / ref_tflops
        else:
            scaling_efficiency = 1.0
    return Estimate(
        layout,
        system,
        stack,
        precision,
        fp8_kernels,
        memory,
        math,
        comms,
        exposed,
        bubble,
        step,
        tflops,
        tokens_per_s,
        scaling_efficiency,
        circular.split_problem(spec, layout) if layout.pp > 1 else _tensor_problem(spec, layout, stack),
    )


# XLA:GPU's compile of the GB300 recipe's size as tensor 2 x expert 16 x fsdp 2 in each rack (data 16
# across racks): the MoE layers' activations, split over tensor on their embed dim, cannot be
# resharded to the exchange's layout, and XLA's partitioner replicates them ("involuntary full
# rematerialization"): 758 GB per GPU, HLO matmul FLOPs 6.2x the accounting (docs/planner.md).
TENSOR_WITH_EXPERTS = "tensor parallelism beside the MoE layers: XLA replicates their activations (docs/planner.md)"


def _tensor_problem(spec: ModelSpec, layout: Layout, stack: Stack) -> str | None:
    """Why this repository's own path cannot take the layout's tensor split, if it cannot."""
    return TENSOR_WITH_EXPERTS if stack.runs_here and layout.tp > 1 and spec.num_experts > 1 else None
