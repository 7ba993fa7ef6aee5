"""The published results the planner's constants are held to (README table; tests/test_plan.py).

All are DeepSeek-V3 671B (no MTP) at sequence 4096 with force-balanced dropless routing, except the
Qwen3-235B-A22B control (grouped-query attention instead of MLA, on Hopper). Sources:

- Megatron-Core DeepSeek-V3 on GB200 (NVIDIA Megatron-Core MoE documentation and technical report,
  2025): 970 TFLOPS/GPU optimised, 494 TFLOPS/GPU baseline (NCCL all-to-all, no CUDA graphs).
- Megatron-Bridge 25.11 performance summary (NVIDIA NeMo documentation): GB200 BF16 782 and MXFP8
  1,003, GB300 BF16 961 and MXFP8 1,088 TFLOPS/GPU; Qwen3-235B-A22B on 256 H100 BF16 245
  TFLOPS/GPU (19.7 s/step).
- "Accelerating Dropless MoE Training in JAX with NVIDIA Transformer Engine" (NVIDIA technical blog,
  Sep 2026): 1,068 TFLOPS/GPU on GB200 against a 103 TFLOPS/GPU baseline in which communication was
  84% of kernel time; 97% scaling efficiency at 1,024 GB300. The post gives no layout; the planner
  assumes this repository's shipped layouts (expert 64 inside each rack, FSDP across racks, one
  four sequences per GPU (global batch 1,024 sequences at 256 GPUs, 4M tokens), full remat), the shipped 256-GPU recipe for the GB200 points and the 1,024-GPU
  one for the scaling point, with MXFP8 GEMMs for the optimised figure (a BF16 run would need 57%
  of BF16 peak with full remat, beyond any other published point).
"""

from __future__ import annotations

from dataclasses import dataclass

from MaxText.planner.layout import Layout, megatron
from MaxText.planner.model import ModelSpec, qwen3_235b

TOLERANCE = 0.15
TE_JAX_MISS = (
    "1,068 exceeds every Megatron figure on GB200 (best 1,003, no recomputation); with the GEMM "
    "efficiencies those points pin, full remat (4/3 of the FLOPs, needed to fit 186 GB without "
    "pipelining) caps this stack near 820 in any layout the search finds. Closing the gap would "
    "need faster kernels for this stack alone or a different FLOPs count (e.g. causal attention "
    "not halved, +12%), neither of which the post states."
)


@dataclass(frozen=True)
class Point:
    name: str
    model: str  # "deepseek3-671b" | "qwen3-235b"
    system: str
    precision: str
    stack: str
    layout: Layout
    published: float
    metric: str = "tflops"  # or "scaling_efficiency"
    known_miss: str = ""  # why the point is outside the tolerance, if it is (README, test)


def _ours(num_gpus: int, gbs: int) -> Layout:
    return Layout({"expert": 64}, {"fsdp": num_gpus // 64}, mbs=4, gbs=gbs, remat="full")


def points() -> list[Point]:
    m = megatron
    return [
        Point(
            "MCore GB200 MXFP8 optimised",
            "deepseek3-671b",
            "gb200-nvl72",
            "mxfp8",
            "megatron",
            m(256, 64, tp=1, pp=8, ep=32, mbs=1, gbs=2048, vpp=4),
            970.0,
        ),
        Point(
            "MCore GB200 MXFP8 baseline",
            "deepseek3-671b",
            "gb200-nvl72",
            "mxfp8",
            "megatron-baseline",
            m(256, 64, tp=1, pp=8, ep=32, mbs=1, gbs=2048, vpp=4),
            494.0,
        ),
        Point(
            "Bridge GB200 BF16",
            "deepseek3-671b",
            "gb200-nvl72",
            "bf16",
            "megatron",
            m(256, 64, tp=1, pp=4, ep=64, mbs=1, gbs=4096, vpp=4),
            782.0,
        ),
        Point(
            "Bridge GB200 MXFP8",
            "deepseek3-671b",
            "gb200-nvl72",
            "mxfp8",
            "megatron",
            m(256, 64, tp=1, pp=8, ep=32, mbs=1, gbs=4096, vpp=4),
            1003.0,
        ),
        Point(
            "Bridge GB300 BF16",
            "deepseek3-671b",
            "gb300-nvl72",
            "bf16",
            "megatron",
            m(256, 64, tp=1, pp=2, ep=32, mbs=1, gbs=4096, vpp=4),
            961.0,
        ),
        Point(
            "Bridge GB300 MXFP8",
            "deepseek3-671b",
            "gb300-nvl72",
            "mxfp8",
            "megatron",
            m(256, 64, tp=1, pp=2, ep=32, mbs=1, gbs=4096, vpp=4),
            1088.0,
        ),
        Point(
            "TE-JAX GB200 optimised",
            "deepseek3-671b",
            "gb200-nvl72",
            "mxfp8",
            "te-jax",
            _ours(256, 1024),
            1068.0,
            known_miss=TE_JAX_MISS,
        ),
        Point(
            "TE-JAX GB200 baseline", "deepseek3-671b", "gb200-nvl72", "bf16", "jax-baseline", _ours(256, 1024), 103.0
        ),
        Point(
            "TE-JAX GB300 scaling at 1,024",
            "deepseek3-671b",
            "gb300-nvl72",
            "mxfp8",
            "te-jax",
            _ours(1024, 4096),
            0.97,
            "scaling_efficiency",
        ),
        Point(
            "Qwen3-235B H100 BF16",
            "qwen3-235b",
            "h100",
            "bf16",
            "megatron",
            m(256, 8, tp=2, pp=8, ep=32, mbs=1, gbs=2048, vpp=4),
            245.0,
        ),
    ]


def model_spec(name: str) -> ModelSpec:
    if name == "qwen3-235b":
        return qwen3_235b()
    from MaxText.config import load_config
    from MaxText.planner.model import from_config

    return from_config(load_config([f"model_name={name}", "mtp_num_layers=0", "run_name=plan"]).with_platform("gpu"))


def predict(point: Point, spec: ModelSpec | None = None):
    from MaxText.planner.constants import STACKS
    from MaxText.planner.estimate import estimate
    from MaxText.planner.systems import SYSTEMS

    spec = spec or model_spec(point.model)
    est = estimate(spec, point.layout, SYSTEMS[point.system], STACKS[point.stack], point.precision)
    value = est.scaling_efficiency if point.metric == "scaling_efficiency" else est.tflops
    return value, est


def run_all() -> list[dict]:
    """Every point: published, predicted, relative error and what dominates."""
    specs: dict[str, ModelSpec] = {}
    rows = []
    for point in points():
        spec = specs.setdefault(point.model, model_spec(point.model))
        value, est = predict(point, spec)
        rows.append(
            {
                "name": point.name,
                "metric": point.metric,
                "published": point.published,
                "predicted": value,
                "error": value / point.published - 1,
                "dominant": est.dominant,
                "comm_fraction": est.comm_fraction,
                "fits": est.fits,
                "known_miss": point.known_miss,
            }
        )
    return rows
