"""The images the tests build: the Dockerfiles' base images (pulled, or made here), then the
repository's images from ``docker/``.

Where the public base images cannot be pulled (no registry), a stand-in is made: ``debootstrap
--variant=minbase bookworm`` gives a Debian root file system (installed with apt when missing),
``docker import`` makes it an image, and a small Dockerfile on top installs Debian's Python 3.11
with pip allowed system-wide and the host's CA bundle (so that pip reaches the package index
behind the host's TLS settings). It stands in for ``python:3.11-slim`` (the CPU image) and for the
CUDA image up to the GPU image's Python layers, which need no CUDA.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from cluster.apt import install, reason_not_to_install
from engine import Engine

REPO = Path(__file__).resolve().parents[2]
PUBLIC_PYTHON = "python:3.11-slim"
LOCAL_DEBIAN = "maxtext-local/debian:bookworm"
LOCAL_PYTHON = "maxtext-local/python:3.11"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
PYTHON_ON_DEBIAN = f"""FROM {LOCAL_DEBIAN}
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \\
    && apt-get install -y --no-install-recommends python3 python3-pip python3-venv python-is-python3 ca-certificates \\
    && rm -rf /var/lib/apt/lists/*
COPY host-ca-certificates.crt /etc/ssl/certs/host-ca-certificates.crt
ENV PIP_BREAK_SYSTEM_PACKAGES=1 PIP_CERT=/etc/ssl/certs/host-ca-certificates.crt
"""


def image_id(engine: Engine, tag: str) -> str | None:
    result = engine.run("image", "inspect", "--format", "{{.Id}}", tag, check=False)
    return result.stdout.strip() if result.returncode == 0 else None


def python_base(engine: Engine) -> str:
    """``python:3.11-slim`` if it can be had, else the local stand-in (made once)."""
    if image_id(engine, PUBLIC_PYTHON) or engine.run("pull", PUBLIC_PYTHON, check=False, timeout=300).returncode == 0:
        return PUBLIC_PYTHON
    if image_id(engine, LOCAL_PYTHON):
        return LOCAL_PYTHON
    if not image_id(engine, LOCAL_DEBIAN):
        if shutil.which("debootstrap") is None:
            if reason := reason_not_to_install("debootstrap"):
                raise RuntimeError(reason)
            install(("debootstrap",))
        with tempfile.TemporaryDirectory(prefix="rootfs-") as root:
            subprocess.run(
                ["debootstrap", "--variant=minbase", "bookworm", root, DEBIAN_MIRROR],
                check=True,
                capture_output=True,
                timeout=900,
            )
            tar = subprocess.Popen(["tar", "-C", root, "-c", "."], stdout=subprocess.PIPE)
            engine.run("import", "-", LOCAL_DEBIAN, stdin=tar.stdout, timeout=900)
            tar.wait()
    with tempfile.TemporaryDirectory(prefix="python-base-") as context:
        (Path(context) / "Dockerfile").write_text(PYTHON_ON_DEBIAN)
        shutil.copy(HOST_CA_BUNDLE, Path(context) / "host-ca-certificates.crt")
        engine.run("build", "--network", "host", "-t", LOCAL_PYTHON, context, timeout=1800)
    return LOCAL_PYTHON


def build(engine: Engine, dockerfile: str, tag: str, target: str | None = None, **build_args: str) -> dict:
    """Build ``docker/<dockerfile>`` from the repository root: {tag, seconds, size_gb}."""
    args = ["build", "--force-rm", "--network", "host", "-f", f"docker/{dockerfile}", "-t", tag]
    if target:
        args += ["--target", target]
    for key, value in build_args.items():
        args += ["--build-arg", f"{key}={value}"]
    before = image_id(engine, tag)
    t0 = time.perf_counter()
    engine.run(*args, ".", cwd=REPO, timeout=3600)
    seconds = time.perf_counter() - t0
    after, size = engine.run("image", "inspect", "--format", "{{.Id}} {{.Size}}", tag).stdout.split()
    if before and before != after:
        # The image this tag named before (built from other sources) is left untagged, with the
        # layers only it used. The engine's data folder outlives the runs and under vfs every layer is
        # a full copy of the file system, so each run would leave gigabytes behind: remove it (its
        # layers go with it; the engine keeps any another image still uses).
        engine.run("image", "rm", before, check=False, timeout=600)
    return {"tag": tag, "seconds": seconds, "size_gb": int(size) / 1e9}
