"""Compile the real train step for a cluster's mesh on simulated CPU devices and report, per GPU,
XLA's memory, FLOPs and collectives; exit 1 if it does not fit the device's HBM.

    python tools/aot_compile.py --recipe recipes/slurm/deepseek3-671b-gb200-nvl72.sbatch
    python tools/aot_compile.py model_name=deepseek3-671b dtype=bfloat16 ici_expert_parallelism=16 --devices 64
    python tools/aot_compile.py my_run.yml key=value --devices 256 --device-kind GB200 --json

Arguments other than the flags are config arguments, as for training (``[extra.yml ...] key=value``),
appended after a recipe's own. ``--recipe`` reads the ``TRAIN_ARGS`` of a Slurm script or of a
Kubernetes manifest's container script, and the device count from it (nodes x tasks per node, or
replicas x pods x GPUs per pod); shell variables in it become harmless placeholders (their
``${VAR:-default}`` when given). The logic is in ``MaxText/train/aot.py``; nothing is allocated.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable as a script from anywhere

WARNING_PATTERN = "Involuntary full rematerialization"
# XLA:CPU by default orders a program for thread concurrency, keeping more buffers alive at once
# (the 4-layer 671B case: 43.2 GB of temp against 38.8); a GPU's latency-hiding scheduler works to
# the device's memory limit. The memory-minimising order is the closer model of a GPU's peak.
MEMORY_SCHEDULER = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="*", help="[extra.yml ...] key=value ... (as for training)")
    parser.add_argument("--recipe", type=Path, help="a recipes/slurm/*.sbatch or recipes/k8s/*.yaml file")
    parser.add_argument("--devices", type=int, default=0, help="simulated devices (default: the recipe's GPUs)")
    parser.add_argument("--device-kind", help="GB200, GB300, B200, H200, H100: its HBM is the limit")
    parser.add_argument("--hbm-gb", type=float, help="HBM per device in GB (overrides --device-kind)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    parser.add_argument("--dump-hlo", type=Path, help="also write the optimized HLO text to this file")
    args = parser.parse_args(argv)
    if not args.devices and not args.recipe:
        parser.error("give --devices N or --recipe PATH")
    return args


def _expand(text: str) -> str:
    """``${VAR:-default}`` -> default, ``${VAR}`` / ``$VAR`` -> a placeholder."""
    text = re.sub(r"\$\{(\w+):-([^}]*)\}", r"\2", text)
    return re.sub(r"\$\{?(\w+)\}?", lambda m: f"placeholder-{m.group(1).lower()}", text)


def _train_args(script: str) -> list[str]:
    m = re.search(r"TRAIN_ARGS=\((.*?)^\s*\)", script, re.S | re.M)
    if not m:
        raise SystemExit("error: no TRAIN_ARGS=( ... ) array in the recipe")
    body = "\n".join(line.split(" #")[0] for line in m.group(1).splitlines() if not line.strip().startswith("#"))
    return shlex.split(_expand(body))


def read_recipe(path: Path) -> tuple[list[str], int]:
    """(training arguments, GPU count) of a Slurm script or a Kubernetes JobSet manifest."""
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
                return _train_args("\n".join(container.get("args", []))), devices
        raise SystemExit(f"error: no JobSet in {path}")
    sbatch = dict(re.findall(r"^#SBATCH\s+--([\w-]+)=(\S+)", text, re.M))
    devices = int(sbatch.get("nodes", 1)) * int(sbatch.get("ntasks-per-node", 1)) * int(sbatch.get("gpus-per-task", 1))
    return _train_args(text), devices


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


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    config_args, devices, recipe_name = list(args.config), args.devices, ""
    if args.recipe:
        recipe_args, recipe_devices = read_recipe(args.recipe)
        config_args, devices, recipe_name = recipe_args + config_args, args.devices or recipe_devices, args.recipe.name
    os.environ["JAX_PLATFORMS"] = "cpu"
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    if "concurrency_optimized_scheduler" not in flags:
        flags += f" {MEMORY_SCHEDULER}"
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()

    from MaxText.config import ConfigError, load_config_or_exit
    from MaxText.train.aot import compile_train_step, format_report
    from MaxText.train.metrics import hbm_gb

    config = load_config_or_exit(config_args)
    limit = args.hbm_gb or hbm_gb(args.device_kind or recipe_name)
    try:
        with CaptureStderr() as captured:
            report, compiled = compile_train_step(config, devices)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.dump_hlo:
        args.dump_hlo.write_text(compiled.as_text())
    report.warnings = [line.strip() for line in captured.text.splitlines() if WARNING_PATTERN in line]
    if args.json:
        print(json.dumps({**report.as_dict(), "hbm_gb": limit}))
    else:
        print(format_report(report, limit))
    total_gb = report.memory["total"] / 1e9
    if limit and total_gb > limit:
        print(f"does not fit: {total_gb:.1f} GB per device > {limit:.0f} GB of HBM", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
