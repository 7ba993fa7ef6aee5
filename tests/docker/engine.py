"""A Docker engine for the image tests: the one that answers, or else ``dockerd`` from Debian's
``docker.io`` package (installed with apt when missing) started here as a child of the tests.

The engine started here runs on its own socket, data and exec folders, with the ``vfs`` storage
driver and no bridge or iptables, so that it needs nothing of the host but root. It is stopped by pid
afterwards, and a process left carrying its data folder is reported. Its data folder
(``MAXTEXT_DOCKER_STATE``, default ``~/.cache/maxtext-docker``) outlives the tests, so a second run
reuses the base images and the package layers; what no tag names any more is removed when it starts.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from cluster.apt import install, reason_not_to_install

STATE = Path(os.environ.get("MAXTEXT_DOCKER_STATE", Path.home() / ".cache" / "maxtext-docker"))
# The package's client speaks its daemon's API version (a newer client on PATH may not).
PACKAGE_CLIENT = Path("/usr/bin/docker")


class Engine:
    def __init__(
        self, env: dict[str, str], client: str, process: subprocess.Popen | None = None, run_dir: Path | None = None
    ):
        self.env = env
        self.client = client
        self.process = process  # dockerd, when started here
        self.run_dir = run_dir  # its socket and exec folder

    def run(self, *args: str, timeout: float = 600, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        """``docker ARGS``; output captured as text unless told otherwise; raises on failure if ``check``."""
        kwargs.setdefault("capture_output", True)
        result = subprocess.run([self.client, *args], env=self.env, timeout=timeout, text=True, **kwargs)
        if check and result.returncode != 0:
            out = (result.stdout or "")[-3000:] + (result.stderr or "")[-3000:]
            raise RuntimeError(f"docker {' '.join(args[:3])} ... failed ({result.returncode}):\n{out}")
        return result

    def answers(self) -> bool:
        return self.run("info", timeout=30, check=False).returncode == 0

    def stop(self) -> list[str]:
        """Stop the engine started here (if any); the command lines of processes it left behind."""
        if self.process is None:
            return []
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        time.sleep(1)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        return [line for line in _process_lines() if str(STATE) in line or str(self.run_dir) in line]


def _process_lines() -> list[str]:
    lines = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                lines.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
            except OSError:
                continue
    return lines


def start(log: Path) -> Engine | str:
    """An engine that answers, or the reason there can be none here."""
    client = shutil.which("docker") or str(PACKAGE_CLIENT)
    existing = Engine(dict(os.environ), client)
    if Path(client).exists() and existing.answers():
        return existing
    if shutil.which("dockerd") is None:
        if reason := reason_not_to_install("Docker (dockerd)"):
            return reason
        install(("docker.io",))
    STATE.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="dockerd-"))  # short: unix socket paths are limited to 108 bytes
    socket = run_dir / "docker.sock"
    command = [
        shutil.which("dockerd"),
        "--storage-driver=vfs",
        "--iptables=false",
        "--bridge=none",
        f"--data-root={STATE / 'data'}",
        f"--exec-root={run_dir / 'exec'}",
        f"--pidfile={run_dir / 'dockerd.pid'}",
        "--host",
        f"unix://{socket}",
    ]
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)
    env = {**os.environ, "DOCKER_HOST": f"unix://{socket}", "DOCKER_BUILDKIT": "0"}
    engine = Engine(env, str(PACKAGE_CLIENT if PACKAGE_CLIENT.exists() else client), process, run_dir)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"dockerd exited ({process.returncode}):\n{log.read_text()[-3000:]}")
        if socket.exists() and engine.answers():
            # Its data folder is ours alone: what earlier runs left (stopped containers, images no tag
            # names any more, full copies of the file system under vfs) would only fill the disk.
            engine.run("container", "prune", "--force", timeout=600)
            engine.run("image", "prune", "--force", timeout=1800)
            return engine
        time.sleep(1)
    engine.stop()
    raise RuntimeError(f"dockerd did not answer within 120 s:\n{log.read_text()[-3000:]}")
