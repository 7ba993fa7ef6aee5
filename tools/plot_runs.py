"""Training runs side by side: a metric against step for each, and each run's difference from the first.

    python tools/plot_runs.py outputs/baseline outputs/fp8
    python tools/plot_runs.py outputs/baseline outputs/fp8 --metric loss,eval_loss --out fp8.png
    python tools/plot_runs.py outputs/a outputs/b outputs/c --metric grad_norm --json

Each argument is a run's output directory (the one holding ``metrics.jsonl``); runs are named by
their directories, or by the paths as given where two directories share a name. The first run is
the baseline that the others are compared with. Prints the plot's path and, per metric and run, the
final value, the largest |relative difference| from the first run and the steps both logged
(``--json``: one JSON object). Bad input exits 2 with one line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from MaxText.train.metrics import read_metrics, step_records  # noqa: E402
from MaxText.train.plots import metric_series, plot_runs  # noqa: E402


class UsageError(Exception):
    """Input this tool cannot plot; reported as one ``error:`` line."""


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse prints usage + message; one line is the contract
        raise UsageError(f"arguments: {message}")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "runs",
        nargs="*",
        type=Path,
        help="Run output directories, each holding metrics.jsonl; the first is the baseline.",
    )
    p.add_argument("--metric", default="loss", help="Comma-separated metrics, one row each (default: %(default)s).")
    p.add_argument("--out", type=Path, default=Path("runs.png"), help="The PNG to write (default: ./runs.png).")
    p.add_argument(
        "--json",
        action="store_true",
        help="Print one JSON object (the plot's path and the summary) instead of the table.",
    )
    args = p.parse_args(argv)
    if not args.runs:
        raise UsageError("arguments: name at least one run directory")
    args.metrics = [m.strip() for m in args.metric.split(",")]
    if not all(args.metrics):
        raise UsageError(f"arguments: --metric {args.metric!r} has an empty name")
    return args


def run_names(dirs: list[Path]) -> list[str]:
    """Directory names, or the paths as given for directories whose names collide (two runs'
    ``outputs/*/default``, say)."""
    names = [d.name or str(d) for d in dirs]
    names = [str(d) if names.count(n) > 1 else n for d, n in zip(dirs, names, strict=True)]
    for name in names:
        if names.count(name) > 1:
            raise UsageError(f"run directory {name!r} is named twice")
    return names


def load_runs(dirs: list[Path]) -> dict[str, list[dict]]:
    runs = {}
    for name, run_dir in zip(run_names(dirs), dirs, strict=True):
        if not run_dir.exists():
            raise UsageError(f"run directory {str(run_dir)!r} does not exist")
        if not run_dir.is_dir():
            raise UsageError(f"{str(run_dir)!r} is not a directory")
        if not (run_dir / "metrics.jsonl").is_file():
            raise UsageError(f"{str(run_dir)!r} has no metrics.jsonl")
        try:
            runs[name] = read_metrics(run_dir)
        except ValueError as err:
            raise UsageError(str(err)) from None
    return runs


def check_metrics(runs: dict[str, list[dict]], metrics: list[str]) -> None:
    """Refuse a metric no run logged (a typo, most likely), naming the ones they did log."""
    for metric in metrics:
        if not any(metric_series(records, metric) for records in runs.values()):
            logged = sorted(
                {k for records in runs.values() for r in step_records(records) for k in r if metric_series([r], k)}
                - {"step"}
            )
            raise UsageError(f"metric {metric!r} is in none of the runs (they log: {', '.join(logged) or 'nothing'})")


def render(path: Path, summary: dict) -> str:
    rows = [("metric", "run", "final", "max |rel diff|", "common steps")]
    for metric, per_run in summary.items():
        for name, s in per_run.items():
            final = "-" if s["final"] is None else f"{s['final']:.6g}"
            diff = s["max_abs_relative_difference"]
            rows.append((metric, name, final, "-" if diff is None else f"{100 * diff:.4g}%", str(s["common_steps"])))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    return "\n".join([str(path), *lines])


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        runs = load_runs(args.runs)
        check_metrics(runs, args.metrics)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        summary = plot_runs(runs, args.metrics, args.out)
    except (UsageError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps({"plot": str(args.out), "summary": summary}) if args.json else render(args.out, summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
