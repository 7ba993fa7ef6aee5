"""tools/fp8_loss_check.py's criterion on runs already trained (``--reuse``): the relative error
of each recipe's mean loss over the last ``--window`` steps against its seed's baseline, its mean
over seeds held to the threshold (exit 1 naming the recipe past it), the standard error, the plot.
The training itself is the entry point's, tested in test_train.py."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("fp8_loss_check", REPO / "tools" / "fp8_loss_check.py")
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)


def write_run(out: Path, args, name: str, seed: int, losses: np.ndarray, extra_steps: int = 0) -> None:
    """A finished run as the tool leaves it: its metrics (``extra_steps`` past the end: a longer run)
    and the keys it was trained with."""
    run = out / f"deepseek3-tiny-{name}-seed{seed}"
    run.mkdir(parents=True)
    losses = np.concatenate([losses, np.full(extra_steps, 99.0)])
    lines = [{"step": i + 1, "loss": float(v), "expert_load_max_over_mean": 1.25} for i, v in enumerate(losses)]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in [{"event": "start"}, *lines]) + "\n")
    (run / "fp8_loss_check.json").write_text(json.dumps(tool.run_keys(args, name, seed)))


def test_the_criterion_is_the_mean_over_seeds_of_the_last_steps(tmp_path):
    steps, window = 30, 10
    curve = np.linspace(3.0, 1.0, steps)
    offsets = {  # each run's relative offset over the last `window` steps, per seed
        "fp8_blockwise": (+0.001, -0.003),  # mean -0.1%: within 0.25%
        "mxfp8": (+0.004, +0.002),  # mean +0.3%: past it
        "control": (0.0, +0.0002),
    }
    argv = ["--steps", str(steps), "--window", str(window), "--seeds", "0,1", "--reuse", "--out", str(tmp_path)]
    args = tool.parse_args(argv)
    for seed in (0, 1):
        write_run(tmp_path, args, "none", seed, curve)
        for name, by_seed in offsets.items():
            moved = curve.copy()
            moved[-window:] *= 1 + by_seed[seed]
            moved[:-window] *= 1.5  # before the window: not counted
            write_run(tmp_path, args, name, seed, moved, extra_steps=5 * seed)  # steps past --steps: not counted
    done = subprocess.run(
        [sys.executable, "tools/fp8_loss_check.py", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr[-2000:]
    rows = {line.split()[0]: line.split()[1:] for line in done.stdout.splitlines() if line.split()}
    assert rows["fp8_blockwise"][:4] == ["+0.100%", "-0.300%", "-0.100%", "0.200%"]
    assert rows["mxfp8"][:4] == ["+0.400%", "+0.200%", "+0.300%", "0.100%"]
    assert rows["mxfp8"][4] == "1.25"  # the experts' balance at the end
    assert done.stdout.strip().splitlines()[-1] == "mean over seeds past 0.25%: mxfp8"
    assert "trained" not in done.stdout  # every run reused
    assert (tmp_path / "deepseek3-tiny-fp8_loss.png").stat().st_size > 0


def test_a_run_trained_with_other_keys_is_not_reused(tmp_path):
    args = tool.parse_args(["--steps", "30", "--out", str(tmp_path), "--reuse"])
    write_run(
        tmp_path, tool.parse_args(["--steps", "30", "--out", str(tmp_path), "dtype=bfloat16"]), "none", 0, np.ones(30)
    )
    keys = json.loads((tmp_path / "deepseek3-tiny-none-seed0" / "fp8_loss_check.json").read_text())
    assert keys != tool.run_keys(args, "none", 0) and "dtype=bfloat16" in keys


def test_a_failing_run_ends_the_check_with_its_exit_code(tmp_path):
    """Runs trained at once (``--jobs 2``), one key that no config has: each run exits 2 naming
    it, and so does the check, with the run's log."""
    done = subprocess.run(
        [sys.executable, "tools/fp8_loss_check.py", "--steps", "2", "--window", "1", "--recipes", "mxfp8"]
        + ["--control", "", "--jobs", "2", "--out", str(tmp_path), "no_such_key=1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "exited with 2" in done.stderr.strip().splitlines()[-1]
    assert "no_such_key" in done.stderr  # the run's own line, from its log
