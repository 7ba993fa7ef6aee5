"""Multi-process start-up: one JAX job across hosts (or several local processes on CPU).

Started when launched by Slurm with more than one task (``jax.distributed.initialize()`` reads
the SLURM_* variables itself) or when JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
JAX_PROCESS_ID are set (Kubernetes, or local multi-process tests). CPU processes exchange
collectives over gloo.
"""

import os

import jax

from MaxText.config import Config


def select_platform(config: Config) -> None:
    """Pin the JAX platform before any backend starts (``hardware: auto`` leaves JAX's choice)."""
    if config.hardware != "auto":
        jax.config.update("jax_platforms", config.hardware if config.hardware != "gpu" else "cuda")


def initialize_distributed(config: Config) -> None:
    env = os.environ
    coordinator = env.get("JAX_COORDINATOR_ADDRESS")
    slurm_tasks = int(env.get("SLURM_NTASKS", "1"))
    if not coordinator and slurm_tasks <= 1:
        return
    if config.hardware == "cpu" or env.get("JAX_PLATFORMS", "") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if coordinator:
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=int(env["JAX_NUM_PROCESSES"]),
            process_id=int(env["JAX_PROCESS_ID"]),
        )
    else:
        jax.distributed.initialize()


COMPILE_SKEW_TIMEOUT_S = 1800  # the longest compile one process may take beyond another's


def wait_for_every_process(name: str, timeout_s: float = COMPILE_SKEW_TIMEOUT_S) -> None:
    """Block until every process reaches the barrier ``name`` (the coordination service's, not a
    device collective). After a restart processes arrive at the first collective minutes apart
    (one reads its program from the compilation cache, another compiles it), longer than gloo
    waits for its peers to form a collective (30 s) on CPU."""
    if jax.process_count() == 1:
        return
    from jax._src import distributed  # the runtime's client: the public API has no barrier

    distributed.global_state.client.wait_at_barrier(name, int(timeout_s * 1000))
