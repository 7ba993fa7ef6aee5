"""A profiler trace of a window of training steps (``profiler: xplane``).

Steps ``profile_start_step`` .. ``profile_start_step + profile_steps - 1`` are traced into
``<run>/profile/`` (``plugins/profile/<time>/``: the XPlane protobuf TensorBoard's profile plugin
reads, and ``perfetto_trace.json.gz`` for ui.perfetto.dev). Every step runs under a step
annotation (``train``, with its step number), so the trace viewer groups the work by step; the
window is closed only after its last step's results are on the host, so the trace holds them
whole. On GPU the trace also has the device's kernels and memory.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import jax

STEP_NAME = "train"


class StepProfiler:
    def __init__(self, kind: str, start: int, steps: int, directory: Path, is_writer: bool):
        self.enabled = kind == "xplane"
        self.first, self.last = start, start + steps - 1
        self.directory = directory
        self.is_writer = is_writer
        self.running = False

    def maybe_start(self, step: int) -> None:
        """Open the window before its first step."""
        if self.enabled and step == self.first and not self.running:
            self.directory.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.directory), create_perfetto_trace=self.is_writer)
            self.running = True

    def annotate(self, step: int):
        """The context one step's dispatch runs in (the trace's step annotation)."""
        return jax.profiler.StepTraceAnnotation(STEP_NAME, step_num=step) if self.running else contextlib.nullcontext()

    def ends_at(self, step: int) -> bool:
        """Whether the window closes after ``step`` (the caller waits for the step, then ``close``)."""
        return self.running and step >= self.last

    def close(self) -> None:
        """Write the trace (after the window's last step, or when the run ends inside it)."""
        if self.running:
            jax.profiler.stop_trace()
            self.running = False
