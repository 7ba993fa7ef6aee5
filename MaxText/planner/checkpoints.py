"""What checkpoints cost a run and what failures take from it: one persistent tier against a
node-local tier beside it (docs/checkpointing.md).

A failure loses the work since the newest checkpoint it can restore (half a period on average),
the restart and the restore. A save costs the step only its blocking part (the copy of the state
to host memory; the write runs in the background), and a period must be long enough for the
write to finish before the next save. Goodput is the share of the cluster's time that ends as
kept training: ``1 - blocking time per second - failures per second x time lost per failure``.
Young's first-order optimum of a period, ``sqrt(2 x blocking cost / failure rate)``, is the
default, rounded to whole steps and raised to the write time where that is longer.

Failure rate: the Llama 3 paper's 419 unexpected interruptions in 54 days on 16,384 H100 GPUs
(Dubey et al. 2024, section 3.3.4), taken as proportional to the GPU count. A node-local copy
survives any single-node failure (the copy is on another node); failures that take a process and
its backup together are left out (they fall back to the persistent tier).
"""

import math
from dataclasses import dataclass

LLAMA3_INTERRUPTIONS, LLAMA3_DAYS, LLAMA3_GPUS = 419, 54, 16_384
FAILURES_PER_GPU_HOUR = LLAMA3_INTERRUPTIONS / (LLAMA3_DAYS * 24 * LLAMA3_GPUS)


@dataclass(frozen=True)
class Storage:
    """Bandwidths in bytes per second (assumptions a user states for a cluster: ``--help``)."""

    shared_write: float  # the shared filesystem, aggregate over the job
    shared_read: float
    local_write: float  # one node's local storage (NVMe RAID 0, or a RAM disk)
    local_read: float
    host_copy: float  # one GPU's device-to-host copy
    restart_seconds: float  # a failed job back to its first step: processes, runtime, compile, no restore
    shared_share: float  # the share of the shared filesystem's time one job's writes may take


@dataclass(frozen=True)
class Run:
    gpus: int
    gpus_per_node: int
    replicas: int  # data-parallel copies of the state
    state_bytes: float  # the whole train state, once
    step_seconds: float

    @property
    def bytes_per_gpu(self) -> float:
        return self.state_bytes * self.replicas / self.gpus

    @property
    def failures_per_second(self) -> float:
        return FAILURES_PER_GPU_HOUR * self.gpus / 3600


@dataclass(frozen=True)
class Tier:
    name: str
    period_steps: int
    write_seconds: float  # one save, in the background
    blocking_seconds: float  # one save, on the step's path
    restore_seconds: float


@dataclass(frozen=True)
class Plan:
    tiers: list[Tier]  # the persistent tier first
    overhead: float  # share of time spent blocked on saves
    lost_per_failure_seconds: float
    goodput: float


def persistent_tier(run: Run, storage: Storage, period_steps: int | None = None) -> Tier:
    """Every unique shard once to the shared filesystem, no more often than its share of the
    filesystem's time allows (other jobs write there too)."""
    write = run.state_bytes / storage.shared_write
    blocking = run.bytes_per_gpu / storage.host_copy
    period = period_steps or _period(run, blocking, write / storage.shared_share)
    return Tier("persistent", period, write, blocking, run.state_bytes / storage.shared_read)


def local_tier(run: Run, storage: Storage, copies: bool, period_steps: int | None = None) -> Tier:
    """Each node's own shards, plus its backup's copy when no data-parallel replica holds them."""
    per_node = run.bytes_per_gpu * run.gpus_per_node * (2 if copies else 1)
    write = per_node / storage.local_write
    blocking = run.bytes_per_gpu / storage.host_copy
    period = period_steps or _period(run, blocking, write)
    return Tier("node-local", period, write, blocking, run.bytes_per_gpu * run.gpus_per_node / storage.local_read)


def _period(run: Run, blocking_seconds: float, write_seconds: float) -> int:
    """Young's optimum in steps, at least the steps a write takes."""
    young = math.sqrt(2 * blocking_seconds / run.failures_per_second) / run.step_seconds
    return max(1, math.ceil(write_seconds / run.step_seconds), round(young))


def plan(run: Run, storage: Storage, tiers: list[Tier]) -> Plan:
    """Goodput with ``tiers`` (persistent first): a failure restores from the newest tier, so the
    work lost is half the shortest period and that tier's restore."""
    overhead = sum(t.blocking_seconds / (t.period_steps * run.step_seconds) for t in tiers)
    restoring = min(tiers, key=lambda t: t.period_steps)
    lost = restoring.period_steps * run.step_seconds / 2 + restoring.restore_seconds + storage.restart_seconds
    return Plan(tiers, overhead, lost, 1 - overhead - run.failures_per_second * lost)
