"""Training on a folder of real text prepared with tools/prepare_dataset.py, through the real entry points.

The folder is this repository's own documentation and configs. Two short runs with the same seed
must log identical losses (the second reuses the first's compiled programs through JAX's
persistent cache, which changes no result and saves most of its time). That a different seed
gives different batches is checked on the pipeline alone, in test_data_pipeline.py.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from MaxText.train.metrics import read_metrics, step_records
from tests.conftest import cpu_env

pytestmark = pytest.mark.slow  # whole runs: `make test-fast` leaves this file out

REPO = Path(__file__).resolve().parents[1]


def run(command: list[str], env: dict) -> str:
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return result.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[list[dict]]:
    work = tmp_path_factory.mktemp("text")
    corpus = work / "corpus"
    for path in [
        REPO / "README.md",
        *REPO.glob("docs/*.md"),
        *REPO.glob("recipes/**/*.md"),
        *REPO.glob("MaxText/**/*.yml"),
    ]:
        target = corpus / path.relative_to(REPO)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, target)
    env = cpu_env(1)
    prepared = work / "prepared"
    tool = [sys.executable, "tools/prepare_dataset.py", "--input", str(corpus), "--output", str(prepared)]
    out = run([*tool, "--name", "docs", "--val-fraction", "0.1"], env)
    assert "train with: dataset_type=tfds dataset_name=docs" in out
    records = []
    for name in ("first", "again"):
        run(
            [
                sys.executable,
                "-m",
                "MaxText.train",
                "dataset_type=tfds",
                "dataset_name=docs",
                f"dataset_path={prepared}",
                f"base_output_directory={work / 'runs'}",
                f"run_name={name}",
                "steps=6",
                "log_period=1",
                "eval_interval=3",
                "eval_steps=2",
                "enable_tensorboard=false",
            ],
            env,
        )
        records.append(step_records(read_metrics(work / "runs" / name)))
    return records


def test_trains_on_prepared_text_with_eval_loss(runs):
    records = runs[0]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert records[-1]["loss"] < records[0]["loss"] - 0.3
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert len(evals) == 2 and evals[1] < evals[0]


def test_same_seed_gives_identical_losses(runs):
    first, again = runs
    assert [r["loss"] for r in first] == [r["loss"] for r in again]
    evals = [r["eval_loss"] for r in first if "eval_loss" in r]
    assert [r["eval_loss"] for r in again if "eval_loss" in r] == pytest.approx(evals, rel=1e-6)
