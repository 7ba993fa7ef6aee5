"""Test set-up: CPU only, 8 simulated devices (set before jax is imported anywhere)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import pytest  # noqa: E402

from MaxText.config import Config, load_config  # noqa: E402


def make_config(*overrides: str, model: str = "deepseek3-tiny") -> Config:
    """A resolved config for tests: ``make_config("num_experts=8", "dtype=float64")``."""
    return load_config([f"model_name={model}", "run_name=test", *overrides]).with_platform("cpu")


@pytest.fixture
def tiny_config() -> Config:
    return make_config()
