"""FP8 training against its unquantized baseline on the same batches: the report's criterion.

DeepSeek-V3 (report 3.3, appendix B) holds FP8 training to a relative loss error under 0.25%
of BF16. This trains one model per seed once per recipe (``quantization=none`` first, the
baseline), with the same data and settings, and compares the mean loss over the last
``--window`` logged steps of each FP8 run with its seed's baseline. It also trains a control:
the baseline with one setting changed that changes no formula, only the order of float32 sums
(``--control``, by default the routed experts through ``ragged_dot`` instead of ``blocked``). A
small model's trajectory amplifies any rounding difference; the control's error is that noise
floor, measured the same way, and the criterion is judged on the mean over seeds. It reports the
experts' balance at the end (``expert_load_max_over_mean``), the standard error of each mean over
seeds, draws the curves and their relative difference, and exits 1 when a recipe's mean misses the criterion.

    python tools/fp8_loss_check.py --model deepseek3-tiny --steps 200 --seeds 0,1,2 [--jobs N] [key=value ...]

On CPU the FP8 GEMMs are emulated (exact numerics, float32 accumulation) and the baseline runs
in the CPU's default dtype, float32; pass ``dtype=bfloat16`` for a bfloat16 baseline. On a GPU
the baseline is bfloat16, as the report measures. ``--jobs`` trains that many runs at once (a
small model leaves most of a GPU idle; each run then gets its share of the GPU's memory and
writes its output to ``<run>.log``).
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
BASELINE, CONTROL = "none", "control"
RUNNING: set[subprocess.Popen] = set()  # the training runs under way, stopped with this tool
LOCK = threading.Lock()  # guards RUNNING and STOPPING together: no run starts once stopping began
STOPPING = threading.Event()


def stop_all() -> None:
    """Start no more runs and stop those under way (SIGTERM, then SIGKILL after 30 s), so that none
    keeps its devices."""
    with LOCK:
        STOPPING.set()
        runs = list(RUNNING)
    for run in runs:
        run.terminate()
    for run in runs:
        try:
            run.wait(timeout=30)
        except subprocess.TimeoutExpired:
            run.kill()


def stop_runs(signum: int, _frame) -> None:
    """Stopped (a time limit's SIGTERM, Ctrl-C): stop the runs too."""
    stop_all()
    sys.exit(128 + signum)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="deepseek3-tiny", help="The model_name every run trains (default: %(default)s)."
    )
    parser.add_argument("--steps", type=int, default=200, help="Training steps of every run (default: %(default)s).")
    parser.add_argument(
        "--window",
        type=int,
        default=20,
        help="Logged steps at the end whose mean loss is compared (default: %(default)s).",
    )
    parser.add_argument(
        "--recipes", default="fp8_blockwise,mxfp8", help="Comma-separated FP8 recipes to check (default: %(default)s)."
    )
    parser.add_argument(
        "--seeds", default="0", help="Comma-separated seeds; the criterion takes their mean (default: %(default)s)."
    )
    parser.add_argument(
        "--control",
        default="moe_matmul=ragged_dot",
        help="The key=value setting of the noise-floor run, '' for none (default: %(default)s).",
    )
    parser.add_argument(
        "--threshold", type=float, default=0.0025, help="Relative loss error allowed (default: %(default)s)."
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="Runs trained at once, each with its share of the GPU's memory (default: %(default)s).",
    )
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="Keep a run in --out trained with the same keys to --steps instead of training it again.",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO / "outputs" / "fp8_loss_check",
        help="Folder for the runs and the plot (default: outputs/fp8_loss_check in the repository).",
    )
    parser.add_argument("overrides", nargs="*", help="Config key=value arguments for every run.")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    if args.steps < args.window:
        parser.error(f"--steps ({args.steps}) must be at least --window ({args.window})")
    try:
        args.seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        parser.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
    if args.control and "=" not in args.control:
        parser.error(f"--control must be key=value, got {args.control!r}")
    return args


def read_metrics(path: Path) -> list[dict]:
    """The logged training steps of a run's metrics.jsonl (none if it does not exist)."""
    if not path.exists():
        return []
    records = map(json.loads, path.read_text().splitlines())
    return [r for r in records if "loss" in r and "step" in r and "event" not in r]  # events: a rollback, goodput


def run_name(args: argparse.Namespace, name: str, seed: int) -> str:
    return f"{args.model}-{name}-seed{seed}"


def run_keys(args: argparse.Namespace, name: str, seed: int) -> list[str]:
    """What makes a run what it is (the config keys but its output folder): a reused run must
    have been trained with these."""
    return [
        f"model_name={args.model}",
        f"steps={args.steps}",
        "log_period=1",
        "enable_checkpointing=false",
        f"seed={seed}",
        f"quantization={BASELINE if name == CONTROL else name}",
        f"run_name={run_name(args, name, seed)}",
        *args.overrides,
        *([args.control] if name == CONTROL else []),
    ]


def train(args: argparse.Namespace, name: str, seed: int) -> list[dict]:
    """One run (``name``: a recipe, the baseline or the control); its metrics records."""
    run = run_name(args, name, seed)
    metrics = args.out / run / "metrics.jsonl"
    keys = run_keys(args, name, seed)
    trained_with = args.out / run / "fp8_loss_check.json"  # the keys it was trained with
    if args.reuse and trained_with.exists() and json.loads(trained_with.read_text()) == keys:
        records = [r for r in read_metrics(metrics) if r["step"] <= args.steps]
        if records and records[-1]["step"] == args.steps:
            print(f"reused {run}: loss {records[-1]['loss']:.4f} at step {args.steps}", flush=True)
            return records
    command = [sys.executable, "-m", "MaxText.train", *keys, f"base_output_directory={args.out}"]
    metrics.unlink(missing_ok=True)  # a run appends to its metrics: start this one's afresh
    trained_with.unlink(missing_ok=True)
    if args.jobs == 1:
        print(f"training {run} ...", flush=True)
        returncode = start_and_wait(command, os.environ)
    else:  # several at once: each its share of a GPU's memory, its output to a file
        env = {"XLA_PYTHON_CLIENT_MEM_FRACTION": f"{0.9 / args.jobs:.3f}", **os.environ}
        args.out.mkdir(parents=True, exist_ok=True)
        log = args.out / f"{run}.log"
        with open(log, "w") as stream:
            returncode = start_and_wait(command, env, stream)
        if returncode:
            print(log.read_text()[-3000:], file=sys.stderr)
    if returncode:
        raise RunFailed(f"{run} exited with {returncode}", returncode)
    records = read_metrics(metrics)
    if not records or records[-1]["step"] < args.steps:  # stopped early (a SIGTERM saves and exits 0)
        raise RunFailed(f"{run} stopped before step {args.steps}", 1)
    trained_with.write_text(json.dumps(keys))
    print(f"trained {run}: loss {records[-1]['loss']:.4f} at step {records[-1]['step']}", flush=True)
    return records


def start_and_wait(command: list[str], env, stream=None) -> int:
    """Run one training process (known to ``stop_all`` while it lives); its exit code."""
    with LOCK:
        if STOPPING.is_set():
            raise RunFailed("stopped", 1)
        run = subprocess.Popen(command, cwd=REPO, env=env, stdout=stream, stderr=subprocess.STDOUT if stream else None)
        RUNNING.add(run)
    try:
        return run.wait()
    finally:
        RUNNING.discard(run)


class RunFailed(Exception):
    """A training run failed or stopped early (its exit code is this tool's)."""

    def __init__(self, why: str, returncode: int):
        super().__init__(why)
        self.returncode = returncode


def train_all(args: argparse.Namespace, names: list[str]) -> dict[int, dict[str, list[dict]]]:
    """Every (seed, run), ``--jobs`` at a time; {seed: {name: records}}."""
    pool = ThreadPoolExecutor(args.jobs)
    futures = {(seed, name): pool.submit(train, args, name, seed) for seed in args.seeds for name in names}
    try:
        return {seed: {name: futures[seed, name].result() for name in names} for seed in args.seeds}
    except RunFailed:  # one failed: start no more, stop the others
        stop_all()
        raise
    finally:
        pool.shutdown(cancel_futures=True)


def losses(records: list[dict]) -> np.ndarray:
    return np.array([r["loss"] for r in records])


def relative_error(baseline: list[dict], run: list[dict], window: int) -> float:
    """Signed: (run - baseline) / baseline of the mean loss over the last ``window`` steps."""
    base, ours = losses(baseline)[-window:].mean(), losses(run)[-window:].mean()
    return float((ours - base) / base)


def plot(runs: dict[int, dict[str, list[dict]]], path: Path) -> None:
    """The runs' mean curves over seeds, and each run's difference from its seed's baseline
    (each seed thin, their mean thick)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    names = list(next(iter(runs.values())))
    steps = np.array([r["step"] for r in runs[next(iter(runs))][BASELINE]])
    for i, name in enumerate(names):
        curves = np.array([losses(by_name[name]) for by_name in runs.values()])
        top.plot(steps, curves.mean(0), label=name, lw=1, color=f"C{i}")
        if name == BASELINE:
            continue
        bases = np.array([losses(by_name[BASELINE]) for by_name in runs.values()])
        relative = 100 * (curves - bases) / bases
        bottom.plot(steps, relative.T, lw=0.5, alpha=0.3, color=f"C{i}")
        bottom.plot(steps, relative.mean(0), lw=1.5, color=f"C{i}", label=f"{name} (mean of {len(runs)} seeds)")
    bottom.axhspan(-0.25, 0.25, color="0.9", label="+-0.25%")
    top.set_ylabel(f"loss (mean of {len(runs)} seeds)")
    bottom.set_ylabel("vs baseline (%)")
    bottom.set_xlabel("step")
    top.legend()
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    for stop in (signal.SIGTERM, signal.SIGINT):
        signal.signal(stop, stop_runs)
    recipes = [r for r in args.recipes.split(",") if r]
    names = [*recipes, *([CONTROL] if args.control else [])]
    try:
        runs = train_all(args, [BASELINE, *names])
    except RunFailed as failure:
        print(f"fp8_loss_check: {failure}", file=sys.stderr)
        return failure.returncode

    print(f"\n{args.model}, {args.steps} steps, relative error of the mean loss over the last {args.window} steps")
    print(f"(control: {args.control or 'none'}; criterion: the mean over seeds within {100 * args.threshold:.2f}%)")
    header = "".join(f"{'seed ' + str(s):>10s}" for s in args.seeds)
    print(f"{'run':16s}{header}{'mean':>10s}{'s.e.':>8s}{'load max/mean':>15s}")
    failed = []
    for name in [BASELINE, *names]:
        by_seed = [relative_error(runs[s][BASELINE], runs[s][name], args.window) for s in args.seeds]
        load = np.mean([runs[s][name][-1].get("expert_load_max_over_mean", np.nan) for s in args.seeds])
        cells = "".join(f"{100 * e:+9.3f}%" for e in by_seed)
        mean = float(np.mean(by_seed))
        error = float(np.std(by_seed, ddof=1) / np.sqrt(len(by_seed))) if len(by_seed) > 1 else np.nan
        print(f"{name:16s}{cells}{100 * mean:+9.3f}%{100 * error:7.3f}%{load:15.2f}")
        if name in recipes and abs(mean) > args.threshold:
            failed.append(name)
    figure = args.out / f"{args.model}-fp8_loss.png"
    plot(runs, figure)
    print(f"plot: {figure}")
    if failed:
        print(f"mean over seeds past {100 * args.threshold:.2f}%: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
