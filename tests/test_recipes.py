"""Cluster recipes and images: what can be checked without a cluster.

Each recipe keeps its ``python -m MaxText.train`` arguments in one bash array, ``TRAIN_ARGS=( ... )``.
The tests evaluate that array with bash (with the recipe's ``NAME=${NAME:-default}`` settings), load
it with the real config loader, and fill the mesh for the recipe's GPU count with the real mesh
code, so a recipe that would die at start-up on the cluster fails here first. Every parameter's split
is checked against the model's real (abstract) parameter tree, so a layout whose shardings JAX would
refuse when creating the train state fails here too.
"""

import math
import os
import re
import subprocess
import textwrap
from pathlib import Path

import jax
import pytest
import yaml

from MaxText.config import Config, ConfigError, load_config
from MaxText.models.deepseek import DeepSeekV3
from MaxText.moe.block import BIAS
from MaxText.parallel.axes import MESH_AXES, parallelism_key
from MaxText.parallel.mesh import mesh_shape
from MaxText.parallel.sharding import check_splits
from MaxText.train.state import dummy_inputs

REPO = Path(__file__).resolve().parents[1]
SBATCH = sorted((REPO / "recipes" / "slurm").glob("*.sbatch"))
# The GPU layouts (one task per GPU); smoke.sbatch runs on any nodes (tests/test_slurm_cluster.py runs it).
GPU_SBATCH = [p for p in SBATCH if re.search(r"^#SBATCH --gpus-per-task=", p.read_text(), re.M)]
K8S = sorted((REPO / "recipes" / "k8s").glob("*.yaml"))
NVL72_GPUS = 72


def _train_args(script: str) -> list[str]:
    """The recipe's TRAIN_ARGS as bash expands them at launch (undefined variables are an error)."""
    block = re.search(r"^[ \t]*TRAIN_ARGS=\([ \t]*$.*?^[ \t]*\)[ \t]*$", script, re.M | re.S)
    assert block, "no TRAIN_ARGS=( ... ) block"
    settings = re.findall(r"^[ \t]*[A-Z_][A-Z0-9_]*=\$\{[A-Z_][A-Z0-9_]*:-[^}]*\}[ \t]*$", script, re.M)
    program = "\n".join(["set -eu", *settings, block.group(0), 'printf "%s\\0" "${TRAIN_ARGS[@]}"'])
    result = subprocess.run(["bash", "-c", program], env={"PATH": os.environ["PATH"]}, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout.split("\0")[:-1]


def _check_layout(args: list[str], gpus: int, domain_gpus: int) -> None:
    """Arguments validate; the filled mesh covers every GPU; its ici part is one NVLink domain."""
    config = load_config(args)
    assert config.hardware == "gpu"
    dcn, ici = mesh_shape(config, gpus)  # raises ConfigError when the product is not `gpus`
    assert math.prod(dcn) * math.prod(ici) == gpus
    assert math.prod(ici) == domain_gpus, f"ici mesh {ici} does not match the {domain_gpus} GPUs of one NVLink domain"
    if gpus > 1:  # every process must derive the same output folder; off Slurm the default is a timestamp
        assert config.run_name and "run_name=" + config.run_name in args


# ---------------------------------------------------------------- Slurm


def _sbatch_options(text: str) -> dict[str, str]:
    return {m[1]: m[2] for m in re.finditer(r"^#SBATCH[ \t]+--([\w-]+)(?:[= ](\S+))?", text, re.M)}


def _sbatch_gpus(opts: dict[str, str]) -> int:
    return int(opts["nodes"]) * int(opts["ntasks-per-node"])


def _exported(text: str) -> set[str]:
    return set(re.findall(r"^export[ \t]+([A-Z_][A-Z0-9_]*)=", text, re.M))


def test_recipes_are_shipped():
    assert [p.name for p in SBATCH] == [
        "deepseek3-671b-gb200-nvl72.sbatch",
        "deepseek3-671b-h100.sbatch",
        "deepseek3-small-1gpu.sbatch",
        "smoke.sbatch",
    ]
    assert [p.name for p in GPU_SBATCH] == [
        "deepseek3-671b-gb200-nvl72.sbatch",
        "deepseek3-671b-h100.sbatch",
        "deepseek3-small-1gpu.sbatch",
    ]
    assert [p.name for p in K8S] == ["deepseek3-671b-gb300-nvl72-1rack.yaml", "deepseek3-671b-gb300-nvl72.yaml"]


@pytest.mark.parametrize("path", SBATCH, ids=lambda p: p.name)
def test_sbatch_is_valid_bash(path):
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("path", SBATCH, ids=lambda p: p.name)
def test_sbatch_directives_precede_the_first_command(path):
    """sbatch stops reading #SBATCH lines at the first command."""
    lines = path.read_text().splitlines()
    first_command = next(i for i, line in enumerate(lines) if line.strip() and not line.lstrip().startswith("#"))
    assert all(i < first_command for i, line in enumerate(lines) if line.startswith("#SBATCH"))


@pytest.mark.parametrize("path", GPU_SBATCH, ids=lambda p: p.name)
def test_sbatch_layout_validates_and_fills_its_gpus(path):
    text = path.read_text()
    opts = _sbatch_options(text)
    nodes, tasks_per_node = int(opts["nodes"]), int(opts["ntasks-per-node"])
    assert opts["gpus-per-task"] == "1", "one process per GPU"
    gpus = _sbatch_gpus(opts)
    if "segment" in opts:  # NVL72 racks: trays of 4 GPUs, placed in whole NVLink domains
        assert tasks_per_node <= 4, "GB200/GB300 compute trays have 4 GPUs"
        segment = int(opts["segment"])
        assert nodes % segment == 0 and segment * tasks_per_node <= NVL72_GPUS
        domain_gpus = segment * tasks_per_node
    else:  # 8-GPU nodes (HGX H100/H200/B200): a node is the NVLink domain
        assert tasks_per_node <= 8, "HGX nodes have 8 GPUs"
        domain_gpus = tasks_per_node
    _check_layout(_train_args(text), gpus, domain_gpus)


@pytest.mark.parametrize("path", SBATCH, ids=lambda p: p.name)
def test_sbatch_launch_gives_each_process_exactly_its_gpu(path):
    """srun takes tasks and GPUs per task from the job, so that sbatch's command line can change
    them; it runs in the image unless PYTHON names an interpreter on the nodes."""
    text = path.read_text()
    srun = re.search(r"^\s*srun\b.*?MaxText\.train", text, re.M | re.S)
    assert srun, "no srun ... python -m MaxText.train"
    assert not re.search(r"--(nodes|ntasks|ntasks-per-node|gpus|gpus-per-task)=", srun.group(0))
    assert '"${CONTAINER_FLAGS[@]}"' in srun.group(0) and '"${PYTHON:-python}" -m MaxText.train' in srun.group(0)
    container = re.search(r"^  CONTAINER_FLAGS=\($.*?^  \)$", text, re.M | re.S)
    assert container and "--container-image=" in container.group(0)
    assert '"${TRAIN_ARGS[@]}"' in text[srun.end() :].splitlines()[0]
    opts = _sbatch_options(text)
    if int(opts.get("ntasks-per-node", opts.get("ntasks", "1"))) > 1:
        # A task's one GPU is its device 0; jax.distributed would otherwise pick device SLURM_LOCALID.
        assert re.search(r"^export JAX_LOCAL_DEVICE_IDS=0$", text, re.M)


@pytest.mark.parametrize("path", SBATCH, ids=lambda p: p.name)
def test_sbatch_exports_reach_the_container(path):
    """pyxis keeps the image's values over the host's unless a variable is listed in --container-env."""
    text = path.read_text()
    listed = re.search(r"^CONTAINER_ENV=(\S+)$", text, re.M)
    assert listed and '--container-env="${CONTAINER_ENV}"' in text
    assert _exported(text) <= set(listed.group(1).split(","))


# ---------------------------------------------------------------- Kubernetes


def _k8s_parts(path: Path) -> tuple[dict, dict, dict, dict]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    (jobset,) = [d for d in docs if d["kind"] == "JobSet"]
    (domain,) = [d for d in docs if d["kind"] == "ComputeDomain"]
    assert domain["apiVersion"] == "resource.nvidia.com/v1beta1"
    (rjob,) = jobset["spec"]["replicatedJobs"]
    (container,) = rjob["template"]["spec"]["template"]["spec"]["containers"]
    return jobset, domain, rjob, container


def _k8s_gpus(rjob: dict, container: dict) -> int:
    return (
        rjob["replicas"]
        * rjob["template"]["spec"]["parallelism"]
        * int(container["resources"]["limits"]["nvidia.com/gpu"])
    )


@pytest.mark.parametrize("path", K8S, ids=lambda p: p.name)
def test_k8s_yaml_parses(path):
    kinds = [d["kind"] for d in yaml.safe_load_all(path.read_text()) if d]
    assert sorted(kinds) == ["ComputeDomain", "JobSet"]


@pytest.mark.parametrize("path", K8S, ids=lambda p: p.name)
def test_k8s_layout_validates_and_fills_its_gpus(path):
    _, _, rjob, container = _k8s_parts(path)
    job = rjob["template"]["spec"]
    pods_per_job = job["parallelism"]
    gpus_per_pod = int(container["resources"]["limits"]["nvidia.com/gpu"])
    assert job["completions"] == pods_per_job and job["completionMode"] == "Indexed"
    assert pods_per_job * gpus_per_pod <= NVL72_GPUS, "a child Job must fit in one NVL72 rack"
    gpus = _k8s_gpus(rjob, container)
    _check_layout(_train_args(container["args"][0]), gpus, pods_per_job * gpus_per_pod)


@pytest.mark.parametrize("path", K8S, ids=lambda p: p.name)
def test_k8s_distributed_env_matches_the_jobset(path):
    jobset, domain, rjob, container = _k8s_parts(path)
    env = {e["name"]: e for e in container["env"]}
    values = {name: e["value"] for name, e in env.items() if "value" in e}
    processes = rjob["replicas"] * rjob["template"]["spec"]["parallelism"]
    gpus_per_pod = int(container["resources"]["limits"]["nvidia.com/gpu"])

    assert int(values["JAX_NUM_PROCESSES"]) == processes
    assert domain["spec"]["numNodes"] == processes
    name, subdomain = jobset["metadata"]["name"], jobset["spec"]["network"]["subdomain"]
    host, _, port = values["JAX_COORDINATOR_ADDRESS"].rpartition(":")
    assert host == f"{name}-{rjob['name']}-0-0.{subdomain}" and port.isdigit()
    assert values.get("JAX_LOCAL_DEVICE_IDS", ",".join(map(str, range(gpus_per_pod)))) == ",".join(
        map(str, range(gpus_per_pod))
    ), "the pod's one process drives all of its GPUs"

    # JAX_PROCESS_ID: evaluate the script's formula for every (job index, completion index).
    script = container["args"][0]
    (formula,) = re.findall(r"^[ \t]*export JAX_PROCESS_ID=.*$", script, re.M)
    assert (
        env["JOB_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.annotations['jobset.sigs.k8s.io/job-index']"
    )
    settings = "\n".join(f"{k}={v!r}" for k, v in values.items() if re.fullmatch(r"[A-Z_][A-Z0-9_]*", k))
    program = (
        f"{settings}\nfor JOB_INDEX in $(seq 0 {rjob['replicas'] - 1}); do"
        f" for JOB_COMPLETION_INDEX in $(seq 0 {rjob['template']['spec']['parallelism'] - 1}); do"
        f"\n{formula.strip()}\necho $JAX_PROCESS_ID; done; done"
    )
    ids = subprocess.run(["bash", "-c", program], capture_output=True, text=True, check=True).stdout.split()
    assert sorted(map(int, ids)) == list(range(processes))


@pytest.mark.parametrize("path", K8S, ids=lambda p: p.name)
def test_k8s_pods_claim_nvlink_and_shared_memory(path):
    jobset, domain, rjob, container = _k8s_parts(path)
    pod = rjob["template"]["spec"]["template"]["spec"]
    template_name = domain["spec"]["channel"]["resourceClaimTemplate"]["name"]
    claims = {c["name"]: c.get("resourceClaimTemplateName") for c in pod["resourceClaims"]}
    assert template_name in claims.values()
    assert {c["name"] for c in container["resources"]["claims"]} & set(claims)

    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert any(e["key"] == "nvidia.com/gpu.clique" for t in terms for e in t["matchExpressions"])
    assert jobset["metadata"]["annotations"]["alpha.jobset.sigs.k8s.io/exclusive-topology"] == "nvidia.com/gpu.clique"

    volumes = {v["name"]: v for v in pod["volumes"]}
    (shm,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert volumes[shm["name"]]["emptyDir"]["medium"] == "Memory"


# ---------------------------------------------------------------- CONFIG: a plan file, read by every recipe

# Between these two lines, the same block in every recipe (dedented: the manifests indent it).
_CONFIG_BLOCK = re.compile(r"^[ \t]*# ---- CONFIG \(optional\).*?^[ \t]*# ---- end of CONFIG ----\n", re.M | re.S)
_MAXTEXT_ARGS = 'read -r -a EXTRA_ARGS <<< "${MAXTEXT_ARGS:-}"'


def _script(path: Path) -> str:
    """The bash that launches the recipe: the sbatch file, or the training container's script."""
    if path.suffix == ".sbatch":
        return path.read_text()
    return _k8s_parts(path)[3]["args"][0]


def _config_block(script: str) -> str:
    match = _CONFIG_BLOCK.search(script)
    assert match, "no CONFIG block"
    return textwrap.dedent(match.group(0))


def _read_config(config: Path, *train_args: str) -> subprocess.CompletedProcess:
    """smoke.sbatch's CONFIG block run by bash on ``config`` after ``TRAIN_ARGS=(train_args)``; its
    stdout is the resulting TRAIN_ARGS, NUL-separated."""
    block = _config_block((REPO / "recipes" / "slurm" / "smoke.sbatch").read_text())
    words = " ".join(f"'{a}'" for a in train_args)
    program = f'set -euo pipefail\nTRAIN_ARGS=({words})\n{block}printf "%s\\0" "${{TRAIN_ARGS[@]}}"\n'
    env = {"PATH": os.environ["PATH"], "CONFIG": str(config)}
    return subprocess.run(["bash", "-c", program], env=env, capture_output=True, text=True)


@pytest.mark.parametrize("path", [*SBATCH, *K8S], ids=lambda p: p.name)
def test_recipe_reads_config_after_its_arguments_and_before_maxtext_args(path):
    """Every recipe has the same CONFIG block, after its TRAIN_ARGS and before MAXTEXT_ARGS, so
    that a plan's keys win over the recipe's and MAXTEXT_ARGS wins over both."""
    script = _script(path)
    block = _CONFIG_BLOCK.search(script)
    assert block and _config_block(script) == _config_block((REPO / "recipes" / "slurm" / "smoke.sbatch").read_text())
    train_args = re.search(r"^[ \t]*TRAIN_ARGS=\([ \t]*$.*?^[ \t]*\)[ \t]*$", script, re.M | re.S)
    assert train_args.end() < block.start() < block.end() <= script.index(_MAXTEXT_ARGS)
    assert script.index(_MAXTEXT_ARGS) < script.rindex("-m MaxText.train")


def test_config_block_turns_flat_lines_into_arguments(tmp_path):
    config = tmp_path / "plan.yml"
    config.write_text(
        "# a plan\n"
        "ici_fsdp_parallelism: 2   # a comment\n"
        "  # an indented comment\n"
        "\n"
        "dcn_data_parallelism: -1\n"
        "dataset_path: '/data/a b'\n"
        'run_name: "x#1"\n'
        'base_output_directory: "my # runs"  # a comment after quotes\n'
        "tokenizer_path: ''\n"
        "dataset_name: a#b\n"
        "learning_rate: 3.0e-4\r\n"
        "remat_policy: minimal"  # no newline at the end
    )
    result = _read_config(config, "model_name=deepseek3-tiny", "ici_fsdp_parallelism=1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\0")[:-1] == [
        "model_name=deepseek3-tiny",
        "ici_fsdp_parallelism=1",
        "ici_fsdp_parallelism=2",
        "dcn_data_parallelism=-1",
        "dataset_path=/data/a b",
        "run_name=x#1",
        "base_output_directory=my # runs",
        "tokenizer_path=",
        "dataset_name=a#b",
        "learning_rate=3.0e-4",
        "remat_policy=minimal",
    ]


@pytest.mark.parametrize(
    "text, line",
    [
        ("steps: 2\nlogical_axis_rules:\n  - [batch, data]\n", 2),  # a nested value
        ("steps: 2\n\nnum_experts: [8]\n", 3),  # a flow list
        ("steps:2\n", 1),  # YAML's plain scalar "steps:2", not a key
        ("- steps: 2\n", 1),
        ("steps: |\n  2\n", 1),
        ('run_name: "unbalanced\n', 1),
        ('run_name: "a\\"b"\n', 1),  # an escape: not read here
        ("steps: 2\nrun_name: value: more\n", 2),  # not YAML
        ("vocab_parallel_axes: []\n", 1),
    ],
    ids=["nested", "list", "no-space", "sequence", "block-scalar", "unbalanced", "escape", "colon", "empty-list"],
)
def test_config_block_refuses_what_is_not_flat(tmp_path, text, line):
    config = tmp_path / "bad.yml"
    config.write_text(text)
    result = _read_config(config, "steps=1")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith(f"error: CONFIG={config}, line {line}: not a flat 'key: value' line")
    missing = _read_config(tmp_path / "missing.yml")
    assert missing.returncode == 2 and missing.stderr == f"error: CONFIG={tmp_path / 'missing.yml'}: no such file\n"


def test_a_plan_read_by_a_recipe_is_the_plan_as_an_overlay(tmp_path):
    """tools/plan.py's --emit-config file, read by the recipes' block, gives the config that the
    same file gives as an overlay of python -m MaxText.train."""
    from tools import plan

    overlay = tmp_path / "plan.yml"
    plan.main(["model_name=deepseek3-tiny", "--system", "gb200-nvl72", "--gpus", "16", "--emit-config", str(overlay)])
    result = _read_config(overlay, "model_name=deepseek3-tiny", "run_name=t")
    assert result.returncode == 0, result.stderr
    args = result.stdout.split("\0")[:-1]
    assert len(args) == 2 + len(yaml.safe_load(overlay.read_text()))
    as_arguments = load_config(args)
    as_overlay = load_config(["model_name=deepseek3-tiny", "run_name=t", str(overlay)])
    assert as_arguments == as_overlay
    assert math.prod(mesh_shape(as_arguments, 16)[0]) * math.prod(mesh_shape(as_arguments, 16)[1]) == 16


# ---------------------------------------------------------------- parameter shardings

RECIPES = [*GPU_SBATCH, *K8S]
# Keys that place the run, build the mesh or map logical axes onto it; the boxed parameter tree (shapes
# and logical axis names) does not depend on them.
_NOT_MODEL_KEYS = {"run_name", "base_output_directory", "logical_axis_rules"} | {
    parallelism_key(part, axis) for part in ("ici", "dcn") for axis in MESH_AXES
}
_ABSTRACT_VARIABLES: dict[str, dict] = {}


def _recipe_layout(path: Path) -> tuple[Config, int]:
    """The recipe's config and GPU count."""
    if path.suffix == ".sbatch":
        text = path.read_text()
        return load_config(_train_args(text)), _sbatch_gpus(_sbatch_options(text))
    _, _, rjob, container = _k8s_parts(path)
    return load_config(_train_args(container["args"][0])), _k8s_gpus(rjob, container)


def _axis_sizes(config: Config, gpus: int) -> dict[str, int]:
    dcn, ici = mesh_shape(config, gpus)
    return {axis: d * i for axis, d, i in zip(MESH_AXES, dcn, ici, strict=True)}


def _abstract_variables(config: Config) -> dict:
    """The boxed (logically partitioned) abstract variables the train state shards: shapes only, no
    allocation. Computed once per model, since the 671B tree takes a second or two."""
    key = config.model_dump_json(exclude=_NOT_MODEL_KEYS)
    if key not in _ABSTRACT_VARIABLES:
        config = config.with_platform("cpu")
        variables = jax.eval_shape(DeepSeekV3(config).init, jax.random.key(0), *dummy_inputs(config))
        _ABSTRACT_VARIABLES[key] = {"params": variables["params"], BIAS: variables.get(BIAS, {})}
    return _ABSTRACT_VARIABLES[key]


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_splits_divide_every_parameter(path):
    """JAX refuses a sharding whose split does not divide its dim when the train state is created."""
    config, gpus = _recipe_layout(path)
    check_splits(_abstract_variables(config), _axis_sizes(config, gpus), config)


def _latents_over_fsdp_and_expert(config: Config) -> Config:
    """The earlier rules, which split the MLA latent dims (q_lora, kv_lora) over fsdp x expert."""
    rules = [
        (name, ["fsdp", "expert"] if name in ("q_lora", "kv_lora") else axes)
        for name, axes in config.logical_axis_rules
    ]
    return config.model_copy(update={"logical_axis_rules": rules})


@pytest.mark.parametrize(
    ("earlier_rules", "axis_sizes", "message"),
    [
        # The GB300 layout under the earlier rules: kv_lora (512) of wkv_b split 1,024 ways.
        (
            True,
            {"data": 1, "fsdp": 16, "expert": 64, "tensor": 1},
            r"wkv_b.*1024 ways over \('fsdp', 'expert'\) \(dim 512\)",
        ),
        (False, {"data": 1, "fsdp": 1024, "expert": 1, "tensor": 1}, r"wkv_b.*1024 ways over fsdp \(dim 512\)"),
        (False, {"data": 1, "fsdp": 4, "expert": 1, "tensor": 256}, r"wkv_b.*256 ways over tensor \(dim 128\)"),
    ],
    ids=["earlier-rules-gb300", "fsdp-1024", "tensor-256"],
)
def test_split_check_rejects_a_split_that_does_not_divide(earlier_rules, axis_sizes, message):
    config, _ = _recipe_layout(REPO / "recipes" / "k8s" / "deepseek3-671b-gb300-nvl72.yaml")
    if earlier_rules:
        config = _latents_over_fsdp_and_expert(config)
    with pytest.raises(ConfigError, match=message):
        check_splits(_abstract_variables(config), axis_sizes, config)


# ---------------------------------------------------------------- images and requirements


def _requirements(name: str) -> list[str]:
    lines = [line.split("#")[0].strip() for line in (REPO / name).read_text().splitlines()]
    return [line for line in lines if line]


def test_gpu_requirements_extend_the_cpu_set():
    """The image's set is the CPU set, the CUDA jax at the CPU set's version, and Transformer Engine."""
    cpu = (REPO / "requirements.txt").read_text()
    gpu = _requirements("requirements-gpu.txt")
    jax_version = re.search(r"^jax==(\S+)$", cpu, re.M).group(1)
    assert gpu[:2] == ["-r requirements.txt", "-r requirements-cuda.txt"]
    assert f"jax[cuda13]=={jax_version}" in _requirements("requirements-cuda.txt")
    assert any(re.fullmatch(r"transformer-engine\[[\w,]*\bjax\b[\w,]*\]==2\.20\.2", line) for line in gpu)
    assert not re.search(r"transformer.engine", cpu, re.I), "Transformer Engine cannot install without CUDA"


def test_gpu_image_builds_transformer_engine_without_build_isolation():
    dockerfile = (REPO / "docker" / "Dockerfile.gpu").read_text()
    assert re.search(
        r"pip install --no-build-isolation --require-hashes --no-deps -r \S*requirements-gpu\.lock", dockerfile
    )
    assert "COPY . /workspace" in dockerfile


@pytest.mark.parametrize(
    "path",
    [*SBATCH, *K8S, REPO / "docker" / "Dockerfile.gpu", REPO / "docker" / "Dockerfile.cpu"],
    ids=lambda p: p.name,
)
def test_no_cuda_device_max_connections(path):
    """Serialising kernel launches onto one hardware queue hurts Blackwell; it must not be set."""
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in path.read_text()


_RUN_BLOCK = re.compile(r"^# ---- run, and restart on a failure.*?^# ---- end of run ----\n", re.M | re.S)


def test_every_slurm_recipe_restarts_a_failed_run_the_same_way():
    """One run block in every Slurm recipe, at its end: any task's death ends the step
    (--kill-on-bad-exit) and the run starts again in the allocation; the job asks Slurm to requeue
    it when a node failure ends the allocation."""
    blocks = set()
    for path in SBATCH:
        text = path.read_text()
        block = _RUN_BLOCK.search(text)
        assert block and text.endswith(block.group(0)), path.name
        assert re.search(r"^#SBATCH --requeue$", text, re.M), path.name
        assert "srun --kill-on-bad-exit=1 " in block.group(0), path.name
        blocks.add(block.group(0))
    assert len(blocks) == 1
