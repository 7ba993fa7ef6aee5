"""The devices a run trains on, said once at start: a GPU host whose JAX has no CUDA plugin would
otherwise train on its CPU without a word."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable

import jax

from MaxText.config import Config, ConfigError

CUDA_INSTALL_HINT = (
    "install JAX's CUDA plugin: `make venv` on a host where `nvidia-smi -L` lists a GPU, "
    "or `pip install -r requirements-cuda.txt` (docs/install.md)"
)


def visible_gpus() -> list[str]:
    """The GPUs ``nvidia-smi -L`` lists (none where it is missing or fails)."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.splitlines() if line.startswith("GPU ")]


def run_devices(config: Config) -> list[jax.Device]:
    """JAX's devices, or a ConfigError naming what to install when ``hardware=gpu`` finds none."""
    try:
        devices = jax.devices()
    except (RuntimeError, AssertionError) as err:  # JAX asserts when the platform it was pinned to is missing
        if config.hardware == "gpu":
            raise ConfigError(f"config key 'hardware': gpu, but JAX finds no GPU; {CUDA_INSTALL_HINT}") from None
        raise ConfigError(f"config key 'hardware': {config.hardware}: JAX cannot start it ({err})") from None
    return devices


def device_line(devices: list[jax.Device]) -> str:
    """``devices: 8 x NVIDIA H100 80GB HBM3 (gpu), 2 processes``."""
    kinds = sorted({d.device_kind for d in devices})
    processes = jax.process_count()
    where = f", {processes} processes" if processes > 1 else ""
    return f"devices: {len(devices)} x {' + '.join(kinds)} ({devices[0].platform}){where}"


def cpu_with_gpu_warning(config: Config, platform: str, list_gpus: Callable[[], list[str]]) -> str | None:
    """A warning when GPUs are visible but JAX runs on CPU without having been asked to
    (``hardware=cpu`` or ``JAX_PLATFORMS=cpu`` ask); ``nvidia-smi`` is asked only then."""
    asked_for_cpu = config.hardware == "cpu" or os.environ.get("JAX_PLATFORMS", "") == "cpu"
    if platform != "cpu" or asked_for_cpu or not (gpus := list_gpus()):
        return None
    return f"warning: nvidia-smi lists {len(gpus)} GPU(s) but JAX runs on CPU; to train on them, {CUDA_INSTALL_HINT}"
