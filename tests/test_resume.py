"""Fault tolerance through the real entry point: a run killed with SIGKILL, or stopped with
SIGTERM, and started again with the same command continues with exactly the losses of a run
that was never interrupted (CPU, float32: bit for bit). The runs read real text (a small
built-in corpus through grain), so the data iterator's position is restored too."""

import re
import signal
import time
from pathlib import Path

import pytest
from test_train import launch, read_metrics

pytestmark = pytest.mark.slow  # whole runs: `make test-fast` leaves this file out

STEPS = 12
RUN = (
    f"steps={STEPS}",
    "checkpoint_period=3",
    "log_period=1",
    "enable_tensorboard=false",
    "mtp_num_layers=0",  # a smaller program: these runs are about the loop, not the model
    "base_num_decoder_layers=2",
)


def finish(process, timeout=600) -> str:
    log, _ = process.communicate(timeout=timeout)
    assert process.returncode == 0, log[-3000:]
    return log


def losses(run_dir: Path) -> dict[int, float]:
    """Step -> loss; a step logged twice (before a crash and again after the resume) keeps its last value."""
    return {record["step"]: record["loss"] for record in read_metrics(run_dir)}


def wait_for_step(run_dir: Path, step: int, process, timeout=300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (run_dir / "metrics.jsonl").exists() and max(losses(run_dir), default=0) >= step:
            return
        assert process.poll() is None, "the run ended before it was interrupted"
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached in {timeout} s")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[str, ...]:
    """Data arguments: the built-in corpus (a few files), prepared once for every run here."""
    data_dir = tmp_path_factory.mktemp("corpus")
    return ("dataset_type=builtin", "builtin_max_files=30", f"dataset_path={data_dir}", "grain_worker_count=0")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, corpus) -> dict[int, float]:
    output = tmp_path_factory.mktemp("uninterrupted")
    finish(launch(output, 1, "run_name=straight", *RUN, *corpus))
    return losses(output / "straight")


# The run's own compilation cache (``jax_cache_dir: auto`` without the suite's), and JAX's log of its hits.
OWN_CACHE = {"JAX_COMPILATION_CACHE_DIR": "", "JAX_DEBUG_LOG_MODULES": "jax._src.compiler"}
STEP_FROM_CACHE = "Persistent compilation cache hit for 'jit_train_step'"


def test_stopped_then_killed_run_continues_with_identical_losses(uninterrupted, corpus, tmp_path):
    """One run, three starts of the same command: stopped by SIGTERM (saves, exits 0), resumed and
    killed by SIGKILL (no warning, perhaps mid-save), resumed again to the end. Both restarts read
    the train step from the run's compilation cache instead of compiling it again."""
    run_dir = tmp_path / "interrupted"
    command = (tmp_path, 1, "run_name=interrupted", *RUN, *corpus)

    process = launch(*command, env=OWN_CACHE)
    wait_for_step(run_dir, 2, process)
    process.send_signal(signal.SIGTERM)
    log = finish(process)
    stopped = re.search(r"stopped by SIGTERM after step (\d+); saved (\S+)", log)
    assert stopped, log[-2000:]
    step = int(stopped.group(1))
    assert step < STEPS and Path(stopped.group(2)) == run_dir / "checkpoints" / str(step)
    assert (run_dir / "checkpoints" / str(step) / "state").is_dir()
    assert STEP_FROM_CACHE not in log
    assert [p for p in (run_dir / "jax_cache").iterdir() if p.name.startswith("jit_train_step")]

    process = launch(*command, env=OWN_CACHE)
    wait_for_step(run_dir, 8, process)
    process.send_signal(signal.SIGKILL)
    log, _ = process.communicate()
    assert process.returncode == -signal.SIGKILL
    assert f"resuming from {run_dir / 'checkpoints' / str(step)} (step {step})" in log
    assert STEP_FROM_CACHE in log

    log = finish(launch(*command, env=OWN_CACHE))
    assert STEP_FROM_CACHE in log
    resumed_at = int(re.search(r"resuming from \S+/checkpoints/(\d+) \(step \d+\)", log).group(1))
    assert step <= resumed_at < STEPS  # a save the kill interrupted is not used
    assert losses(run_dir) == uninterrupted
