"""GPU targets for a compile without the GPU: each device kind from its published facts, and the
cluster's devices as XLA:GPU sees them.

JAX's CUDA plugin compiles for a GPU it does not have when given a description of it
(``jax.experimental.topologies.get_topology_desc(platform="cuda", topology=..., target_config=...)``,
a ``stream_executor.GpuTargetConfigProto`` in text form). No description ships with the wheels, so
each kind is written here from vendor figures (data sheets; the Hopper and Blackwell tuning guides
for the per-SM limits; SM counts as enabled on the shipping parts). HBM size, HBM and link bandwidths
are not repeated: they come from ``train/metrics.py`` and ``planner/systems.py``, the one place each
is kept. The rest steers XLA's tiling heuristics and cost model, not the buffer sizes this compile
reports.

The topology is ``<NVLink domains>x<hosts per domain>x<GPUs per host>``: devices of one domain are
one "slice" to XLA, joined by NVLink, and slices meet over the scale-out network. A job's GPUs in a
domain follow the planner's ``System.domain_gpus`` (64 of an NVL72 rack for power-of-two jobs).

What a device would answer while tracing is answered from the target instead, here and nowhere
else (``answering_device_queries``; ``tests/test_tokamax_matmul.py`` fails when a library moves the
function a patch replaces):
- JAX's cuDNN attention asks the attached GPU for its compute capability
  (``jax/_src/cudnn/fused_attention_stablehlo.py``); on a CPU host it would answer "older than
  Hopper" and refuse head dims above 128.
- tokamax asks JAX's default device (``jax.extend.backend.get_default_device``) for its kind,
  compute capability and SM count, to pick and size its kernels; on a CPU host it would refuse
  ("Not supported on cpu"). The answer is one of the target's compile devices, which carry them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from MaxText.planner.systems import SYSTEMS, System
from MaxText.train.metrics import HBM_GB

GB = 1e9
# The CUDA runtime and driver a GPU run has: JAX's CUDA 13 plugin (requirements-gpu.txt), whose
# wheels need a 13.x driver.
CUDA_VERSION = "13.0.0"


@dataclass(frozen=True)
class GpuTarget:
    name: str  # the --target value
    system: str  # the planner's system (bandwidths, NVLink domain, GPUs per host)
    description: str  # XLA's device kind
    compute_capability: tuple[int, int]
    sm_count: int
    clock_ghz: float  # boost clock
    l2_mb: int

    @property
    def hardware(self) -> System:
        return SYSTEMS[self.system]

    @property
    def hbm_bytes(self) -> float:
        return self.hardware.hbm_bytes

    def topology(self, num_gpus: int) -> str:
        """``domains x hosts per domain x GPUs per host`` for a job of ``num_gpus``."""
        system = self.hardware
        in_domain = system.domain_gpus(num_gpus)
        per_host = min(system.node_gpus, in_domain)
        if num_gpus % in_domain or in_domain % per_host:
            raise ValueError(f"{num_gpus} {self.name} GPUs do not fill whole hosts of {per_host}")
        return f"{num_gpus // in_domain}x{in_domain // per_host}x{per_host}"

    def target_config(self, cudnn_version: tuple[int, int, int]) -> str:
        """The ``GpuTargetConfigProto`` text. Per-SM limits are those of compute capability 9.0
        and 10.x alike (CUDA programming guide: 228 KB shared memory per SM, 227 KB per block
        opted in, 64 K registers, 2,048 threads); ``ACCELERATED_FEATURES`` asks for the
        architecture-specific instructions (sm_90a, sm_100a: wgmma, tcgen05) a shipping build uses.
        The CUDA runtime and driver versions are those the GPU set installs (``CUDA_VERSION``):
        left out, XLA takes them for older than 12.3 and keeps every ``while`` and
        ``conditional`` out of command buffers (CUDA graphs' device-side control flow needs 12.3),
        a different program from the one the GPU runs."""
        major, minor = self.compute_capability
        return f"""
gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  shared_memory_per_block_optin: 232448
  threads_per_core_limit: 2048
  core_count: {self.sm_count}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  thread_dim_limit_x: 1024
  thread_dim_limit_y: 1024
  thread_dim_limit_z: 64
  memory_bandwidth: {int(self.hardware.hbm_bw)}
  l2_cache_size: {self.l2_mb * 2**20}
  clock_rate_ghz: {self.clock_ghz}
  device_memory_size: {int(self.hbm_bytes)}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  runtime_version: "{CUDA_VERSION}"
  driver_version: "{CUDA_VERSION}"
  compile_time_toolkit_version: "{CUDA_VERSION}"
  cuda_compute_capability {{ major: {major} minor: {minor} feature_extension: ACCELERATED_FEATURES }}
  device_interconnect_info {{ active_links: 18 }}
  name: "NVIDIA {self.description}"
}}
platform_name: "CUDA"
dnn_version_info {{ major: {cudnn_version[0]} minor: {cudnn_version[1]} patch: {cudnn_version[2]} }}
device_description_str: "NVIDIA {self.description}"
"""


TARGETS: dict[str, GpuTarget] = {
    t.name: t
    for t in (
        GpuTarget("gb200", "gb200-nvl72", "GB200", (10, 0), 148, 1.965, 126),
        GpuTarget("gb300", "gb300-nvl72", "GB300", (10, 3), 160, 1.965, 126),
        GpuTarget("b200", "b200", "B200", (10, 0), 148, 1.965, 126),
        GpuTarget("h200", "h200", "H200", (9, 0), 132, 1.98, 50),
        GpuTarget("h100", "h100", "H100", (9, 0), 132, 1.98, 50),
    )
}
assert all(t.hardware.device_kind == t.description for t in TARGETS.values())
assert all(any(name == t.description for name, _ in HBM_GB) for t in TARGETS.values())


PLUGIN_MISSING = "JAX's CUDA plugin and cuDNN are not installed here; `make gpu-compile-deps` installs them"


def cudnn_version() -> tuple[int, int, int]:
    """The installed cuDNN's version (the library the attention's custom calls are built against)."""
    from jax._src.lib import cuda_versions

    v = cuda_versions.cudnn_get_version()  # e.g. 92801; raises where no cuDNN is found
    return v // 10000, v // 100 % 100, v % 100


def compile_devices(target: GpuTarget, num_gpus: int) -> list:
    """``num_gpus`` compile-only devices of ``target``, grouped into hosts and NVLink domains."""
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(
        platform="cuda", topology=target.topology(num_gpus), target_config=target.target_config(cudnn_version())
    )
    return list(topology.devices)


def compile_devices_or_error(target: GpuTarget, num_gpus: int) -> tuple[list | None, str | None]:
    """(devices, None), or (None, one line saying why there are none)."""
    try:
        return compile_devices(target, num_gpus), None
    except ValueError as err:
        return None, str(err)
    except Exception as err:  # no plugin: JAX knows no "cuda" platform; no cuDNN: a RuntimeError
        first = f"{type(err).__name__}: {err}".splitlines()[0]
        return None, f"{PLUGIN_MISSING} ({first[:200]})"


@contextlib.contextmanager
def answering_device_queries(target: GpuTarget, device=None) -> Iterator[None]:
    """For the trace: JAX's cuDNN attention checks the compute capability of the attached GPU
    (there is none), and gets the target's; JAX's default device (what tokamax asks) is
    ``device``, one of the target's compile devices (default: a new one)."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention
    from jax.extend import backend

    device = device if device is not None else compile_devices(target, 1)[0]
    saved_default = backend.get_default_device
    backend.get_default_device = lambda: device

    def version(capability: str) -> tuple[int, ...]:
        return tuple(int(x) for x in capability.split("."))

    saved = cudnn_attention.check_compute_capability, cudnn_attention.is_cuda_compute_capability_equal
    cudnn_attention.check_compute_capability = lambda c: target.compute_capability >= version(c)
    cudnn_attention.is_cuda_compute_capability_equal = lambda c: target.compute_capability == version(c)
    try:
        yield
    finally:
        cudnn_attention.check_compute_capability, cudnn_attention.is_cuda_compute_capability_equal = saved
        backend.get_default_device = saved_default
