"""The loop's guards for a long run: non-finite steps in a row, and loss spikes.

The step itself skips a non-finite update (``train/step.py``); what it cannot do is stop the run or
roll it back, which needs the host. The loop hands each step's ``loss`` and ``skipped`` to these
trackers one step late (read after the next step is dispatched, so the device never waits on the
host), and acts on what they say:

- ``SkipTracker``: after ``max_consecutive_skipped_steps`` skipped steps in a row the run stops
  with exit code 3 (``TrainingHalted``). Checkpoints are not written while steps are being
  skipped, so the newest checkpoint stays the last good state.
- ``SpikeDetector``: a loss above ``loss_spike_factor`` times the median of the last
  ``loss_spike_window`` losses is a spike (PaLM and OLMo restart from before one, skipping the
  batches that caused it). Skipped steps do not enter the window.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

import jax

EXIT_HALTED = 3  # the exit code of a run stopped by a guard (2 is bad input)


class TrainingHalted(Exception):
    """A guard stopped the run; the message is the one line to print."""


@dataclass
class SkipTracker:
    max_in_a_row: int
    total: int = 0
    in_a_row: int = 0
    first_of_streak: int = 0

    def record(self, step: int, skipped: bool) -> None:
        if not skipped:
            self.in_a_row = 0
            return
        self.total += 1
        self.in_a_row += 1
        if self.in_a_row == 1:
            self.first_of_streak = step

    @property
    def must_stop(self) -> bool:
        return self.in_a_row >= self.max_in_a_row

    def halt_message(self, step: int, newest_checkpoint: str) -> str:
        return (
            f"steps {self.first_of_streak}-{step}: loss or gradient norm not finite in {self.in_a_row} steps in a row "
            f"(max_consecutive_skipped_steps={self.max_in_a_row}); none of them changed the state; "
            f"newest checkpoint: {newest_checkpoint}"
        )


class SpikeDetector:
    def __init__(self, factor: float, window: int):
        self.factor = factor
        self.losses: deque[tuple[int, float]] = deque(maxlen=window)

    def median(self) -> float | None:
        if len(self.losses) < self.losses.maxlen:
            return None
        return statistics.median(loss for _, loss in self.losses)

    def is_spike(self, loss: float) -> bool:
        median = self.median()
        return median is not None and loss > self.factor * median

    def record(self, step: int, loss: float) -> None:
        self.losses.append((step, loss))

    def forget_after(self, step: int) -> None:
        """Drop the losses of steps after ``step`` (those a rollback to ``step`` undoes)."""
        kept = [(s, loss) for s, loss in self.losses if s <= step]
        self.losses.clear()
        self.losses.extend(kept)


class Guards:
    """The two guards acting on the run: each step's figures go into ``pending`` when the step is
    dispatched; ``check`` reads them (blocking on those steps only) and stops the run, or rolls it
    back to the newest checkpoint, which the caller continues from."""

    def __init__(self, config, checkpoints, abstract_state, data, goodput, writer, log):
        self.config = config
        self.checkpoints = checkpoints
        self.abstract_state = abstract_state
        self.data = data
        self.goodput = goodput
        self.writer = writer
        self.log = log
        self.skips = SkipTracker(config.max_consecutive_skipped_steps)
        self.spikes = SpikeDetector(config.loss_spike_factor, config.loss_spike_window)
        self.rollbacks = 0
        self.pending: list[tuple[int, dict]] = []

    def dispatched(self, step: int, metrics: dict) -> None:
        """A step was dispatched: its figures are read by a later ``check``."""
        self.pending.append((step, metrics))

    def check(self, state, before: int):
        """Read the pending steps numbered below ``before``: (state, None), or after a rollback
        (the restored state, the step it continues from)."""
        while self.pending and self.pending[0][0] < before:
            step, metrics = self.pending.pop(0)
            skipped, loss = jax.device_get((metrics["skipped"], metrics["loss"]))
            skipped, loss = bool(skipped), float(loss)
            self.skips.record(step, skipped)
            if self.skips.must_stop:
                raise TrainingHalted(self.skips.halt_message(step, self.newest_checkpoint()))
            if skipped:
                continue
            if self.config.loss_spike_rollback and self.spikes.is_spike(loss):
                restored = self.rollback(step, loss, state)
                if restored is not None:
                    self.pending.clear()  # the steps after the spike are undone with it
                    return restored
            self.spikes.record(step, loss)
        return state, None

    def newest_checkpoint(self) -> str:
        if self.checkpoints is None:
            return "none (checkpointing is off)"
        with self.goodput.timing("checkpoint"):
            self.checkpoints.wait()
        steps = self.checkpoints.steps()
        return str(self.checkpoints.step_path(max(steps))) if steps else "none yet"

    def rollback(self, step: int, loss: float, state):
        """Restore the newest checkpoint and skip batches (when a rollback is left and a checkpoint
        exists); one line and one record either way. (restored state, its step), or None."""
        median = self.spikes.median()
        said = f"loss spike at step {step}: {loss:.4f} > {self.config.loss_spike_factor} x median {median:.4f}"
        event = {"event": "loss_spike", "step": step, "loss": loss, "median": median}
        restored = None
        with self.goodput.timing("rollback"):
            if self.rollbacks < self.config.max_rollbacks:
                restored = self.restore_newest(state, said)
            if restored is not None:
                for _ in range(self.config.spike_skip_batches):  # the data position only moves on
                    next(self.data)
        if restored is not None:
            self.rollbacks += 1
            self.spikes.forget_after(restored.step)
            self.skips.in_a_row = 0
            said += (
                f"; rolled back to step {restored.step} ({restored.path}), skipped the next "
                f"{self.config.spike_skip_batches} batches (rollback {self.rollbacks} of {self.config.max_rollbacks})"
            )
            event |= {
                "event": "rollback",
                "restored_step": restored.step,
                "skipped_batches": self.config.spike_skip_batches,
                "rollback": self.rollbacks,
            }
        elif self.rollbacks >= self.config.max_rollbacks:
            said += f"; not rolled back: max_rollbacks ({self.config.max_rollbacks}) reached"
        else:
            said += "; no checkpoint to roll back to yet"
        self.log(said)
        if self.writer:
            self.writer.write(event)
        return (restored.state, restored.step) if restored is not None else None

    def restore_newest(self, state, said: str):
        """The newest checkpoint, restored after freeing ``state`` (a run sized to its memory holds
        one state), or None when none is written yet."""
        self.checkpoints.wait()
        if not self.checkpoints.steps():
            return None
        jax.block_until_ready(state)
        jax.tree.map(lambda x: x.delete(), state)
        restored = self.checkpoints.restore_latest(self.abstract_state)
        if restored is None:
            raise TrainingHalted(f"{said}; no checkpoint of {self.checkpoints.directory} could be restored")
        return restored

    def may_save(self, step: int) -> bool:
        """No checkpoint while steps are being skipped: the newest stays the last good state."""
        if self.skips.in_a_row:
            self.log(f"checkpoint of step {step} not written: the last {self.skips.in_a_row} steps were skipped")
        return not self.skips.in_a_row
