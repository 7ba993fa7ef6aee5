"""The stop decision is shared: when one process of a multi-process job gets SIGTERM, every
process's ``should_stop()`` says so at the same check (two local processes, gloo collectives)."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

PROGRAM = """
import os, signal, sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
from MaxText.train.preemption import PreemptionWatch
with PreemptionWatch() as watch:
    before = watch.should_stop()
    if int(sys.argv[2]) == int(sys.argv[3]):
        os.kill(os.getpid(), signal.SIGTERM)  # recorded, not fatal, while the watch is active
    after = watch.should_stop()
print(f"before={before} after={after} name={watch.signal_name()}", flush=True)
"""


@pytest.mark.parametrize("signalled", [0, 1, -1], ids=["process-0", "process-1", "none"])
def test_one_process_signalled_stops_every_process(signalled):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", PROGRAM, address, str(i), str(signalled)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0] for p in processes]
    for i, (process, output) in enumerate(zip(processes, outputs, strict=True)):
        assert process.returncode == 0, output[-2000:]
        expected_name = "SIGTERM" if i == signalled else "another process"
        assert f"before=False after={signalled >= 0} name={expected_name}" in output, output[-2000:]
