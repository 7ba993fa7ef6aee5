"""Compile the real train step for a cluster's mesh and report XLA's memory, FLOPs and collectives per GPU.

For a GPU target the report also says how much communication its schedule hides, and the tool exits
1 if the step does not fit the share of HBM JAX's allocator takes; it exits 2 for a config or choice
that cannot be compiled. (XLA:CPU's figure is an upper bound: past the HBM it is reported, not failed.)

    python tools/aot_compile.py --target gb200 --recipe recipes/slurm/deepseek3-671b-gb200-nvl72.sbatch
    python tools/aot_compile.py --recipe recipes/slurm/deepseek3-671b-gb200-nvl72.sbatch   # XLA:CPU
    python tools/aot_compile.py model_name=deepseek3-671b dtype=bfloat16 ici_expert_parallelism=16 --devices 64
    python tools/aot_compile.py my_run.yml key=value --devices 256 --target h100 --json

Without ``--target`` the step compiles for simulated CPU devices (XLA:CPU). With ``--target``
(gb200, gb300, b200, h200, h100) XLA:GPU compiles it for that GPU and the cluster's NVLink
domains, on this machine, without a GPU (JAX's CUDA plugin: ``make gpu-compile-deps``); a
recipe's ``XLA_FLAGS`` apply, then the environment's ``XLA_FLAGS`` on top.

Arguments other than the flags are config arguments, as for training (``[extra.yml ...] key=value``),
appended after a recipe's own. ``--recipe`` reads the ``TRAIN_ARGS`` of a Slurm script or of a
Kubernetes manifest's container script, its ``XLA_FLAG_LIST``, and the device count from it (nodes
x tasks per node, or replicas x pods x GPUs per pod); shell variables in it become harmless
placeholders (their ``${VAR:-default}`` when given). The logic is in ``MaxText/aot/``; nothing is
allocated.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

from MaxText.aot.targets import TARGETS  # noqa: E402  (imports no JAX: XLA_FLAGS are set below first)
from MaxText.train.xla_memory import JAX_MEMORY_FRACTION, MEMORY_FRACTION_VARIABLES, memory_fraction  # noqa: E402

WARNING_PATTERN = "Involuntary full rematerialization"
# XLA:CPU by default orders a program for thread concurrency, keeping more buffers alive at once
# (the 4-layer 671B case: 43.2 GB of temp against 38.8); a GPU's latency-hiding scheduler works to
# the device's memory limit. The memory-minimising order is the closer model of a GPU's peak.
MEMORY_SCHEDULER = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
# XLA:CPU's pass that widens bfloat16 all-reduces to float32 aborts ("Invalid binary instruction
# opcode copy") on the pipeline's all-reduces over its stage axis (their reduction computation ends
# in a copy). Only the compile is wanted here, so a pipelined compile leaves the pass out: its
# all-reduces stay bfloat16 (XLA:CPU's other figures move their bfloat16 collectives as float32).
NO_ALL_REDUCE_PROMOTION = "--xla_disable_hlo_passes=all-reduce-promotion"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "config",
        nargs="*",
        help="Config arguments as for training ([extra.yml ...] key=value ...), after a recipe's own.",
    )
    parser.add_argument(
        "--recipe",
        type=Path,
        help="A recipes/slurm/*.sbatch or recipes/k8s/*.yaml file: its training arguments, XLA flags and GPU count.",
    )
    parser.add_argument("--devices", type=int, default=0, help="Devices to compile for (default: the recipe's GPUs).")
    parser.add_argument(
        "--target",
        choices=sorted(TARGETS),
        help="Compile with XLA:GPU for this GPU (default: XLA:CPU on simulated devices).",
    )
    parser.add_argument(
        "--device-kind",
        help="GB200, GB300, B200, H200 or H100: the GPU whose HBM is the limit "
        "(default: the target's, else the one the recipe's file name names).",
    )
    parser.add_argument(
        "--hbm-gb", type=float, help="HBM per device in GB, the limit as given (overrides --device-kind)."
    )
    parser.add_argument("--json", action="store_true", help="Print one JSON object instead of the report.")
    parser.add_argument("--dump-hlo", type=Path, help="Also write the optimized HLO text to this file.")
    args = parser.parse_args(argv)
    if not args.devices and not args.recipe:
        parser.error("give --devices N or --recipe PATH")
    return args


def _expand(text: str) -> str:
    """``${VAR:-default}`` -> default, ``${VAR}`` / ``$VAR`` -> a placeholder."""
    text = re.sub(r"\$\{(\w+):-([^}]*)\}", r"\2", text)
    return re.sub(r"\$\{?(\w+)\}?", lambda m: f"placeholder-{m.group(1).lower()}", text)


def _bash_array(script: str, name: str) -> list[str] | None:
    m = re.search(rf"{name}=\((.*?)^\s*\)", script, re.S | re.M)
    if not m:
        return None
    body = "\n".join(line.split(" #")[0] for line in m.group(1).splitlines() if not line.strip().startswith("#"))
    return shlex.split(_expand(body))


def _train_args(script: str) -> list[str]:
    args = _bash_array(script, "TRAIN_ARGS")
    if args is None:
        raise SystemExit("error: no TRAIN_ARGS=( ... ) array in the recipe")
    return args


class Recipe(NamedTuple):
    args: list[str]  # the training arguments (TRAIN_ARGS)
    devices: int  # GPUs
    xla_flags: list[str]  # the XLA_FLAGS the job runs with
    memory_fraction: float  # XLA_(PYTHON_)CLIENT_MEM_FRACTION: the share of HBM JAX's allocator takes


def read_recipe(path: Path) -> Recipe:
    """A Slurm script's or a Kubernetes JobSet manifest's training arguments, GPU count, XLA flags
    and JAX memory fraction."""
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        import yaml

        for doc in yaml.safe_load_all(text):
            if doc and doc.get("kind") == "JobSet":
                job = doc["spec"]["replicatedJobs"][0]
                pod = job["template"]["spec"]["template"]["spec"]
                container = pod["containers"][0]
                gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
                devices = job.get("replicas", 1) * job["template"]["spec"].get("parallelism", 1) * gpus
                env = {e["name"]: str(e.get("value", "")) for e in container.get("env", [])}
                fraction = memory_fraction(env)
                args = _train_args("\n".join(container.get("args", [])))
                return Recipe(args, devices, env.get("XLA_FLAGS", "").split(), fraction)
        raise SystemExit(f"error: no JobSet in {path}")
    sbatch = dict(re.findall(r"^#SBATCH\s+--([\w-]+)=(\S+)", text, re.M))
    devices = int(sbatch.get("nodes", 1)) * int(sbatch.get("ntasks-per-node", 1)) * int(sbatch.get("gpus-per-task", 1))
    exports = dict(re.findall(r"^export (\w+)=([\d.]+)\s*$", text, re.M))
    fraction = memory_fraction({k: v for k, v in exports.items() if k in MEMORY_FRACTION_VARIABLES})
    return Recipe(_train_args(text), devices, _bash_array(text, "XLA_FLAG_LIST") or [], fraction)


class CaptureStderr:
    """Copy what C++ writes to file descriptor 2 (XLA's warnings) while still showing it."""

    def __enter__(self):
        sys.stderr.flush()
        self.file = tempfile.TemporaryFile(mode="w+b")
        self.saved = os.dup(2)
        os.dup2(self.file.fileno(), 2)
        return self

    def __exit__(self, *exc):
        sys.stderr.flush()
        os.dup2(self.saved, 2)
        os.close(self.saved)
        self.file.seek(0)
        self.text = self.file.read().decode(errors="replace")
        sys.stderr.write(self.text)
        return False


def _set_xla_flags(recipe_flags: list[str], devices: int, target: str | None, pipelined: bool = False) -> None:
    """XLA_FLAGS for the compile, set before JAX starts: the recipe's GPU flags (a GPU target) or
    the simulated device count and the memory-minimising schedule (XLA:CPU; pipelined, without the
    all-reduce promotion), then the user's."""
    user = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")).split()
    if target:
        flags = recipe_flags + user
    else:
        flags = user + ([] if any("concurrency_optimized_scheduler" in f for f in user) else [MEMORY_SCHEDULER])
        flags += [NO_ALL_REDUCE_PROMOTION] if pipelined else []
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    os.environ["XLA_FLAGS"] = " ".join(flags)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    config_args, devices, recipe_name = list(args.config), args.devices, ""
    recipe = Recipe([], 0, [], JAX_MEMORY_FRACTION)
    if args.recipe:
        recipe = read_recipe(args.recipe)
        config_args, devices, recipe_name = recipe.args + config_args, args.devices or recipe.devices, args.recipe.name
    from MaxText.config import ConfigError, load_config_or_exit  # imports no JAX

    config = load_config_or_exit(config_args)
    os.environ["JAX_PLATFORMS"] = "cpu"  # a GPU target's plugin must not probe for a GPU
    _set_xla_flags(recipe.xla_flags, devices, args.target, config.pipeline_stages > 1)

    from MaxText.aot.compile import compile_train_step
    from MaxText.aot.report import format_report
    from MaxText.train.metrics import hbm_gb

    target = compile_devices = None
    if args.target:
        from MaxText.aot.targets import compile_devices_or_error

        target = TARGETS[args.target]
        compile_devices, problem = compile_devices_or_error(target, devices)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
    hbm = args.hbm_gb or hbm_gb(args.device_kind or (target.description if target else recipe_name))
    # XLA:GPU's program must fit what JAX's allocator takes; XLA:CPU's figures are an upper bound
    # of a GPU's and are held against the whole HBM.
    limit = hbm * recipe.memory_fraction if hbm and target and not args.hbm_gb else hbm
    try:
        with CaptureStderr() as captured:
            report, compiled = compile_train_step(config, compile_devices, target, recipe.memory_fraction)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.dump_hlo:
        args.dump_hlo.write_text(compiled.as_text())
    report.warnings = [line.strip() for line in captured.text.splitlines() if WARNING_PATTERN in line]
    if args.json:
        print(json.dumps({**report.as_dict(), "hbm_gb": hbm, "limit_gb": limit}))
    else:
        print(format_report(report, hbm, limit))
    total_gb = report.memory["total"] / 1e9
    if limit and total_gb > limit and target:
        print(f"does not fit: {total_gb:.1f} GB per device > {limit:.0f} GB (of {hbm:.0f} GB of HBM)", file=sys.stderr)
        return 1
    if limit and total_gb > limit:  # an upper bound past the HBM says nothing for sure: the GPU's figure does
        print(
            f"XLA:CPU's upper bound, {total_gb:.1f} GB per device, exceeds {limit:.0f} GB of HBM (float32 copies "
            "of bfloat16 buffers, all-reduces for reduce-scatters); the GPU's own figure: --target",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
