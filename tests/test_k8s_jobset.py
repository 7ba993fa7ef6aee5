"""The Kubernetes recipes' pods, started as local processes: each pod's environment is rendered
from the JobSet manifest the way Kubernetes and the JobSet controller fill it in, and the pod's
own command runs with exactly that environment, scaled down to two pods.

Both manifests (one rack, 16 racks) are parsed and their fields checked; the container's command
runs with a stand-in ``python`` that prints its arguments, to show that a plan file named by the
``CONFIG`` env entry and the ``MAXTEXT_ARGS`` env entry reach it, in that order after the
recipe's own arguments, and that the result fills the manifest's GPUs. The 16-rack manifest's pods
then run for real.

Rendering a pod (rack r = the JobSet's job index, pod i = the Indexed Job's completion index):
the container's literal ``env`` values, ``JOB_INDEX`` from the job-index annotation (a
``fieldRef``), and ``JOB_COMPLETION_INDEX``, which Kubernetes sets in every pod of an Indexed Job.
The pod's script computes ``JAX_PROCESS_ID`` from them. Scaling down changes only what the
manifest ties to its size, after checking at full size that those fields agree:
replicas x pods per rack = ``JAX_NUM_PROCESSES`` = the ComputeDomain's ``numNodes``,
``PODS_PER_RACK`` = the child Job's parallelism, the GPUs each process drives
(``JAX_LOCAL_DEVICE_IDS``) = the GPUs the pod asks for, and the coordinator address = pod 0 of
rack 0 through the JobSet's headless Service (locally 127.0.0.1 on a free port). ``python`` is
this interpreter, found on ``PATH`` as in the image; the ``MAXTEXT_ARGS`` env entry scales the
model down (tests/cluster/scaled_down.py).
Two racks of one pod each, so the rack index (not only the pod index) decides the process id.
"""

import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cluster.scaled_down import STEPS, TINY_ON_TWO_CPUS

from MaxText.config import load_config
from MaxText.parallel.mesh import mesh_shape
from MaxText.train.metrics import read_metrics, step_records
from tests.conftest import CACHE_ENV, TEST_XLA_FLAGS

REPO = Path(__file__).resolve().parents[1]
MANIFESTS = sorted((REPO / "recipes" / "k8s").glob("*.yaml"))
MANIFEST = REPO / "recipes" / "k8s" / "deepseek3-671b-gb300-nvl72.yaml"  # the one whose pods run
JOB_INDEX_ANNOTATION = "metadata.annotations['jobset.sigs.k8s.io/job-index']"
RACKS, PODS_PER_RACK = 2, 1


def manifest_parts(path: Path = MANIFEST) -> tuple[dict, dict, dict, dict]:
    """(JobSet, ComputeDomain, the replicated Job, the training container)."""
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    (jobset,) = [d for d in docs if d["kind"] == "JobSet"]
    (domain,) = [d for d in docs if d["kind"] == "ComputeDomain"]
    (rjob,) = jobset["spec"]["replicatedJobs"]
    (container,) = rjob["template"]["spec"]["template"]["spec"]["containers"]
    return jobset, domain, rjob, container


def literal_env(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def test_both_manifests_are_shipped():
    assert [p.name for p in MANIFESTS] == ["deepseek3-671b-gb300-nvl72-1rack.yaml", "deepseek3-671b-gb300-nvl72.yaml"]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.stem)
def test_fields_that_must_agree_do(path):
    jobset, domain, rjob, container = manifest_parts(path)
    env = literal_env(container)
    pods = rjob["template"]["spec"]["parallelism"]
    gpus_per_pod = int(container["resources"]["limits"]["nvidia.com/gpu"])
    assert rjob["replicas"] * pods == int(env["JAX_NUM_PROCESSES"]) == domain["spec"]["numNodes"]
    assert int(env["PODS_PER_RACK"]) == pods == rjob["template"]["spec"]["completions"]
    assert env["JAX_LOCAL_DEVICE_IDS"].split(",") == [str(g) for g in range(gpus_per_pod)]
    service = f"{jobset['metadata']['name']}-{rjob['name']}-0-0.{jobset['spec']['network']['subdomain']}"
    assert env["JAX_COORDINATOR_ADDRESS"].rpartition(":")[0] == service
    (job_index,) = [e for e in container["env"] if e["name"] == "JOB_INDEX"]
    assert job_index["valueFrom"]["fieldRef"]["fieldPath"] == JOB_INDEX_ANNOTATION
    # The user's two inputs are env entries, empty as shipped.
    assert (env["MAXTEXT_ARGS"], env["CONFIG"]) == ("", "")


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.stem)
def test_exits_that_a_restart_would_repeat_fail_the_jobset(path):
    """Exit 2 (bad input, a run that cannot fit) and 3 (a guard stopped the run) fail the child Job
    through its pod failure policy, and that reason fails the JobSet instead of restarting it."""
    from MaxText.train.health import EXIT_HALTED

    jobset, _, rjob, container = manifest_parts(path)
    (rule,) = rjob["template"]["spec"]["podFailurePolicy"]["rules"]
    assert rule["action"] == "FailJob" and rule["onExitCodes"]["containerName"] == container["name"]
    assert rule["onExitCodes"]["operator"] == "In" and sorted(rule["onExitCodes"]["values"]) == [2, EXIT_HALTED]
    assert rjob["template"]["spec"]["template"]["spec"]["restartPolicy"] == "Never"  # required by the policy
    (jobset_rule,) = jobset["spec"]["failurePolicy"]["rules"]
    assert jobset_rule == {"action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}


def render_pod_env(container: dict, racks: int, pods_per_rack: int, rack: int, pod: int, coordinator: str) -> dict:
    """One pod's environment, for a JobSet of ``racks`` child Jobs of ``pods_per_rack`` pods."""
    env = literal_env(container)
    env.update(
        JAX_NUM_PROCESSES=str(racks * pods_per_rack),
        PODS_PER_RACK=str(pods_per_rack),
        JAX_COORDINATOR_ADDRESS=coordinator,
        JOB_INDEX=str(rack),  # the fieldRef to the job-index annotation
        JOB_COMPLETION_INDEX=str(pod),  # set by Kubernetes in an Indexed Job
    )
    return env


def gpus_of(rjob: dict, container: dict) -> int:
    return (
        rjob["replicas"]
        * rjob["template"]["spec"]["parallelism"]
        * int(container["resources"]["limits"]["nvidia.com/gpu"])
    )


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.stem)
def test_config_and_maxtext_args_reach_the_command(path, tmp_path):
    """The pod's command with the env entries set as docs/kubernetes.md says: CONFIG names the file
    tools/plan.py --emit-config wrote for this manifest's system and GPUs, MAXTEXT_ARGS adds a key.
    A stand-in ``python`` prints what it is given: the recipe's TRAIN_ARGS, then the plan's keys
    (which win over them), then MAXTEXT_ARGS (which wins over both); loaded, the plan's mesh fills
    the manifest's GPUs."""
    from tools import plan

    jobset, _, rjob, container = manifest_parts(path)
    gpus = gpus_of(rjob, container)
    overlay = tmp_path / "plan.yml"
    plan.main(
        ["model_name=deepseek3-671b", "--system", "gb300-nvl72", "--gpus", str(gpus), "--emit-config", str(overlay)]
    )
    keys = yaml.safe_load(overlay.read_text())
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text('#!/bin/bash\nprintf "%s\\0" "$@"\n')
    (bin_dir / "python").chmod(0o755)
    pods = rjob["template"]["spec"]["parallelism"]
    env = render_pod_env(container, rjob["replicas"], pods, 0, 0, "127.0.0.1:1234")
    env.update(CONFIG=str(overlay), MAXTEXT_ARGS="steps=5 log_period=5", PATH=f"{bin_dir}:{os.environ['PATH']}")
    result = subprocess.run([*container["command"], *container["args"]], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    argv = result.stdout.split("\0")[:-1]
    assert argv[:2] == ["-m", "MaxText.train"]
    plan_args = [f"{k}={v}" for k, v in keys.items()]
    recipe_args = argv[2 : -len(plan_args) - 2]
    assert argv[-len(plan_args) - 2 :] == [*plan_args, "steps=5", "log_period=5"]
    assert "model_name=deepseek3-671b" in recipe_args and any(
        a.startswith("ici_expert_parallelism=") for a in recipe_args
    )
    config = load_config(argv[2:])
    assert {k: getattr(config, k) for k in keys} == keys and config.steps == 5
    dcn, ici = mesh_shape(config, gpus)
    assert math.prod(dcn) * math.prod(ici) == gpus
    assert math.prod(ici) <= pods * int(container["resources"]["limits"]["nvidia.com/gpu"])  # inside one rack


@pytest.fixture(scope="module")
def pods_run(tmp_path_factory) -> tuple[Path, list[str]]:
    """Every pod of the scaled-down JobSet, started with its rendered environment; (run dir, logs)."""
    _, _, _, container = manifest_parts()
    output = tmp_path_factory.mktemp("k8s")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        coordinator = f"127.0.0.1:{s.getsockname()[1]}"
    base = {
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "HOME": os.environ.get("HOME", "/root"),
        **CACHE_ENV,  # the suite's shared compilation cache: a speed-up only
    }
    # The MAXTEXT_ARGS env entry, as a user would set it in the manifest.
    maxtext_args = " ".join((*TINY_ON_TWO_CPUS, f"base_output_directory={output}"))

    def pod_env(rack: int, pod: int) -> dict[str, str]:
        env = render_pod_env(container, RACKS, PODS_PER_RACK, rack, pod, coordinator)
        # The manifest's XLA flags (inert on CPU) and the suite's after them: a speed-up only.
        return {**base, **env, "XLA_FLAGS": " ".join((env["XLA_FLAGS"], *TEST_XLA_FLAGS)), "MAXTEXT_ARGS": maxtext_args}

    processes = [
        subprocess.Popen(
            [*container["command"], *container["args"]],
            env=pod_env(rack, pod),
            cwd=REPO,  # the image's workingDir holds the repository
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rack in range(RACKS)
        for pod in range(PODS_PER_RACK)
    ]
    logs = []
    try:
        for process in processes:
            logs.append(process.communicate(timeout=300)[0])
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    for process, log in zip(processes, logs, strict=True):
        assert process.returncode == 0, log[-3000:]
    run_name = next(a.split("=", 1)[1] for a in container["args"][0].split() if a.startswith("run_name="))
    return output / run_name, logs


@pytest.mark.slow
def test_pods_form_one_jax_job(pods_run):
    run_dir, logs = pods_run
    config = yaml.safe_load((run_dir / "config.yml").read_text())
    assert (config["runtime"]["num_processes"], config["runtime"]["num_devices"]) == (RACKS * PODS_PER_RACK, 2)
    assert (config["model_name"], config["hardware"]) == ("deepseek3-tiny", "cpu")
    steps = [record["step"] for record in step_records(read_metrics(run_dir))]
    assert steps == list(range(1, STEPS + 1))
    # Only process 0 reports: the pod of rack 0, index 0 (JAX_PROCESS_ID = 0), and no other.
    assert ["final loss" in log for log in logs] == [True] + [False] * (len(logs) - 1)
