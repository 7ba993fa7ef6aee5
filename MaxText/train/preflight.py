"""Before anything is allocated: will the run fit its devices' memory?

A run that does not fit should stop in seconds with the figures and the keys that shrink it, not
be killed by the kernel or the allocator after its state is built. Two checks, cheapest first:

1. the train state alone, from its abstract shapes and shardings (no compile): the bytes each
   device holds against what it has;
2. the compiled step, from XLA's ``memory_analysis`` (arguments, outputs not aliased to them,
   temporaries and code; the figures ``tools/aot_compile.py`` reports) against the same.

What a device has: a GPU's allocator limit (``bytes_limit``: the memory fraction JAX was given);
on CPU the host's available RAM, shared by the process's devices. Both checks raise
``ConfigError`` (exit code 2).
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp

from MaxText.config import Config, ConfigError
from MaxText.data.types import BATCH_KEYS
from MaxText.parallel.sharding import batch_sharding

GB = 1e9
SHRINK_STATE = (
    "spread the state over more devices (ici_fsdp_parallelism, dcn_fsdp_parallelism, expert parallelism) "
    "or keep the Adam moments in bfloat16 (opt_state_dtype)"
)
SHRINK_STEP = (
    "reduce per_device_batch_size (gradient_accumulation_steps keeps the global batch), use "
    f"remat_policy=full, or {SHRINK_STATE}"
)


def abstract_batch(config: Config, mesh) -> dict[str, jax.ShapeDtypeStruct]:
    """The global batch as shapes with the mesh's batch sharding."""
    rows = config.global_batch_size(mesh.size)
    sharding = batch_sharding(mesh, config)
    return {k: jax.ShapeDtypeStruct((rows, config.max_target_length), jnp.int32, sharding=sharding) for k in BATCH_KEYS}


def compiled_memory(compiled) -> dict[str, int]:
    """Bytes per device of a compiled program, by kind, and their ``total``."""
    mem = compiled.memory_analysis()
    memory = {
        "arguments": mem.argument_size_in_bytes,
        "outputs": mem.output_size_in_bytes,
        "aliased": mem.alias_size_in_bytes,
        "temp": mem.temp_size_in_bytes,
        "code": mem.generated_code_size_in_bytes,
    }
    memory["total"] = memory["arguments"] + memory["outputs"] - memory["aliased"] + memory["temp"] + memory["code"]
    return memory


def host_available_bytes() -> int:
    """The host's available RAM (``MemAvailable``: free plus what the kernel can reclaim)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def device_capacity(devices) -> tuple[float, str]:
    """(bytes one device can use, where that figure comes from)."""
    stats = devices[0].memory_stats()
    if stats and "bytes_limit" in stats:
        return float(stats["bytes_limit"]), f"{devices[0].device_kind}'s allocator limit"
    available = host_available_bytes()
    return available / len(devices), f"host RAM available, {available / GB:.1f} GB shared by {len(devices)} devices"


def state_bytes_per_device(abstract_state) -> int:
    """Bytes of the largest per-device share of the train state (each device holds one shard of
    every leaf)."""
    total = 0
    for leaf in jax.tree.leaves(abstract_state):
        shard = leaf.sharding.shard_shape(leaf.shape)
        total += math.prod(shard) * jnp.dtype(leaf.dtype).itemsize
    return total


def step_io_bytes(abstract_state, batch) -> int:
    """Bytes per device of the train step's inputs and outputs not aliased to them: the state
    (donated: the new state takes its buffers) and the batch."""
    return state_bytes_per_device(abstract_state) + state_bytes_per_device(batch)


def check_state_fits(abstract_state, devices) -> None:
    need = state_bytes_per_device(abstract_state)
    have, source = device_capacity(devices)
    if need > have:
        raise ConfigError(
            f"memory: the train state alone needs {need / GB:.1f} GB per device but a device has "
            f"{have / GB:.1f} GB ({source}); {SHRINK_STATE}"
        )


def check_step_fits(compiled, devices) -> dict[str, int]:
    """The compiled step's memory per device (``compiled_memory``), if it fits."""
    memory = compiled_memory(compiled)
    have, source = device_capacity(devices)
    if memory["total"] > have:
        raise ConfigError(
            f"memory: the training step needs {memory['total'] / GB:.1f} GB per device (XLA: arguments "
            f"{memory['arguments'] / GB:.1f}, temporaries {memory['temp'] / GB:.1f}) but a device has "
            f"{have / GB:.1f} GB ({source}); {SHRINK_STEP}"
        )
    return memory
