"""The hardware the planner models: one row per system, one source per number.

Dense peak TFLOP/s and HBM size are not repeated here: they live in ``MaxText/train/metrics.py``
(``PEAK_TFLOPS``, ``HBM_GB``), which the training loop uses for MFU, and are looked up by the
system's device kind. The rest is below, with its source:

- HBM bandwidth: NVIDIA data sheets (H100 SXM 3.35 TB/s, H200 4.8 TB/s, B200/GB200/GB300 8 TB/s).
- NVLink: bandwidth per GPU per direction; NVLink 5 (Blackwell) 900 GB/s, NVLink 4 (H100/H200)
  450 GB/s, H800 (export part) 200 GB/s (400 GB/s bidirectional; DeepSeek-V3 report section 3.2.2
  measured about 160 GB/s achievable). Domain = GPUs that share NVLink: 72 in an NVL72 rack, 8 in an
  HGX node.
- Scale-out: network bandwidth per GPU per direction. GB200 ConnectX-7 400 Gb/s, GB300 ConnectX-8
  800 Gb/s, HGX H100/H200/H800/B200 one 400 Gb/s NIC per GPU (DeepSeek-V3 report: 50 GB/s IB).
- ``attention_speedup``: Blackwell Ultra (GB300) doubles the special-function (exponential)
  throughput of the attention softmax ("2x attention-layer acceleration", NVIDIA Blackwell Ultra
  technical blog, 2025); 1 elsewhere.
- ``node_gpus``: GPUs per host (a GB200/GB300 compute tray has 4; an HGX node 8). Jobs on NVL72 use
  whole trays, so a 256-GPU job uses 64 GPUs (16 trays) of each rack.
- ``mxfp8``: microscaled FP8 has tensor-core support on Blackwell only; Hopper runs per-tensor or
  block-scaled FP8 (``fp8``).
"""

from __future__ import annotations

from dataclasses import dataclass

from MaxText.train.metrics import HBM_GB, PEAK_TFLOPS, gpu_name

PRECISIONS = ("bf16", "fp8", "mxfp8")
GB = 1e9


@dataclass(frozen=True)
class System:
    name: str
    device_kind: str  # matched against metrics.PEAK_TFLOPS / HBM_GB
    hbm_bw: float  # bytes/s
    nvlink_bw: float  # bytes/s per GPU per direction
    nvlink_domain: int  # GPUs sharing one NVLink fabric
    scaleout_bw: float  # bytes/s per GPU per direction
    node_gpus: int  # GPUs per host
    mxfp8: bool  # tensor cores take microscaled FP8
    attention_speedup: float = 1.0

    @property
    def hbm_bytes(self) -> float:
        return next(gb for name, gb in HBM_GB if name == self.device_kind) * GB

    def peak_flops(self, precision: str) -> float:
        """Dense peak FLOP/s at ``precision`` (mxfp8 runs at the FP8 rate)."""
        peaks = next(p for name, p in PEAK_TFLOPS if name == self.device_kind)
        return peaks["bf16" if precision == "bf16" else "fp8"] * 1e12

    def domain_gpus(self, num_gpus: int) -> int:
        """GPUs of a ``num_gpus`` job in each NVLink domain: the largest whole-host divisor of the
        job that fits in one domain (64 of a 72-GPU rack for power-of-two jobs)."""
        fits = [
            d for d in range(self.node_gpus, min(self.nvlink_domain, num_gpus) + 1, self.node_gpus) if num_gpus % d == 0
        ]
        return max(fits) if fits else min(num_gpus, self.node_gpus)


SYSTEMS: dict[str, System] = {
    s.name: s
    for s in (
        System("gb200-nvl72", "GB200", 8.0e12, 900 * GB, 72, 50 * GB, 4, True),
        System("gb300-nvl72", "GB300", 8.0e12, 900 * GB, 72, 100 * GB, 4, True, attention_speedup=2.0),
        System("b200", "B200", 8.0e12, 900 * GB, 8, 50 * GB, 8, True),
        System("h100", "H100", 3.35e12, 450 * GB, 8, 50 * GB, 8, False),
        System("h200", "H200", 4.8e12, 450 * GB, 8, 50 * GB, 8, False),
        System("h800", "H800", 3.35e12, 200 * GB, 8, 50 * GB, 8, False),
    )
}


def system_of_device(device_kind: str) -> System | None:
    """The first system whose GPU a JAX ``device_kind`` names (``metrics.gpu_name``: ``NVIDIA
    GB200`` is a GB200, not a B200)."""
    name = gpu_name(device_kind)
    return next((s for s in SYSTEMS.values() if s.device_kind == name), None)
