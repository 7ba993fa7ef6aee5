"""The Slurm recipes run for real: a one-node Slurm cluster (tests/cluster/local_slurm.py) runs the
shipped sbatch files on CPU, two tasks per job, each task one JAX process (gloo collectives).

1. The GB200 671B recipe file itself, scaled down from the command line only: sbatch options
   override its #SBATCH lines (64 nodes, 4 tasks per node, a GPU per task, 32 CPUs per task) and
   ``MAXTEXT_ARGS`` overrides its model, data and mesh, so its srun line, environment and argument
   array run as written. It runs smoke.sbatch's model and batch for smoke.sbatch's steps
   (tests/cluster/scaled_down.py) with the MoE stack pipelined over two stages, one per process
   (the stage axis across processes: the stage transfers go over gloo), so its losses are those of
   an uninterrupted smoke run with that layout.
2. A plan through ``CONFIG``, as ``tools/plan.py --emit-config`` says to use it
   (``CONFIG=plan.yml sbatch recipes/slurm/smoke.sbatch``): the plan's mesh, not the recipe's, is
   the run's, and ``MAXTEXT_ARGS`` still wins over the plan.
3. Failures and preemption on ``smoke.sbatch`` with both checkpoint tiers: a task's process killed
   (SIGKILL) three times, the run started again by the recipe's run block each time from the
   newest tier any copy holds; then the signal that precedes a time limit (``scancel
   --signal=TERM``, what ``--signal=TERM@60`` sends): the job exits 0 having saved its step, and
   the same job submitted again continues from it with exactly the uninterrupted losses, both
   tasks one JAX job (``num_processes: 2`` in the run's config.yml).

The jobs run one after another (the node has the machine's CPUs, a job takes two). The processes
see one CPU device each; the GPU-only settings the 671B recipe exports (XLA GPU flags, NCCL) are
inert on CPU. The recipe's run and the two-tier job compile one program, so the suite's shared
compilation cache serves all but the first; the planned job compiles its own (another mesh) and
runs 2 steps.

smoke.sbatch checkpoints at its last step and when signalled, not periodically. Periodic saves of
a two-process run are exercised in tests/test_train.py (they once crashed gloo, or hung, because
a background thread started Orbax's save, whose collectives crossed the next step's).
"""

import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
import yaml
from cluster.local_slurm import LocalSlurm, install_reason_to_skip
from cluster.scaled_down import SMOKE_STEPS, TINY_ON_TWO_CPUS, image_xla_flags

from MaxText.train.metrics import read_metrics, step_records
from tests.conftest import TEST_XLA_FLAGS, cpu_env

pytestmark = pytest.mark.slow  # whole runs: `make test-fast` leaves this file out

REPO = Path(__file__).resolve().parents[1]
SLURM = REPO / "recipes" / "slurm"
JOB_TIMEOUT = 240


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = install_reason_to_skip()
    if reason:
        pytest.skip(reason)
    slurm = LocalSlurm(tmp_path_factory.mktemp("slurm"))
    try:
        slurm.start()
        yield slurm
    finally:
        leftovers = slurm.stop()
        assert not leftovers, f"processes of the test cluster were still running: {leftovers}"


@pytest.fixture(scope="module")
def submit_env() -> dict[str, str]:
    """The submitting shell's environment (sbatch passes it on to the tasks): this interpreter as
    PYTHON, the GPU image's XLA_FLAGS and the suite's (so one CPU device per process: the test
    session's 8 simulated devices are not passed on), the suite's flags again as EXTRA_XLA_FLAGS
    for the recipes that set XLA_FLAGS themselves (one cache key for every job), the session's
    shared compilation cache."""
    suite_flags = " ".join(TEST_XLA_FLAGS)
    xla_flags = f"{image_xla_flags()} {suite_flags}"
    return cpu_env(1, XLA_FLAGS=xla_flags, EXTRA_XLA_FLAGS=suite_flags, PYTHON=sys.executable)


def submit(
    cluster: LocalSlurm, env: dict, script: Path, output_dir: Path, *options: str, args=(), config: Path | None = None
) -> str:
    """sbatch from the repository root (the tasks' working directory) with OUTPUT_DIR, MAXTEXT_ARGS
    and CONFIG (empty: none) set; the job's output goes to output_dir."""
    output_dir.mkdir(parents=True, exist_ok=True)
    env = {**env, "OUTPUT_DIR": str(output_dir), "MAXTEXT_ARGS": " ".join(args), "CONFIG": str(config or "")}
    return cluster.sbatch(script, f"--output={output_dir}/job-%j.out", *options, env=env, cwd=REPO)


def finish(cluster: LocalSlurm, job_id: str, output_dir: Path) -> str:
    """Wait for the job; it must have completed with exit code 0. Its output."""
    job = cluster.wait(job_id, JOB_TIMEOUT)
    log = (output_dir / f"job-{job_id}.out").read_text()
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), log[-3000:]
    return log


def metrics(run_dir: Path) -> list[dict]:
    return step_records(read_metrics(run_dir)) if (run_dir / "metrics.jsonl").exists() else []


def losses(run_dir: Path) -> dict[int, float]:
    """Step -> loss; a step logged twice (before a stop and again after the resume) keeps its last value."""
    return {record["step"]: record["loss"] for record in metrics(run_dir)}


def runtime(run_dir: Path) -> tuple[dict, dict]:
    config = yaml.safe_load((run_dir / "config.yml").read_text())
    return config, config["runtime"]


# ---------------------------------------------------------------- the 671B recipe, scaled down

# sbatch options win over the file's #SBATCH lines. The time limit must exceed the recipe's
# --signal=TERM@600 lead, or the warning signal comes at once.
STAGE_ACROSS_TASKS = ("dcn_pipeline_parallelism=2",)  # the MoE stack's two stages, one per task
TWO_CPU_TASKS = ("--nodes=1", "--ntasks-per-node=2", "--gpus-per-task=0", "--cpus-per-task=1", "--time=01:00:00")


@pytest.fixture(scope="module")
def recipe_run(cluster, submit_env, tmp_path_factory) -> tuple[Path, str]:
    """The 671B recipe, its own srun line, environment and TRAIN_ARGS, on two CPU tasks, for
    smoke.sbatch's steps: (run folder, job output)."""
    tmp_path = tmp_path_factory.mktemp("gb200")
    recipe = SLURM / "deepseek3-671b-gb200-nvl72.sbatch"
    text = recipe.read_text()
    options = TWO_CPU_TASKS
    if cluster.sbatch_knows("--segment"):
        options += ("--segment=1",)
    else:
        # Slurm before 24.11 (Debian 12 ships 22.05) refuses the --segment directive (topology/block
        # placement), so the file runs without that one line.
        kept = [line for line in text.splitlines(keepends=True) if not line.startswith("#SBATCH --segment=")]
        assert len(kept) == len(text.splitlines()) - 1
        recipe = tmp_path / recipe.name
        recipe.write_text("".join(kept))
    output = tmp_path / "outputs"
    args = (*TINY_ON_TWO_CPUS, *STAGE_ACROSS_TASKS, f"steps={SMOKE_STEPS}")
    log = finish(cluster, submit(cluster, submit_env, recipe, output, *options, args=args), output)
    run_name = re.search(r"^\s*run_name=(\S+)$", text, re.M).group(1)
    return output / run_name, log


def test_gb200_recipe_file_runs_scaled_down(recipe_run):
    run_dir, log = recipe_run
    config, topology = runtime(run_dir)
    assert (topology["num_processes"], topology["num_devices"]) == (2, 2), log[-2000:]
    assert (config["model_name"], config["hardware"], config["dtype"]) == ("deepseek3-tiny", "cpu", "float32")
    assert (config["dcn_pipeline_parallelism"], config["num_pipeline_microbatches"]) == (
        2,
        -1,
    )  # one micro-batch per stage
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, SMOKE_STEPS + 1))


# The H100 recipe's two-hop exchange across the two tasks: each task a "node" of 2 CPU devices.
TWO_NODES_OF_TWO = (
    "ici_data_parallelism=1",
    "ici_expert_parallelism=2",
    "dcn_expert_parallelism=2",
    "moe_ep_comm=hierarchical",
)


def test_h100_recipe_file_runs_its_two_hop_exchange_across_tasks(cluster, submit_env, tmp_path):
    """The 256-H100 recipe on two CPU tasks of 2 devices each, its expert axis 2 inside a task x 2
    across them: the two-hop exchange's hop across nodes runs between the processes (XLA:CPU's
    collectives over gloo), the hop inside a node within each; the loss falls as in every run."""
    recipe = SLURM / "deepseek3-671b-h100.sbatch"
    env = {**submit_env, "EXTRA_XLA_FLAGS": f"{submit_env['EXTRA_XLA_FLAGS']} --xla_force_host_platform_device_count=2"}
    output = tmp_path / "outputs"
    args = (*TINY_ON_TWO_CPUS, *TWO_NODES_OF_TWO, f"steps={SMOKE_STEPS}")
    log = finish(cluster, submit(cluster, env, recipe, output, *TWO_CPU_TASKS, args=args), output)
    run_name = re.search(r"^\s*run_name=(\S+)$", recipe.read_text(), re.M).group(1)
    config, topology = runtime(output / run_name)
    assert (topology["num_processes"], topology["num_devices"]) == (2, 4), log[-2000:]
    assert (config["moe_ep_comm"], config["ici_expert_parallelism"], config["dcn_expert_parallelism"]) == (
        "hierarchical",
        2,
        2,
    )
    steps = losses(output / run_name)
    assert sorted(steps) == list(range(1, SMOKE_STEPS + 1))
    assert steps[SMOKE_STEPS] < steps[1]


# ---------------------------------------------------------------- a plan, through CONFIG


def test_smoke_recipe_runs_the_mesh_of_a_plan(cluster, submit_env, tmp_path):
    """``CONFIG=plan.yml sbatch recipes/slurm/smoke.sbatch`` with the file tools/plan.py writes for
    the tiny model on 2 GPUs at smoke.sbatch's batch: fsdp 2 with minimal remat, where the recipe
    runs data parallelism over all tasks (and the tiny model no remat). The plan's keys win over the
    recipe's TRAIN_ARGS, and MAXTEXT_ARGS (2 steps, a run name) over the plan."""
    from tools import plan

    assert re.search(r"^  ici_data_parallelism=-1$", (SLURM / "smoke.sbatch").read_text(), re.M)
    overlay = tmp_path / "plan.yml"
    plan.main(
        ["model_name=deepseek3-tiny", "per_device_batch_size=8", "--system", "h100", "--gpus", "2"]
        + ["--emit-config", str(overlay)]
    )
    assert "CONFIG=" in overlay.read_text()  # the header says how to use it
    keys = yaml.safe_load(overlay.read_text())
    assert (keys["ici_data_parallelism"], keys["ici_fsdp_parallelism"], keys["remat_policy"]) == (1, 2, "minimal")

    output = tmp_path / "outputs"
    args = ("run_name=planned", "steps=2", "remat_policy=full")
    job_id = submit(cluster, submit_env, SLURM / "smoke.sbatch", output, "--ntasks=2", args=args, config=overlay)
    log = finish(cluster, job_id, output)
    config, topology = runtime(output / "planned")
    assert (topology["num_processes"], topology["num_devices"]) == (2, 2), log[-2000:]
    assert {k: config[k] for k in keys if k != "remat_policy"} == {k: v for k, v in keys.items() if k != "remat_policy"}
    assert (config["remat_policy"], config["steps"]) == ("full", 2)  # MAXTEXT_ARGS over the plan
    assert [r["step"] for r in metrics(output / "planned")] == [1, 2]


# ---------------------------------------------------------------- two-tier checkpoints, processes killed


def training_processes(job_id: str) -> dict[int, int]:
    """Task rank -> pid of the job's training processes now running."""
    found = {}
    for proc in (p for p in Path("/proc").iterdir() if p.name.isdigit()):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if b"MaxText.train" not in argv or Path(argv[0].decode()).name == "srun":
                continue
            env = dict(v.split(b"=", 1) for v in (proc / "environ").read_bytes().split(b"\0") if b"=" in v)
            if env.get(b"SLURM_JOB_ID") == job_id.encode() and b"SLURM_PROCID" in env:
                found[int(env[b"SLURM_PROCID"])] = int(proc.name)
        except (FileNotFoundError, ProcessLookupError, PermissionError, ValueError):
            continue
    return found


def kill_task(job_id: str, rank: int, *remove: Path) -> None:
    """SIGKILL the training process of the job's task ``rank`` (a process lost without warning);
    once srun has ended the other tasks, delete ``remove`` (node-local storage lost with it),
    before the run starts again."""
    running = training_processes(job_id)
    assert rank in running, f"no training process of task {rank} of job {job_id}"
    os.kill(running[rank], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while any(Path(f"/proc/{pid}").exists() for pid in running.values()):
        assert time.monotonic() < deadline, "srun left a task of the killed run running"
        time.sleep(0.05)
    for path in remove:
        shutil.rmtree(path)


def wait_for_local_step(cluster: LocalSlurm, job_id: str, local: Path, step: int) -> None:
    """Until both processes' node-local saves of ``step`` are complete (renamed into place)."""
    deadline = time.monotonic() + JOB_TIMEOUT
    while not all((local / f"process-{p}" / str(step)).is_dir() for p in (0, 1)):
        assert time.monotonic() < deadline, f"no node-local step {step} in {local}"
        assert cluster.job(job_id).get("JobState") in ("PENDING", "RUNNING"), "the job ended"
        time.sleep(0.05)


def test_killed_process_restarts_from_the_newest_tier_and_a_signalled_job_continues_exactly(
    cluster, submit_env, recipe_run, tmp_path
):
    """smoke.sbatch with both checkpoint tiers (node-local every 2 steps, persistent every 5) and
    the recipe run's stage axis, so each task holds its own half of the state and keeps a copy of
    the other's. The job asks for far more steps on smoke.sbatch's learning-rate schedule, so that
    it is still running whenever a signal lands, and lets the processes agree on a signal after
    every step. Task 1's process is killed with SIGKILL three times; each time the recipe's run
    block starts the run again in the job's allocation, and it resumes:
    1. after local step 6 (persistent 5): from the local step 6;
    2. after local step 8, with task 1's local directory deleted (a replaced node): from step 8,
       task 1's blocks sent from task 0's copy;
    3. after local step 12, with every local directory deleted: from the persistent step 10.
    Then the job gets the signal that precedes a time limit (``--signal=TERM@60``): it saves its
    step and exits 0, and the same job submitted again (a new job id, the same run) continues from
    that step to step 20 as one JAX job of both tasks. The losses of steps 1-10 are the
    uninterrupted run's (the scaled-down recipe's, same schedule) and every step logged again
    after a resume or the resubmission repeats its loss bit for bit."""
    output = tmp_path / "outputs"
    run_dir, local = output / "twotier", tmp_path / "local"
    run_local = local / "twotier"
    args = (
        "run_name=twotier",
        f"learning_rate_schedule_steps={SMOKE_STEPS}",
        "checkpoint_period=5",
        "enable_emergency_checkpoint=true",
        f"local_checkpoint_directory={local}",
        "local_checkpoint_period=2",
        "preemption_check_period=1",
        *STAGE_ACROSS_TASKS,
    )
    job_id = submit(cluster, submit_env, SLURM / "smoke.sbatch", output, "--ntasks=2", args=(*args, "steps=1000"))

    wait_for_local_step(cluster, job_id, run_local, 6)
    kill_task(job_id, 1)
    wait_for_local_step(cluster, job_id, run_local, 8)
    kill_task(job_id, 1, run_local / "process-1")
    wait_for_local_step(cluster, job_id, run_local, 12)
    kill_task(job_id, 1, run_local)
    wait_for_local_step(cluster, job_id, run_local, 14)  # the restarted run has gone past its restore
    cluster.signal(job_id, "TERM")

    log = finish(cluster, job_id, output)
    resumed = re.findall(r"^resuming from (.*) \(step (\d+)\)$", log, re.M)
    assert resumed == [
        (f"the node-local checkpoint {run_local / 'process-0' / '6'}", "6"),
        (f"the node-local checkpoint {run_local / 'process-0' / '8'}", "8"),
        (str(run_dir / "checkpoints" / "10"), "10"),
    ], log[-4000:]
    assert "node-local step 8: process 1's blocks from process 0's storage" in log, log[-4000:]
    assert [int(n) for n in re.findall(r"restarting the run \(restart (\d) of 3\)", log)] == [1, 2, 3], log[-4000:]
    stopped = re.search(r"stopped by SIGTERM after step (\d+); saved (\S+)", log)
    assert stopped, log[-3000:]
    step, last = int(stopped.group(1)), 20
    assert 14 <= step < last, f"the signal reached the job only after step {step}"
    assert Path(stopped.group(2)) == run_dir / "checkpoints" / str(step)
    assert (run_dir / "checkpoints" / str(step) / "state").is_dir()

    job_id = submit(cluster, submit_env, SLURM / "smoke.sbatch", output, "--ntasks=2", args=(*args, f"steps={last}"))
    log = finish(cluster, job_id, output)
    newest = (
        f"the node-local checkpoint {run_local / 'process-0' / str(step)}",
        str(run_dir / "checkpoints" / str(step)),
    )
    resumed = [source for source, _ in re.findall(r"^resuming from (.*) \(step (\d+)\)$", log, re.M)]
    # the node-local copy when the signal came after a node-local save, else the persistent one
    assert len(resumed) == 1 and resumed[0] in newest, log[-3000:]
    config, topology = runtime(run_dir)
    assert (topology["num_processes"], topology["num_devices"], topology["platform"]) == (2, 2, "cpu")
    assert config["model_name"] == "deepseek3-tiny"
    assert (run_dir / "checkpoints" / str(last)).is_dir()
    first, repeated = {}, 0
    for record in metrics(run_dir):
        if record["step"] in first:
            assert record["loss"] == first[record["step"]], f"step {record['step']} changed after a resume"
            repeated += 1
        first.setdefault(record["step"], record["loss"])
    assert repeated >= 2 and sorted(first) == list(range(1, last + 1))
    reference = losses(recipe_run[0])
    assert {step: first[step] for step in reference} == reference
