"""Stopping cleanly when the cluster asks: SIGTERM (and Ctrl-C's SIGINT) finish the current step.

The handler only records the signal; the loop asks ``should_stop()`` after every step, saves and
exits. With several processes the answer is agreed (any process signalled means every process
stops), so that all hosts save the same step.
"""

import signal
from types import FrameType

import jax
import numpy as np
from jax.experimental import multihost_utils

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class PreemptionWatch:
    """Records SIGTERM/SIGINT while active (a context manager); the previous handlers come back after."""

    def __init__(self) -> None:
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

    def should_stop(self) -> bool:
        """True on every process once any process has received a signal."""
        local = self.received is not None
        if jax.process_count() == 1:
            return local
        return bool(np.any(multihost_utils.process_allgather(np.array(local))))

    def signal_name(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else "another process"
