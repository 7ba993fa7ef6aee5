"""Plots of finished runs: expert load heatmaps, runs side by side, and tools/plot_runs.py."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from MaxText.train.metrics import read_metrics
from MaxText.train.plots import (
    expert_load_matrix,
    metric_series,
    plot_expert_load,
    plot_runs,
    relative_difference,
)
from tools import plot_runs as tool

ROOT = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
STEPS = range(1, 11)


def loss_a(step: int) -> float:
    return 5.0 / (1 + 0.1 * step)


def load(step: int, bump: float = 0.0) -> list[float]:
    return [1.0 + 0.1 * step + bump, 2.0 - 0.05 * step, 1.5]


def step_record(step: int, loss: float, **extra) -> dict:
    return {"step": step, "loss": loss, "lm_loss": loss, "grad_norm": 1.0, "mfu": None, **extra}


def write_run(path: Path, records: list[dict]) -> Path:
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def record_a(step: int, bump: float = 0.0) -> dict:
    evals = {"eval_loss": loss_a(step) + 0.5 + bump} if step in (5, 10) else {}
    return step_record(step, loss_a(step) + bump, expert_load_max_over_mean_per_layer=load(step, bump), **evals)


@pytest.fixture
def runs(tmp_path) -> list[Path]:
    """Run B logs 1.01 x run A's loss at every step, so B differs from A by exactly 1%. A rolled back
    to step 5 (its first steps 5 and 6 are superseded), and has eval losses at steps 5 and 10 and
    per-layer expert loads; C stops at step 6 and never evaluates."""
    a = [record_a(s, bump=1.0 if s >= 5 else 0.0) for s in range(1, 7)]
    a += [{"event": "rollback", "step": 5}, *(record_a(s) for s in range(5, 11))]
    b = [step_record(s, loss_a(s) * 1.01, eval_loss=(loss_a(s) + 0.5) * 1.01 if s in (5, 10) else None) for s in STEPS]
    c = [step_record(s, loss_a(s) * 0.98) for s in STEPS if s <= 6]
    return [write_run(tmp_path / name, records) for name, records in (("run_a", a), ("run_b", b), ("run_c", c))]


def run_tool(capsys, *argv: str) -> tuple[int, str, str]:
    code = tool.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------- reading and comparing


def test_metric_series_last_record_of_a_step_wins(runs):
    records = read_metrics(runs[0])
    series = metric_series(records, "loss")
    assert list(series) == list(STEPS)
    assert series == pytest.approx({s: loss_a(s) for s in STEPS})  # the resumed run's values, not the first
    assert metric_series(records, "eval_loss") == pytest.approx({5: loss_a(5) + 0.5, 10: loss_a(10) + 0.5})
    assert metric_series(records, "mfu") == {}  # null everywhere
    assert metric_series(records, "expert_load_max_over_mean_per_layer") == {}  # not a scalar


def test_relative_difference():
    assert relative_difference({1: 2.0, 2: -4.0, 3: 0.0, 4: 1.0}, {1: 3.0, 2: -2.0, 3: 1.0, 5: 1.0}) == {
        1: 0.5,
        2: 0.5,
    }


def test_read_metrics_drops_a_cut_off_last_line(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n\n{"step": 2, "lo')
    assert read_metrics(run) == [{"step": 1, "loss": 2.0}]
    (run / "metrics.jsonl").write_text('{"step": 1, "lo\n{"step": 2, "loss": 2.0}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:1"):
        read_metrics(run)


# ---------------------------------------------------------------- expert load


def test_expert_load_matrix_is_the_logged_values(runs):
    steps, matrix = expert_load_matrix(read_metrics(runs[0]))
    assert steps == list(STEPS)
    assert matrix.shape == (3, len(STEPS))
    np.testing.assert_array_equal(matrix, np.array([load(s) for s in STEPS]).T)

    steps, matrix = expert_load_matrix([])
    assert steps == [] and matrix.shape == (0, 0)
    steps, matrix = expert_load_matrix([{"step": 1, "loss": 2.0, "expert_load_max_over_mean_per_layer": []}])
    assert steps == [] and matrix.shape == (0, 0)


def test_plot_expert_load(runs, tmp_path):
    path = plot_expert_load(read_metrics(runs[0]), runs[0] / "expert_load.png")
    assert path == runs[0] / "expert_load.png"
    assert path.read_bytes().startswith(PNG_SIGNATURE) and path.stat().st_size > 0

    out = tmp_path / "none.png"
    assert plot_expert_load(read_metrics(runs[1]), out) is None
    assert plot_expert_load([], out) is None
    assert not out.exists()


# ---------------------------------------------------------------- runs side by side


def test_plot_runs_summary(runs, tmp_path):
    records = {p.name: read_metrics(p) for p in runs[:2]}
    summary = plot_runs(records, ["loss"], tmp_path / "two.png")
    assert summary["loss"]["run_a"] == {
        "final": pytest.approx(loss_a(10)),
        "max_abs_relative_difference": None,
        "common_steps": 10,
    }
    assert summary["loss"]["run_b"]["max_abs_relative_difference"] == pytest.approx(0.01, abs=1e-9)
    assert (tmp_path / "two.png").read_bytes().startswith(PNG_SIGNATURE)


def test_tool_json_summary(runs, tmp_path, capsys):
    out = tmp_path / "plots" / "cmp.png"
    code, stdout, stderr = run_tool(capsys, *runs, "--metric", "loss,eval_loss", "--out", out, "--json")
    assert code == 0 and stderr == ""
    result = json.loads(stdout)
    assert result["plot"] == str(out)
    assert out.read_bytes().startswith(PNG_SIGNATURE) and out.stat().st_size > 0

    loss, eval_loss = result["summary"]["loss"], result["summary"]["eval_loss"]
    assert list(loss) == ["run_a", "run_b", "run_c"]
    assert loss["run_a"]["final"] == pytest.approx(loss_a(10), abs=1e-12)
    assert loss["run_a"]["max_abs_relative_difference"] is None
    assert loss["run_a"]["common_steps"] == 10
    assert loss["run_b"]["final"] == pytest.approx(loss_a(10) * 1.01, abs=1e-12)
    assert abs(loss["run_b"]["max_abs_relative_difference"] - 0.01) < 1e-9
    assert loss["run_b"]["common_steps"] == 10
    assert loss["run_c"]["final"] == pytest.approx(loss_a(6) * 0.98, abs=1e-12)
    assert abs(loss["run_c"]["max_abs_relative_difference"] - 0.02) < 1e-9
    assert loss["run_c"]["common_steps"] == 6

    assert eval_loss["run_a"]["final"] == pytest.approx(loss_a(10) + 0.5, abs=1e-12)
    assert eval_loss["run_a"]["common_steps"] == 2
    assert abs(eval_loss["run_b"]["max_abs_relative_difference"] - 0.01) < 1e-9
    assert eval_loss["run_b"]["common_steps"] == 2
    assert eval_loss["run_c"] == {"final": None, "max_abs_relative_difference": None, "common_steps": 0}


def test_tool_table_and_names(runs, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, stdout, _ = run_tool(capsys, runs[0], runs[1])
    lines = stdout.splitlines()
    assert code == 0 and lines[0] == "runs.png" and (tmp_path / "runs.png").is_file()  # the default --out
    assert lines[1].split()[:3] == ["metric", "run", "final"]
    assert lines[3].split() == ["loss", "run_b", f"{loss_a(10) * 1.01:.6g}", "1%", "10"]

    twin = write_run(tmp_path / "other" / "run_a", [step_record(s, loss_a(s)) for s in STEPS])
    code, stdout, _ = run_tool(capsys, runs[0], twin, "--json")
    assert code == 0
    assert list(json.loads(stdout)["summary"]["loss"]) == [str(runs[0]), str(twin)]  # same name: paths as given


def test_tool_bad_input_exits_2_with_one_line(runs, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_run(tmp_path / "empty", [])
    (tmp_path / "no_metrics").mkdir()
    cases = {
        "does not exist": [tmp_path / "missing"],
        "has no metrics.jsonl": [runs[0], tmp_path / "no_metrics"],
        "'lossy' is in none of the runs": [*runs, "--metric", "loss,lossy"],
        "is in none of the runs (they log: nothing)": [tmp_path / "empty"],
        "at least one run directory": ["--metric", "loss"],
        "arguments: unrecognized": [runs[0], "--bogus"],
        "named twice": [runs[0], runs[0]],
    }
    for expected, argv in cases.items():
        code, stdout, stderr = run_tool(capsys, *argv)
        assert code == 2 and stdout == "", expected
        assert len(stderr.splitlines()) == 1 and stderr.startswith("error: ") and expected in stderr, stderr
    assert not (tmp_path / "runs.png").exists()


def test_tool_runs_as_a_script(runs, tmp_path):
    out = tmp_path / "script.png"
    ok = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "plot_runs.py"), *map(str, runs), "--out", str(out), "--json"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["plot"] == str(out) and out.read_bytes().startswith(PNG_SIGNATURE)

    bad = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "plot_runs.py"), str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and len(bad.stderr.splitlines()) == 1
