"""The memory XLA:GPU plans the step for: what JAX's allocator holds, not 80% of the HBM.

XLA:GPU's rematerialisation pass and its latency-hiding scheduler work under one budget
(``GetSchedulerMemoryLimit``, XLA's ``gpu_hlo_schedule.cc``): 80% of the device's memory when the
compile is not told the allocator's size (JAX's GPU plugin does not tell it), less the program's
inputs and outputs, times ``xla_gpu_memory_limit_slop_factor`` (95 by default), plus the inputs
and outputs. JAX's allocator holds ``XLA_PYTHON_CLIENT_MEM_FRACTION`` of the memory (0.9 in the
recipes). A program over the budget but within the allocator is rematerialised to fit a budget
the GPU does not have (XLA recomputes work inside the step: the AOT report's ``xla remat`` pass),
and its collectives are scheduled to save memory rather than to overlap.

The slop factor is the one knob XLA takes per compile; ``compiler_options`` sets it so that the
budget is XLA's own 95% of what the allocator leaves after the inputs and outputs. A slop factor
given in ``XLA_FLAGS`` is left as it is.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

JAX_MEMORY_FRACTION = 0.75  # the memory fraction's default: the share of HBM JAX's allocator takes
MEMORY_FRACTION_VARIABLES = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")  # jaxlib takes one
XLA_BASE_FRACTION = 0.8  # of the device's memory, when the compile is not told the allocator's size
XLA_DEFAULT_SLOP = 95  # xla_gpu_memory_limit_slop_factor's default, percent
TARGET_SHARE = 0.95  # of what the allocator leaves after the inputs and outputs: XLA's own margin
SLOP_FLAG = "xla_gpu_memory_limit_slop_factor"


def memory_fraction(env: Mapping[str, str]) -> float:
    """The share of HBM JAX's allocator takes under the environment ``env``."""
    return next((float(env[name]) for name in MEMORY_FRACTION_VARIABLES if env.get(name)), JAX_MEMORY_FRACTION)


def xla_budget(hbm_bytes: float, io_bytes: float, slop: float = XLA_DEFAULT_SLOP) -> float:
    """Bytes per device XLA:GPU plans a program for: ``io_bytes`` are its inputs and outputs not
    aliased to each other (for the train step: the state and the batch)."""
    return slop / 100 * (XLA_BASE_FRACTION * hbm_bytes - io_bytes) + io_bytes


def slop_for_allocator(hbm_bytes: float, allocator_bytes: float, io_bytes: float) -> int:
    """The slop factor (whole percent, rounded down) that makes XLA's budget ``TARGET_SHARE`` of
    what the allocator's ``allocator_bytes`` leave after ``io_bytes``; XLA's default where 80% of
    the HBM does not even hold the inputs and outputs (XLA then plans for nothing but them)."""
    base_free = XLA_BASE_FRACTION * hbm_bytes - io_bytes
    if base_free <= 0 or allocator_bytes <= io_bytes:
        return XLA_DEFAULT_SLOP
    return max(1, math.floor(100 * TARGET_SHARE * (allocator_bytes - io_bytes) / base_free))


def slop_in_xla_flags() -> int | None:
    """The slop factor ``XLA_FLAGS`` sets (its last mention, the one XLA keeps), if it sets one."""
    found = None
    for flag in os.environ.get("XLA_FLAGS", "").split():
        if flag.startswith(f"--{SLOP_FLAG}="):
            found = int(flag.split("=", 1)[1])
    return found


def compiler_options(hbm_bytes: float, allocator_bytes: float, io_bytes: float) -> dict[str, int]:
    """Options for ``Lowered.compile`` on a GPU: the slop factor for the allocator's memory, unless
    ``XLA_FLAGS`` names one."""
    if slop_in_xla_flags() is not None:
        return {}
    return {SLOP_FLAG: slop_for_allocator(hbm_bytes, allocator_bytes, io_bytes)}


def slop_used(options: Mapping[str, Any]) -> int:
    """The slop factor a compile with ``options`` runs under: theirs, else ``XLA_FLAGS``', else XLA's."""
    if SLOP_FLAG in options:
        return int(options[SLOP_FLAG])
    flagged = slop_in_xla_flags()
    return XLA_DEFAULT_SLOP if flagged is None else flagged


def device_compiler_options(device: Any, io_bytes: float) -> dict[str, int]:
    """``compiler_options`` for the ``jax.Device`` a run compiles on: on a GPU its allocator's
    limit (``bytes_limit``) and the HBM that limit is the memory fraction of; nothing elsewhere."""
    limit = (device.memory_stats() or {}).get("bytes_limit") if device.platform == "gpu" else None
    if not limit:
        return {}
    return compiler_options(limit / memory_fraction(os.environ), limit, io_bytes)
