"""Where a run's wall time goes, and how much of it trained the model.

The loop times each stretch of host time into one category:

    startup      devices, mesh, data, model, optimizer, the state's creation
    restore      reading the checkpoint the run resumes from
    compile      compiling the training step (before the first step; the pre-flight memory check reads it)
    step         dispatching steps and waiting for their results: the productive part
    data_wait    getting the next batch from the input pipeline onto the devices
    checkpoint   the blocking part of saves (an asynchronous save returns early)
    eval         evaluation
    logging      metrics fetched, written and shown
    rollback     restoring after a loss spike (the steps it undoes stay in ``step``)
    profile      starting the profiler and writing its trace
    outputs      plots and closing files at the end

``goodput`` = step / wall. With asynchronous dispatch the device runs a step while the host waits
for data, so ``data_wait`` is host time that may overlap device work; it is lost time when the
device is faster than the input pipeline.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

CATEGORIES = (
    "startup",
    "restore",
    "compile",
    "step",
    "data_wait",
    "checkpoint",
    "eval",
    "logging",
    "rollback",
    "profile",
    "outputs",
)


class Goodput:
    """Category totals of host time. Timings nest: a stretch timed inside another (a rollback
    found while waiting for a step) counts in the inner category only."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.totals = dict.fromkeys(CATEGORIES, 0.0)
        self.open: list[list] = []  # [category, start, seconds of nested timings]

    @contextmanager
    def timing(self, category: str) -> Iterator[None]:
        frame = [category, time.perf_counter(), 0.0]
        self.open.append(frame)
        try:
            yield
        finally:
            self.open.pop()
            elapsed = time.perf_counter() - frame[1]
            self.totals[category] += elapsed - frame[2]
            if self.open:
                self.open[-1][2] += elapsed

    def add(self, category: str, seconds: float) -> None:
        """``seconds`` measured outside ``timing``."""
        self.totals[category] += seconds
        if self.open:
            self.open[-1][2] += seconds

    def record(self) -> dict:
        """The run's totals, its wall time and goodput, as one metrics record."""
        wall = time.perf_counter() - self.start
        return {
            "event": "goodput",
            "wall_s": wall,
            **{f"{k}_s": v for k, v in self.totals.items()},
            "accounted_fraction": sum(self.totals.values()) / wall,
            "goodput": self.totals["step"] / wall,
        }


def render(record: dict) -> str:
    """One line per category, largest first."""
    wall = record["wall_s"]
    rows = sorted(((k, record[f"{k}_s"]) for k in CATEGORIES), key=lambda kv: -kv[1])
    lines = [f"goodput {100 * record['goodput']:.1f}% of {wall:.1f} s wall time:"]
    lines += [f"  {k:<11} {v:8.2f} s  {100 * v / wall:5.1f}%" for k, v in rows if v > 0]
    return "\n".join(lines)


def device_memory_gb(devices) -> dict[str, float | None]:
    """This process's devices' memory in use and peak, in GB (the largest device's), or None
    where the backend reports none (CPU)."""
    stats = [d.memory_stats() for d in devices]
    if not all(stats) or not all("bytes_in_use" in s for s in stats):
        return {"device_memory_in_use_gb": None, "device_memory_peak_gb": None}
    return {
        "device_memory_in_use_gb": max(s["bytes_in_use"] for s in stats) / 1e9,
        "device_memory_peak_gb": max(s.get("peak_bytes_in_use", s["bytes_in_use"]) for s in stats) / 1e9,
    }
