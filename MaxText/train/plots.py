"""Plots of runs from their ``metrics.jsonl``: the losses, expert load per MoE layer, and runs side by side.

Everything here reads records as written by ``MetricsWriter``: one JSON object per logged step.
Records that are not steps (an ``"event"`` key, no ``"step"``) or that lack the metric being read
are skipped rather than refused, so that files with new kinds of records still plot.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from MaxText.train.metrics import step_of

PER_LAYER_LOAD = "expert_load_max_over_mean_per_layer"
MAX_STEP_TICKS = 12  # step labels on a heatmap's x axis; more would overlap


def _number(value: Any) -> float | None:
    """A scalar metric value as a float; None for null, lists, strings and booleans."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def metric_series(records: list[dict[str, Any]], metric: str) -> dict[int, float]:
    """Step -> value of ``metric``, in step order, for the steps that logged a number for it.

    A resumed run logs the steps after its checkpoint again; the last record of a step wins, as
    it is the one the run continued from.
    """
    series: dict[int, float] = {}
    for record in records:
        step, value = step_of(record), _number(record.get(metric))
        if step is not None and value is not None:
            series[step] = value
    return dict(sorted(series.items()))


def relative_difference(base: dict[int, float], other: dict[int, float]) -> dict[int, float]:
    """``(other - base) / |base|`` at the steps both have, in step order (steps where base is 0 are
    skipped: there is no scale to compare against)."""
    return {
        step: (other[step] - base[step]) / abs(base[step]) for step in sorted(base.keys() & other.keys()) if base[step]
    }


def expert_load_matrix(records: list[dict[str, Any]]) -> tuple[list[int], np.ndarray]:
    """The steps that logged per-layer expert loads, and those loads as a [layers, steps] array.

    Steps are in order, the last record of a repeated step wins (as in ``metric_series``). A run
    whose layer count changed mid-file is padded with NaN (drawn blank) rather than refused.
    """
    loads: dict[int, list[float]] = {}
    for record in records:
        step, value = step_of(record), record.get(PER_LAYER_LOAD)
        if step is not None and isinstance(value, list) and value:
            loads[step] = [math.nan if v is None else float(v) for v in value]
    if not loads:
        return [], np.zeros((0, 0))
    steps = sorted(loads)
    matrix = np.full((max(len(v) for v in loads.values()), len(steps)), math.nan)
    for j, step in enumerate(steps):
        matrix[: len(loads[step]), j] = loads[step]
    return steps, matrix


def plot_expert_load(records: list[dict[str, Any]], path: Path) -> Path | None:
    """A heatmap of the most-loaded expert over the mean load, per MoE layer and logged step: where
    routing collapses onto few experts, and in which layers. None (nothing written) when no record
    has per-layer loads."""
    steps, matrix = expert_load_matrix(records)
    if not steps:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    layers = matrix.shape[0]
    fig, ax = plt.subplots(figsize=(8, min(12.0, max(4.0, 1.5 + 0.25 * layers))))
    image = ax.imshow(matrix, aspect="auto", interpolation="nearest", cmap="viridis")
    stride = math.ceil(len(steps) / MAX_STEP_TICKS)
    ticks = list(range(0, len(steps), stride))
    ax.set_xticks(ticks, [str(steps[j]) for j in ticks])
    ax.set_yticks(range(0, layers, math.ceil(layers / 32)))
    ax.set_xlabel("step")
    ax.set_ylabel("MoE layer")
    ax.set_title(f"{path.parent.name}: expert load per MoE layer")
    fig.colorbar(image, ax=ax, label="max / mean expert load (1 = balanced)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_runs(runs: dict[str, list[dict[str, Any]]], metrics: list[str], path: Path) -> dict[str, Any]:
    """Runs side by side, one row per metric: the metric against step for every run, and each
    later run's difference from the first in percent, which shows a 1% change that the curves
    themselves hide. Writes the PNG at ``path``.

    Returns ``{metric: {run: {"final", "max_abs_relative_difference", "common_steps"}}}``: the
    value at the run's last step; the largest ``|other - first| / |first|`` as a fraction (None
    for the first run, or with no common steps); the steps the run shares with the first run.
    """
    if not runs:
        raise ValueError("plot_runs: no runs")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(runs)
    fig, axes = plt.subplots(len(metrics), 2, figsize=(12, 3.5 * len(metrics)), squeeze=False)
    summary: dict[str, Any] = {}
    for (left, right), metric in zip(axes, metrics, strict=True):
        series = {name: metric_series(records, metric) for name, records in runs.items()}
        base = series[names[0]]
        summary[metric] = {}
        for i, name in enumerate(names):
            values = series[name]
            if values:
                marker = "o" if len(values) < 30 else None
                left.plot(list(values), list(values.values()), color=f"C{i}", marker=marker, label=name)
            diff = relative_difference(base, values)
            finite = [abs(d) for d in diff.values() if math.isfinite(d)]
            if i > 0 and diff:
                marker = "o" if len(diff) < 30 else None
                right.plot(list(diff), [100 * d for d in diff.values()], color=f"C{i}", marker=marker, label=name)
            summary[metric][name] = {
                "final": values[max(values)] if values else None,
                "max_abs_relative_difference": max(finite) if i > 0 and finite else None,
                "common_steps": len(base.keys() & values.keys()),
            }
        left.set_xlabel("step")
        left.set_ylabel(metric)
        left.set_title(metric)
        left.grid(alpha=0.3)
        if left.get_legend_handles_labels()[0]:
            left.legend()
        right.axhline(0.0, color="black", linewidth=0.8)
        right.set_xlabel("step")
        right.set_ylabel(f"{metric}: difference from {names[0]} (%)")
        right.set_title(f"{metric} relative to {names[0]}")
        right.grid(alpha=0.3)
        if right.get_legend_handles_labels()[0]:
            right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return summary


def plot_losses(records: list[dict[str, Any]], path: Path) -> Path:
    """The training losses (and eval_loss where measured) against the step; a step logged twice
    (after a resume or a rollback) shows its last value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, marker in (("loss", "o"), ("lm_loss", "o"), ("mtp_loss", "o"), ("eval_loss", "s")):
        series = metric_series(records, key)
        if any(series.values()):
            few = len(series) < 30 or key == "eval_loss"
            ax.plot(list(series), list(series.values()), label=key, marker=marker if few else None)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats)")
    ax.set_title(path.parent.name)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
