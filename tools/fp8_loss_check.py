"""FP8 training against its unquantized baseline on the same batches: the report's criterion.

DeepSeek-V3 (report 3.3, appendix B) holds FP8 training to a relative loss error under 0.25%
of BF16. This trains one model once per recipe (``quantization=none`` first, the baseline), with
the same seed, data and settings, and compares the mean loss over the last ``--window`` logged
steps of each FP8 run with the baseline's; it also reports the experts' balance at the end
(``expert_load_max_over_mean``), draws the curves and their relative difference, and exits 1
when a recipe misses the criterion.

    python tools/fp8_loss_check.py --model deepseek3-tiny --steps 200 [key=value ...]

On CPU the FP8 GEMMs are emulated (exact numerics, float32 accumulation) and the baseline runs
in the CPU's default dtype, float32; pass ``dtype=bfloat16`` for a bfloat16 baseline.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
BASELINE = "none"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="deepseek3-tiny")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--window", type=int, default=20, help="logged steps averaged at the end")
    parser.add_argument("--recipes", default="fp8_blockwise,mxfp8")
    parser.add_argument("--threshold", type=float, default=0.0025, help="relative loss error allowed")
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "fp8_loss_check")
    parser.add_argument("overrides", nargs="*", help="key=value for every run")
    args = parser.parse_args(argv)
    if args.steps < args.window:
        parser.error(f"--steps ({args.steps}) must be at least --window ({args.window})")
    return args


def train(args: argparse.Namespace, recipe: str) -> list[dict]:
    """One run; its metrics records."""
    run = f"{args.model}-{recipe}"
    keys = [
        f"model_name={args.model}",
        f"steps={args.steps}",
        "log_period=1",
        "enable_checkpointing=false",
        f"quantization={recipe}",
        f"run_name={run}",
        f"base_output_directory={args.out}",
        *args.overrides,
    ]
    print(f"training {run} ...", flush=True)
    done = subprocess.run([sys.executable, "-m", "MaxText.train", *keys], cwd=REPO)
    if done.returncode:
        sys.exit(done.returncode)
    lines = (args.out / run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r and "step" in r]


def compare(baseline: list[dict], run: list[dict], window: int) -> dict[str, float]:
    base, ours = (np.array([r["loss"] for r in records[-window:]]) for records in (baseline, run))
    return {
        "mean_loss": float(ours.mean()),
        "relative_error": float(abs(ours.mean() - base.mean()) / base.mean()),
        "max_step_relative_error": float(np.max(np.abs(ours - base) / base)),
        "expert_load_max_over_mean": float(run[-1].get("expert_load_max_over_mean", float("nan"))),
    }


def plot(runs: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    base = np.array([r["loss"] for r in runs[BASELINE]])
    for name, records in runs.items():
        steps, loss = np.array([r["step"] for r in records]), np.array([r["loss"] for r in records])
        top.plot(steps, loss, label=name, lw=1)
        if name != BASELINE:
            bottom.plot(steps, 100 * (loss - base) / base, label=name, lw=1)
    bottom.axhspan(-0.25, 0.25, color="0.9", label="+-0.25%")
    top.set_ylabel("loss")
    bottom.set_ylabel("vs baseline (%)")
    bottom.set_xlabel("step")
    top.legend()
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    recipes = [r for r in args.recipes.split(",") if r]
    runs = {name: train(args, name) for name in [BASELINE, *recipes]}
    print(f"\n{args.model}, {args.steps} steps, mean loss over the last {args.window} logged steps")
    base = float(np.mean([r["loss"] for r in runs[BASELINE][-args.window :]]))
    print(f"{'run':16s} {'mean loss':>10s} {'rel. error':>11s} {'max step':>9s} {'load max/mean':>14s}")
    load = runs[BASELINE][-1].get("expert_load_max_over_mean", float("nan"))
    print(f"{BASELINE:16s} {base:10.4f} {'':>11s} {'':>9s} {load:14.2f}")
    failed = []
    for name in recipes:
        r = compare(runs[BASELINE], runs[name], args.window)
        print(
            f"{name:16s} {r['mean_loss']:10.4f} {100 * r['relative_error']:10.3f}% "
            f"{100 * r['max_step_relative_error']:8.2f}% {r['expert_load_max_over_mean']:14.2f}"
        )
        if r["relative_error"] > args.threshold:
            failed.append(name)
    figure = args.out / f"{args.model}-fp8_loss.png"
    plot(runs, figure)
    print(f"plot: {figure}")
    if failed:
        print(f"over {100 * args.threshold:.2f}%: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
