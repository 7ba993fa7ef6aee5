"""The stop decision: one process stops at the first check after a signal; in a multi-process job
a signal to any process stops every process at the same step, the next multiple of the check
period (two local processes, gloo collectives)."""

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from MaxText.train.preemption import PreemptionWatch
from tests.conftest import cpu_env

REPO = Path(__file__).resolve().parents[1]

PROGRAM = """
import os, signal, sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
from MaxText.train.preemption import PreemptionWatch
from tests.conftest import cpu_env
stopped = None
with PreemptionWatch(check_period=3) as watch:
    for step in range(1, 10):
        if step == 4 and jax.process_index() == int(sys.argv[3]):
            os.kill(os.getpid(), signal.SIGTERM)  # recorded, not fatal, while the watch is active
        if watch.should_stop(step):
            stopped = step
            break
print(f"stopped={stopped} name={watch.signal_name()}", flush=True)
"""


def run_processes(program: str, *args: str, devices: int = 1) -> list[str]:
    """Run ``program`` as two local processes of one JAX job (argv: coordinator address, process
    id, then ``args``), each with ``devices`` CPU devices; their outputs, once both exited 0."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    env = cpu_env(devices)
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", program, address, str(i), *args],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0] for p in processes]
    for process, output in zip(processes, outputs, strict=True):
        assert process.returncode == 0, output[-2000:]
    return outputs


@pytest.mark.slow
@pytest.mark.parametrize("signalled", [0, 1, -1], ids=["process-0", "process-1", "none"])
def test_one_process_signalled_stops_every_process_at_the_next_check(signalled):
    """SIGTERM before step 4 with checks every 3 steps: the check at 3 says go on, both stop at 6."""
    outputs = run_processes(PROGRAM, str(signalled))
    for i, output in enumerate(outputs):
        name = "SIGTERM" if i == signalled else "another process"
        expected = f"stopped=6 name={name}" if signalled >= 0 else "stopped=None name=another process"
        assert expected in output, output[-2000:]


def test_single_process_stops_at_once_and_restores_the_handlers():
    """Alone, no agreement is needed: the step after the signal stops, whatever the period."""
    before = signal.getsignal(signal.SIGTERM)
    with PreemptionWatch(check_period=10) as watch:
        assert not watch.should_stop(1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert watch.should_stop(2) and watch.signal_name() == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before
