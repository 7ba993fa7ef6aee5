"""Session fixtures of the image tests: the engine, the base image, the built images (and their
build times and sizes, printed: ``make docker-test`` runs with ``-s``)."""

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # engine.py, images.py

from engine import start  # noqa: E402
from images import build, python_base  # noqa: E402


@pytest.fixture(scope="session")
def engine(tmp_path_factory):
    started = start(tmp_path_factory.mktemp("dockerd") / "dockerd.log")
    if isinstance(started, str):
        pytest.skip(started)
    yield started
    # What the engine holds now, and what its disk has left (vfs keeps a full copy per layer).
    root = Path(started.run("info", "--format", "{{.DockerRootDir}}", check=False).stdout.strip())
    free = f"{shutil.disk_usage(root).free / 1e9:.0f} GB free" if root.is_dir() else "free space unknown"
    print(f"\n{started.run('system', 'df', check=False).stdout}{root}: {free}")
    left = started.stop()
    assert not left, f"processes outlived the Docker engine: {left}"


@pytest.fixture(scope="session")
def base_image(engine) -> str:
    return python_base(engine)


def _built(engine, dockerfile: str, tag: str, target: str, **args: str) -> str:
    figures = build(engine, dockerfile, tag, target, **args)
    print(f"\nbuilt {tag} ({dockerfile} --target {target}): {figures['seconds']:.0f} s, {figures['size_gb']:.2f} GB")
    return tag


@pytest.fixture(scope="session")
def cpu_image(engine, base_image) -> str:
    return _built(engine, "Dockerfile.cpu", "maxtext-cpu:runtime", "runtime", BASE_IMAGE=base_image)


@pytest.fixture(scope="session")
def cpu_test_image(engine, base_image) -> str:
    return _built(engine, "Dockerfile.cpu", "maxtext-cpu:test", "test", BASE_IMAGE=base_image)


@pytest.fixture(scope="session")
def gpu_python_image(engine, base_image) -> str:
    """The GPU image up to its Python layers (jax with the CUDA plugin, CUDA's wheels, Transformer
    Engine's Python package and core library); its JAX extension needs CUDA to compile."""
    return _built(engine, "Dockerfile.gpu", "maxtext-gpu:python-layers", "python-layers", CUDA_IMAGE=base_image)
