"""What a new user meets first: the Makefile's install choice (CUDA JAX where ``nvidia-smi -L``
lists a GPU), the device line and its warnings, ``--help`` and ``--help-keys``, and the one-line
exit 2 of ``hardware=gpu`` without a GPU JAX.

The GPU host is a fake ``nvidia-smi`` on ``PATH``: the Makefile and the warning only ask it.
"""

import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest
import yaml

from MaxText.config import BASE_YML
from MaxText.config_help import help_keys, matching_keys, usage
from MaxText.parallel import devices as devices_mod
from tests.conftest import make_config

REPO = Path(__file__).resolve().parents[1]
FAKE_NVIDIA_SMI = """#!/bin/sh
[ "$1" = "-L" ] && echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-00000000-0000-0000-0000-000000000000)"
exit 0
"""


@pytest.fixture
def gpu_host_path(tmp_path: Path) -> str:
    """A PATH whose first folder holds a fake nvidia-smi that lists one H100."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nvidia-smi"
    fake.write_text(FAKE_NVIDIA_SMI)
    fake.chmod(0o755)
    return f"{bin_dir}{os.pathsep}{os.environ['PATH']}"


def make_dry_run(target: str, path: str, tmp_path: Path) -> str:
    """``make -n <target>`` against a venv that does not exist yet, as on a fresh clone."""
    out = subprocess.run(
        ["make", "-n", target, f"VENV={tmp_path / 'fresh-venv'}"],
        cwd=REPO,
        env={**os.environ, "PATH": path},
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout


def without_nvidia_smi() -> str:
    """PATH with every folder that holds an nvidia-smi left out (a CPU host)."""
    return os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if not (Path(p) / "nvidia-smi").exists())


def test_make_train_installs_cuda_jax_on_a_gpu_host(gpu_host_path: str, tmp_path: Path):
    commands = make_dry_run("train", gpu_host_path, tmp_path)
    assert "-r requirements.txt -r requirements-cuda.txt" in commands
    assert "pip install --quiet --no-deps -e ." in commands
    assert ".installed-cuda" in commands
    assert "-m MaxText.train" in commands


def test_make_train_stays_cpu_only_without_a_gpu(tmp_path: Path):
    commands = make_dry_run("train", without_nvidia_smi(), tmp_path)
    assert "-r requirements.txt" in commands
    assert "requirements-cuda.txt" not in commands
    assert ".installed-cpu" in commands


def test_cuda_requirements_pin_the_cpu_sets_jax():
    """requirements-cuda.txt adds the plugin at exactly the jax of requirements.txt, and is locked."""
    cpu = {
        line.split("==")[0]: line.split("==")[1]
        for line in (REPO / "requirements.txt").read_text().splitlines()
        if "==" in line
    }
    cuda = [
        line for line in (REPO / "requirements-cuda.txt").read_text().splitlines() if line and not line.startswith("#")
    ]
    assert cuda == [f"jax[cuda13]=={cpu['jax']}"]
    lock = (REPO / "requirements-cuda.lock").read_text()
    assert f"jax-cuda13-plugin=={cpu['jaxlib']}" in lock and f"jaxlib=={cpu['jaxlib']}" in lock


def test_device_line_names_count_kind_and_platform():
    line = devices_mod.device_line(jax.devices())
    assert line.startswith(f"devices: {len(jax.devices())} x ")
    assert line.endswith("(cpu)")


def test_a_visible_gpu_with_cpu_jax_is_a_warning(gpu_host_path: str, monkeypatch):
    monkeypatch.setenv("PATH", gpu_host_path)
    gpus = devices_mod.visible_gpus()
    assert gpus == ["GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-00000000-0000-0000-0000-000000000000)"]
    monkeypatch.delenv("JAX_PLATFORMS")  # as a user's shell has it
    warning = devices_mod.cpu_with_gpu_warning(make_config(), "cpu", devices_mod.visible_gpus)
    assert warning is not None and "nvidia-smi lists 1 GPU(s)" in warning and "requirements-cuda.txt" in warning
    assert devices_mod.cpu_with_gpu_warning(make_config("hardware=cpu"), "cpu", devices_mod.visible_gpus) is None
    assert devices_mod.cpu_with_gpu_warning(make_config(), "gpu", devices_mod.visible_gpus) is None
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # asked for, too
    assert devices_mod.cpu_with_gpu_warning(make_config(), "cpu", devices_mod.visible_gpus) is None
    monkeypatch.setenv("PATH", without_nvidia_smi())
    assert devices_mod.visible_gpus() == []


def run_train(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}  # as a user's shell has it
    return subprocess.run(
        [sys.executable, "-m", "MaxText.train", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


def test_hardware_gpu_without_gpu_jax_exits_2_with_one_line(tmp_path: Path):
    out = run_train("hardware=gpu", "steps=1", f"base_output_directory={tmp_path}")
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: config key 'hardware'"), out.stderr
    assert "requirements-cuda.txt" in lines[0]
    assert not any(tmp_path.iterdir())  # nothing written


def test_train_help_exits_0_with_usage_and_precedence():
    out = run_train("--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: python -m MaxText.train")
    assert out.stdout == usage() + "\n"
    for layer in ("base.yml", "models/<model_name>.yml", "extra .yml", "key=value"):
        assert layer in out.stdout


def test_help_keys_lists_keys_with_defaults_and_comments():
    base = yaml.safe_load(BASE_YML.read_text())
    assert [k.key for k in matching_keys(None)] == list(base)  # every key, in base.yml's order
    text, code = help_keys("checkpoint_period")
    assert code == 0
    assert "checkpoint_period: 100" in text and "# save every this many steps" in text
    ici = [k.key for k in matching_keys("ici_*")]
    assert ici == [k for k in base if k.startswith("ici_")]
    assert all(k.comment for k in matching_keys(None))


def test_help_is_found_anywhere_and_help_keys_takes_an_equals_form():
    from MaxText.train.__main__ import main

    assert main(["steps=5", "--help"]) == 0
    assert main(["--help-keys=checkpoint_period"]) == 0
    assert main(["--help-keys", "no_such_key"]) == 2


def test_device_line_counts_processes(monkeypatch):
    monkeypatch.setattr(jax, "process_count", lambda: 4)
    assert devices_mod.device_line(jax.devices()).endswith("(cpu), 4 processes")


def test_help_keys_without_a_match_exits_2():
    text, code = help_keys("no_such_key")
    assert code == 2 and text.startswith("error: no config key matches 'no_such_key'")
