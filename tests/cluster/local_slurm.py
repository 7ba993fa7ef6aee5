"""A one-node Slurm cluster of the test's own, so that the shipped sbatch files run for real.

Loading a recipe's arguments into the config (tests/test_recipes.py) cannot catch what breaks
recipes on a cluster: quoting, the environment that reaches the tasks, the task-to-process
mapping, resume after a signal. Here slurmctld and slurmd (Debian's Slurm, 22.05 on Debian 12) run
as root on this machine with munge authentication, ``select/cons_tres`` and
``proctrack/linuxproc`` (no cgroups needed), and the tests submit the recipe files with ``sbatch``.

- Everything lives in one temporary folder: slurm.conf (on free ports), the munge key and socket,
  state, spool and logs. The commands find the cluster through ``SLURM_CONF``, so a system Slurm,
  if there is one, is never touched.
- The node is called ``localhost`` (``slurmd -N``): ``jax.distributed.initialize()`` takes the
  coordinator's host name from ``SLURM_STEP_NODELIST``, and ``localhost`` resolves everywhere,
  whatever this machine's name is.
- At least 2 CPUs are declared (``config_overrides``), so a 2-task job fits on any machine.
- The daemons run in the foreground as children of the test and are stopped by pid; every job is
  cancelled first, and any process that still carries this cluster's ``SLURM_CONF`` afterwards
  (a job step, a task) is killed by pid and reported.
- Installing: when the commands are missing and the test runs as root, ``apt-get`` installs
  ``slurmctld slurmd slurm-client munge`` with a temporary ``policy-rc.d`` that stops the
  packages from starting system daemons. Not root and not installed is the one reason to skip.
"""

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from cluster.apt import install, reason_not_to_install

COMMANDS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "squeue", "sinfo")
PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
FINISHED_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
}


def missing_commands() -> list[str]:
    return [c for c in COMMANDS if shutil.which(c) is None and not Path("/usr/sbin", c).exists()]


def install_reason_to_skip() -> str | None:
    """Install Slurm and munge with apt when missing; the reason to skip where that cannot be done."""
    missing = missing_commands()
    if not missing:
        return None
    if reason := reason_not_to_install(f"Slurm ({', '.join(missing)})"):
        return reason
    install(PACKAGES)
    if still := missing_commands():
        raise RuntimeError(f"apt installed {' '.join(PACKAGES)} but {', '.join(still)} are still missing")
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tool(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


class LocalSlurm:
    """slurmctld + slurmd + munged on this machine, configured in ``root``; ``stop()`` ends them all."""

    NODE = "localhost"

    def __init__(self, root: Path):
        self.root = root
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.daemons: list[subprocess.Popen] = []

    # ---------------------------------------------------------------- start and stop

    def start(self, timeout: float = 60) -> None:
        munge = self.root / "munge"
        for folder in (munge, self.root / "state", self.root / "spool", self.root / "logs"):
            folder.mkdir(parents=True)
        munge.chmod(0o755)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        socket_path = munge / "munge.socket"
        self.conf.write_text(self._slurm_conf(socket_path))
        self._daemon(
            [
                _tool("munged"),
                "--foreground",
                "--force",
                f"--socket={socket_path}",
                f"--key-file={key}",
                f"--log-file={munge / 'munged.log'}",
                f"--pid-file={munge / 'munged.pid'}",
                f"--seed-file={munge / 'munged.seed'}",
            ],
            "munged",
        )
        self._wait_for(socket_path.exists, timeout, "munged did not create its socket")
        self._daemon([_tool("slurmctld"), "-D", "-i"], "slurmctld")
        self._daemon([_tool("slurmd"), "-D", "-N", self.NODE], "slurmd")
        self._wait_for(lambda: self._node_state() == "idle", timeout, "the node did not become idle")

    def stop(self) -> list[str]:
        """Cancel every job, stop the daemons by pid; returns what had to be killed afterwards."""
        if any(d.poll() is None for d in self.daemons[1:]):
            subprocess.run([_tool("scancel"), "--full", *self._job_ids()], env=self.env, capture_output=True)
            try:
                self._wait_for(lambda: not self._job_ids(), 30, "jobs did not end")
            except AssertionError:
                pass  # killed below
        for daemon in reversed(self.daemons):  # slurmd, slurmctld, munged
            if daemon.poll() is None:
                daemon.send_signal(signal.SIGTERM)
                try:
                    daemon.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    daemon.kill()
                    daemon.wait()
        return self._kill_leftovers()

    def _daemon(self, command: list[str], name: str) -> None:
        log = (self.root / "logs" / f"{name}.out").open("w")
        self.daemons.append(
            subprocess.Popen(command, env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        )
        log.close()

    def _kill_leftovers(self) -> list[str]:
        """Processes still carrying this cluster's SLURM_CONF (steps, tasks): killed by pid, named."""
        marker = f"SLURM_CONF={self.conf}".encode()
        killed = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) == os.getpid():
                continue
            try:
                if marker in (proc / "environ").read_bytes().split(b"\0"):
                    cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                    os.kill(int(proc.name), signal.SIGKILL)
                    killed.append(f"{proc.name} {cmdline.strip()}")
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue
        return killed

    def _slurm_conf(self, munge_socket: Path) -> str:
        controller = socket.gethostname().split(".")[0]
        root = self.root
        return f"""\
ClusterName=local
SlurmctldHost={controller}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
StateSaveLocation={root / "state"}
SlurmdSpoolDir={root / "spool"}
SlurmctldPidFile={root / "slurmctld.pid"}
SlurmdPidFile={root / "slurmd.pid"}
SlurmctldLogFile={root / "logs" / "slurmctld.log"}
SlurmdLogFile={root / "logs" / "slurmd.log"}
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
KillWait=5
SlurmdParameters=config_overrides
NodeName={self.NODE} NodeAddr=127.0.0.1 CPUs={max(2, os.cpu_count() or 1)} State=UNKNOWN
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""

    # ---------------------------------------------------------------- jobs

    def sbatch(self, script: Path, *options: str, env: dict | None = None, cwd: Path | None = None) -> str:
        """Submit ``script`` with ``options`` (which win over its #SBATCH lines); the job id."""
        result = subprocess.run(
            [_tool("sbatch"), "--parsable", *options, str(script)],
            env={**(env or os.environ), "SLURM_CONF": str(self.conf)},
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
        )
        assert result.returncode == 0, f"sbatch {script.name} failed: {result.stderr}"
        return result.stdout.strip().split(";")[0]

    def sbatch_knows(self, option: str) -> bool:
        help_text = subprocess.run([_tool("sbatch"), "--help"], env=self.env, capture_output=True, text=True).stdout
        return option in help_text

    def job(self, job_id: str) -> dict[str, str]:
        """The job's fields from ``scontrol show job`` (JobState, ExitCode, ...)."""
        out = subprocess.run(
            [_tool("scontrol"), "show", "job", "-o", job_id], env=self.env, capture_output=True, text=True
        ).stdout
        return dict(field.split("=", 1) for field in out.split() if "=" in field)

    def wait(self, job_id: str, timeout: float) -> dict[str, str]:
        """Wait for the job to finish; its final fields."""
        self._wait_for(lambda: self.job(job_id).get("JobState") in FINISHED_STATES, timeout, f"job {job_id} not done")
        return self.job(job_id)

    def signal(self, job_id: str, name: str) -> None:
        """What the cluster does before a time limit (--signal): the signal to every task of every step."""
        subprocess.run([_tool("scancel"), f"--signal={name}", job_id], env=self.env, check=True)

    def _job_ids(self) -> list[str]:
        out = subprocess.run([_tool("squeue"), "-h", "-o", "%i"], env=self.env, capture_output=True, text=True)
        return out.stdout.split()

    def _node_state(self) -> str:
        out = subprocess.run([_tool("sinfo"), "-h", "-o", "%T"], env=self.env, capture_output=True, text=True)
        return out.stdout.strip()

    def _wait_for(self, condition, timeout: float, message: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return
            if any(d.poll() is not None for d in self.daemons):
                logs = "\n".join(p.read_text()[-1500:] for p in sorted((self.root / "logs").glob("*")))
                raise AssertionError(f"{message}: a daemon exited\n{logs}")
            time.sleep(0.2)
        raise AssertionError(f"{message} within {timeout:.0f} s")
