"""What checkpoints cost the 671B recipes and what failures take from them, with one tier or two.

One persistent tier against the node-local tier beside it (MaxText/planner/checkpoints.py,
docs/checkpointing.md).

    python tools/checkpoint_cost.py                                  # both 671B recipes
    python tools/checkpoint_cost.py --shared-write-gbps 400 --local-write-gbps 50 --json

Per recipe: the train state's bytes (the repository's accounting of the recipe's model and
dtypes), its data-parallel replicas (the recipe's mesh), the step (the planner's ``xla`` stack's
compiled figure for the recipe: MaxText/planner/calibration.py) and the GPUs per node (the
planner's system). The storage bandwidths and the restart time are assumptions the flags state;
the failure rate is the Llama 3 paper's, scaled to the GPU count. Periods are Young's optimum in
whole steps (raised to the write time where that is longer) unless given.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the recipe reader of tools/aot_compile.py

from MaxText.config import load_config  # noqa: E402
from MaxText.models.accounting import memory_estimate  # noqa: E402
from MaxText.parallel.axes import MESH_AXES  # noqa: E402
from MaxText.parallel.mesh import mesh_shape  # noqa: E402
from MaxText.planner import checkpoints  # noqa: E402
from MaxText.planner.calibration import RECIPE_STEP_SECONDS  # noqa: E402
from MaxText.planner.systems import SYSTEMS  # noqa: E402
from tools.aot_compile import read_recipe  # noqa: E402

RECIPES = {  # recipe file -> the planner's system
    "recipes/slurm/deepseek3-671b-gb200-nvl72.sbatch": "gb200-nvl72",
    "recipes/k8s/deepseek3-671b-gb300-nvl72.yaml": "gb300-nvl72",
}
GB = 1e9


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--shared-write-gbps",
        type=float,
        default=50.0,
        help="Shared filesystem, aggregate GB/s written (default: %(default)s).",
    )
    p.add_argument(
        "--shared-read-gbps",
        type=float,
        default=100.0,
        help="Shared filesystem, aggregate GB/s read (default: %(default)s).",
    )
    p.add_argument(
        "--local-write-gbps",
        type=float,
        default=10.0,
        help="One node's local NVMe, GB/s written (default: %(default)s).",
    )
    p.add_argument(
        "--local-read-gbps", type=float, default=20.0, help="One node's local NVMe, GB/s read (default: %(default)s)."
    )
    p.add_argument(
        "--host-copy-gbps",
        type=float,
        default=100.0,
        help="One GPU's device-to-host copy, GB/s (default: %(default)s).",
    )
    p.add_argument(
        "--shared-share",
        type=float,
        default=0.1,
        help="Share of the shared filesystem's time the job's writes may take (default: %(default)s).",
    )
    p.add_argument(
        "--restart-minutes",
        type=float,
        default=5.0,
        help="A failed job back to its first step, restore aside (default: %(default)s).",
    )
    p.add_argument("--persistent-period", type=int, help="Steps between persistent saves (default: Young's optimum).")
    p.add_argument("--local-period", type=int, help="Steps between node-local saves (default: Young's optimum).")
    p.add_argument("--json", action="store_true", help="Print one JSON object instead of the table.")
    args = p.parse_args(argv)
    for name in ("shared_write_gbps", "shared_read_gbps", "local_write_gbps", "local_read_gbps", "host_copy_gbps"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    if not 0 < args.shared_share <= 1:
        p.error("--shared-share must be in (0, 1]")
    for name in ("persistent_period", "local_period"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def recipe_run(path: str, system_name: str) -> checkpoints.Run:
    recipe = read_recipe(ROOT / path)
    config = load_config([*recipe.args, "run_name=checkpoint-cost"]).with_platform("gpu")
    memory = memory_estimate(config)
    dcn, ici = mesh_shape(config, recipe.devices)
    data = MESH_AXES.index("data")
    step = RECIPE_STEP_SECONDS[system_name]  # the recipe's own compile
    return checkpoints.Run(
        gpus=recipe.devices,
        gpus_per_node=SYSTEMS[system_name].node_gpus,
        replicas=dcn[data] * ici[data],
        state_bytes=memory.weights + memory.optimizer,
        step_seconds=step,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    storage = checkpoints.Storage(
        args.shared_write_gbps * GB,
        args.shared_read_gbps * GB,
        args.local_write_gbps * GB,
        args.local_read_gbps * GB,
        args.host_copy_gbps * GB,
        args.restart_minutes * 60,
        args.shared_share,
    )
    results = {}
    for path, system in RECIPES.items():
        run = recipe_run(path, system)
        persistent = checkpoints.persistent_tier(run, storage, args.persistent_period)
        local = checkpoints.local_tier(run, storage, copies=run.replicas == 1, period_steps=args.local_period)
        results[path] = {
            "run": asdict(run),
            "one tier": asdict(checkpoints.plan(run, storage, [persistent])),
            "two tiers": asdict(checkpoints.plan(run, storage, [persistent, local])),
        }
    if args.json:
        print(json.dumps(results))
        return 0
    rate = checkpoints.FAILURES_PER_GPU_HOUR
    print(f"failures: {rate * 1e6:.1f} per million GPU-hours (Llama 3), one per {1 / rate:,.0f} GPU-hours")
    for path, r in results.items():
        run = r["run"]
        per_gpu = run["state_bytes"] * run["replicas"] / run["gpus"] / GB
        print(
            f"\n{path}: {run['gpus']} GPUs, state {run['state_bytes'] / 1e12:.2f} TB ({per_gpu:.1f} GB per GPU), "
            f"{run['replicas']} replicas, step {run['step_seconds']:.2f} s, a failure every {1 / (checkpoints.FAILURES_PER_GPU_HOUR * run['gpus']):.0f} h"
        )
        print(
            f"  {'':10s} {'tier':10s} {'period':>7s} {'write':>8s} {'blocks':>7s} {'restore':>8s} {'overhead':>9s} {'lost/failure':>13s} {'goodput':>8s}"
        )
        for name in ("one tier", "two tiers"):
            p = r[name]
            for i, t in enumerate(p["tiers"]):
                tail = (
                    f"{p['overhead']:9.2%} {p['lost_per_failure_seconds'] / 60:10.1f} min {p['goodput']:8.2%}"
                    if i == 0
                    else ""
                )
                print(
                    f"  {name if i == 0 else '':10s} {t['name']:10s} {t['period_steps']:7d} {t['write_seconds']:7.1f}s "
                    f"{t['blocking_seconds']:6.2f}s {t['restore_seconds']:7.1f}s {tail}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
