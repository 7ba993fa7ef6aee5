"""Installing Debian packages for the tests that run real daemons (Slurm, Docker), as root.

A temporary ``policy-rc.d`` stops the packages' scripts from starting system daemons that would
outlive the tests: the tests start their own, as their children, and stop them by pid.
"""

import os
import shutil
import subprocess
from pathlib import Path

POLICY_RC_D = Path("/usr/sbin/policy-rc.d")


def reason_not_to_install(what: str) -> str | None:
    """Why ``apt-get install`` cannot run here (None: it can)."""
    if os.geteuid() != 0:
        return f"{what} is not installed and installing it with apt needs root"
    if shutil.which("apt-get") is None:
        return f"{what} is not installed and there is no apt-get to install it"
    return None


def install(packages: tuple[str, ...]) -> None:
    """``apt-get install`` the packages, no daemon started (RuntimeError with apt's output on failure)."""
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    own_policy = not POLICY_RC_D.exists()
    if own_policy:
        POLICY_RC_D.write_text("#!/bin/sh\nexit 101\n")
        POLICY_RC_D.chmod(0o755)
    try:
        for command in (
            ["apt-get", "update", "-qq"],
            ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages],
        ):
            result = subprocess.run(command, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"{' '.join(command)} failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    finally:
        if own_policy:
            POLICY_RC_D.unlink()
