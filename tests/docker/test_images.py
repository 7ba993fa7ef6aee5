"""The images built and run for real by a local Docker engine (``make docker-test``).

- The CPU image's default command, run with no network and the outputs folder mounted, logs the
  losses a host run of the same command logs, bit for bit (the built-in corpus the host run built
  in that folder is what both read).
- The test image runs a smoke subset of the suite offline: config, router, rotary, attention, the
  TFDS/grain data pipeline (``SMOKE``).
- Two containers on the host network form one JAX job of 2 processes, the coordinator address
  passed as the Kubernetes recipe passes it, and log the losses of one process over the same batch.
- The GPU image's Python layers hold jax with the CUDA plugin and Transformer Engine's Python
  package, and compile the tiny model for a Blackwell target, deviceless.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from MaxText.train.metrics import read_metrics, step_records

REPO = Path(__file__).resolve().parents[2]
# CPU tests needing nothing outside the image (the multi-process ones need a network: gloo)
SMOKE = (
    "tests/test_config.py",
    "tests/test_router.py",
    "tests/test_rotary.py",
    "tests/test_attention.py",
    "tests/test_data_pipeline.py",
)
SYNTHETIC = ("dataset_type=synthetic", "dtype=float32", "steps=4", "log_period=1", "enable_tensorboard=false")


def host_train(*args: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, "-m", "MaxText.train", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


def losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in step_records(read_metrics(run_dir))]


def test_the_cpu_image_trains_offline_as_the_host_does(engine, cpu_image, tmp_path):
    outputs = tmp_path / "outputs"
    host_train(f"base_output_directory={outputs}", "run_name=host")
    engine.run("run", "--rm", "--network", "none", "-v", f"{outputs}:/workspace/outputs", cpu_image, timeout=1200)
    (container,) = [p for p in outputs.iterdir() if p.name.startswith("deepseek3-tiny-")]  # the default run name
    assert (container / "loss.png").exists() and (container / "checkpoints").exists()
    assert len(losses(container)) == 7 and losses(container) == losses(outputs / "host")


def test_a_smoke_subset_of_the_suite_passes_in_the_test_image(engine, cpu_test_image):
    result = engine.run(
        "run",
        "--rm",
        "--network",
        "none",
        cpu_test_image,
        "python",
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        *SMOKE,
        check=False,
        timeout=1200,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout


def test_two_containers_form_one_jax_job(engine, cpu_image, tmp_path):
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    containers = []
    for process in range(2):
        env = {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(process)}
        containers.append(
            engine.run(
                "run",
                "-d",
                "--network",
                "host",
                *[f"--env={k}={v}" for k, v in env.items()],
                "-v",
                f"{outputs}:/workspace/outputs",
                cpu_image,
                "python",
                "-m",
                "MaxText.train",
                *SYNTHETIC,
                "run_name=two",
                "per_device_batch_size=4",
            ).stdout.strip()
        )
    try:
        codes = [engine.run("wait", c, timeout=900).stdout.strip() for c in containers]
        logs = [engine.run("logs", c).stdout + engine.run("logs", c).stderr for c in containers]
        assert codes == ["0", "0"], logs
    finally:
        engine.run("rm", "-f", *containers, check=False)
    runtime = yaml.safe_load((outputs / "two" / "config.yml").read_text())["runtime"]
    assert (runtime["num_processes"], runtime["num_devices"]) == (2, 2)
    host_train(f"base_output_directory={outputs}", *SYNTHETIC, "run_name=one", "per_device_batch_size=8")
    two, one = losses(outputs / "two"), losses(outputs / "one")
    assert [s for s, _ in two] == [s for s, _ in one] == [1, 2, 3, 4]
    assert [loss for _, loss in two] == pytest.approx([loss for _, loss in one], abs=1e-5)


def test_the_gpu_image_python_layers_compile_for_blackwell(engine, gpu_python_image):
    """jax with the CUDA plugin and Transformer Engine's Python package installed from the lock; the
    tiny model's step compiled by XLA:GPU for 8 GB200, no GPU present. (Importing Transformer Engine
    loads the driver's libcuda, which only a GPU host has: its files are checked instead.)"""
    check = (
        "import jax, importlib.metadata as m, importlib.util as u; "
        "print(jax.__version__, m.version('jax-cuda13-plugin'), m.version('transformer-engine'), "
        "m.version('transformer-engine-cu13'), u.find_spec('transformer_engine') is not None)"
    )
    out = engine.run("run", "--rm", "--network", "none", gpu_python_image, "python", "-c", check).stdout.split()
    assert out == ["0.10.2", "0.10.2", "2.20.2", "2.20.2", "True"]
    result = engine.run(
        "run",
        "--rm",
        "--network",
        "none",
        "-v",
        f"{REPO}:/src:ro",
        "-w",
        "/src",
        "-e",
        "JAX_PLATFORMS=cpu",
        "-e",
        "PYTHONPATH=/src",  # the mounted repository is the package (the runtime image sets it too)
        gpu_python_image,
        "python",
        "tools/aot_compile.py",
        "model_name=deepseek3-tiny",
        "--devices",
        "8",
        "--target",
        "gb200",
        "--json",
        timeout=1200,
    )
    report = json.loads(result.stdout[result.stdout.index("{") :])
    assert report["target"] == "gb200" and report["devices"] == 8
    assert report["memory"]["total"] > 0
