"""Arguments that turn a 671B cluster recipe into deepseek3-tiny on two CPU processes, appended
last (``MAXTEXT_ARGS``) so that they win over the recipe's own.

Every mesh key is set, and the remat policy (the tiny model's own), so whatever layout the recipe
has never reaches the two processes. The
result is the very program ``recipes/slurm/smoke.sbatch`` compiles on two tasks (data parallelism,
the same batch, sequence length, dtype and learning-rate schedule; only ``steps`` is shorter).
XLA_FLAGS are part of JAX's compilation-cache key, and the 671B recipes set the GPU image's flags,
so the smoke runs get those flags too (``image_xla_flags``: what tasks inside the image see; inert
on CPU). With the suite's shared JAX compilation cache (tests/conftest.py) its two-process runs
then compile the training step once: a cold run of two tasks took 37-49 CPU-seconds per
process here, a cached single-process run about 8.
"""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SMOKE_STEPS = 10  # recipes/slurm/smoke.sbatch's steps=
STEPS = 3
TINY_ON_TWO_CPUS = (
    "model_name=deepseek3-tiny",
    "hardware=cpu",
    "dtype=float32",
    "dataset_type=synthetic",
    "tokenizer_type=byte",
    "max_target_length=64",
    "per_device_batch_size=8",
    "moe_ep_comm=auto",  # the recipes name the GPU exchange (ragged_all_to_all), which XLA:CPU lacks
    "remat_policy=none",  # the tiny overlay's: the GB200 recipe sets minimal
    f"steps={STEPS}",
    f"learning_rate_schedule_steps={SMOKE_STEPS}",
    "log_period=1",
    "ici_data_parallelism=-1",
    "ici_fsdp_parallelism=1",
    "ici_expert_parallelism=1",
    "ici_tensor_parallelism=1",
    "dcn_data_parallelism=1",
    "dcn_fsdp_parallelism=1",
    "dcn_expert_parallelism=1",
    "dcn_tensor_parallelism=1",
)


def image_xla_flags() -> str:
    """XLA_FLAGS as the GPU image sets them (docker/Dockerfile.gpu's ENV)."""
    dockerfile = (REPO / "docker" / "Dockerfile.gpu").read_text().replace("\\\n", " ")
    return " ".join(re.search(r'^ENV XLA_FLAGS="([^"]*)"', dockerfile, re.M).group(1).split())
