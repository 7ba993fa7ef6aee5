"""Stopping cleanly when the cluster asks: SIGTERM (and Ctrl-C's SIGINT) finish the current step.

The handler only records the signal; the loop asks ``should_stop(step)`` after every step, saves
and exits. With several processes the answer is agreed (any process signalled means every process
stops), so that all hosts save the same step. Agreeing is a collective (an all-gather of one flag),
and fetching its result makes the host wait for the device to finish the step, which ends the
host's run-ahead (one step: the health guards read each step's loss while the next one runs); so
a multi-process run agrees only every ``preemption_check_period`` steps (on
steps that are multiples of it; the default matches ``log_period``, whose metrics fetch waits
anyway). A signal is honoured at the next such step, so the period times the step time, plus the
save, must fit in the scheduler's grace period (recipes: 600 s under Slurm, 900 s on k8s). A
single process needs no agreement and checks every step.

JAX also ships a preemption sync manager (``multihost_utils.reached_preemption_sync_point``,
jax 0.10.2; it works on CPU with gloo): the coordination service spreads a SIGTERM and every
process stops at one step chosen in the background, with no per-step collective. It is not used
here because it catches SIGTERM in C++ (a Python handler, as this module installs, replaces it),
knows nothing of SIGINT, and exists only under ``jax.distributed``.
"""

import signal
from types import FrameType

import jax
import numpy as np
from jax.experimental import multihost_utils

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class PreemptionWatch:
    """Records SIGTERM/SIGINT while active (a context manager); the previous handlers come back after."""

    def __init__(self, check_period: int = 1) -> None:
        self.check_period = check_period
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "PreemptionWatch":
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._record)
        return self

    def __exit__(self, *exc_info) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum

    def should_stop(self, step: int) -> bool:
        """Whether to save and stop after ``step``. One process: once it has received a signal.
        Several: on every process, at the first multiple of ``check_period`` once any process has
        received one (every process must call this after every step, with the same steps)."""
        local = self.received is not None
        if jax.process_count() == 1:
            return local
        if step % self.check_period:
            return False
        return bool(np.any(multihost_utils.process_allgather(np.array(local))))

    def signal_name(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else "another process"
