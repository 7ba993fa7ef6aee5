"""Which blocks of the train state each process keeps in the node-local tier, and where their copy lives.

A *block* is one shard of one array of the state: ``(leaf, index)``, the index being the slice of
the global array that a device holds (start/stop per dimension). Each process saves the blocks of
its own devices, each once. So that losing a node loses no block, each process has a *backup*
process on another node that keeps a copy of its blocks:

- **replica**: when every process has a data-parallel replica on another node (a process whose
  devices hold the same blocks), that replica is its backup and its own save is the copy: nothing
  is sent, nothing extra is written;
- **peer**: otherwise each process's backup is the process at the same place on the next node,
  and the blocks that the backup does not hold itself are sent to it at every local save
  (``transfer.py``) and written beside its own.

A node is a host name; when every process runs on one host (a one-machine test) each process
counts as its own node. The layout and the placement are computed from the state's shardings alone,
so every process derives the same ones without asking the others.
"""

import hashlib
from dataclasses import dataclass
from typing import Any

import jax

Index = tuple[tuple[int, int], ...]
Block = tuple[int, Index]  # (leaf number, index)


def block_index(slices: tuple[slice, ...], shape: tuple[int, ...]) -> Index:
    return tuple((s.start or 0, dim if s.stop is None else s.stop) for s, dim in zip(slices, shape, strict=True))


@dataclass(frozen=True)
class Layout:
    """The state's blocks on the current mesh: per leaf, the index each device holds."""

    devices: list  # jax.devices(), the order transfers use
    process_devices: list[list[int]]  # per process: positions in ``devices`` of its devices, by id
    device_index: list[list[Index]]  # per leaf, per position in ``devices``: the block it holds
    shapes: list[tuple[int, ...]]
    dtypes: list[str]
    fingerprint: str  # equal layouts, equal fingerprints: a saved block is only read back into its own layout

    @classmethod
    def of(cls, leaves: list[Any]) -> "Layout":
        """From the state's leaves (arrays or abstract arrays with shardings)."""
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        position = {d.id: i for i, d in enumerate(devices)}
        processes = max(d.process_index for d in devices) + 1
        process_devices = [[position[d.id] for d in devices if d.process_index == p] for p in range(processes)]
        device_index = []
        for leaf in leaves:
            per_device = leaf.sharding.devices_indices_map(tuple(leaf.shape))
            indices = [None] * len(devices)
            for device, slices in per_device.items():
                indices[position[device.id]] = block_index(slices, tuple(leaf.shape))
            device_index.append(indices)
        shapes = [tuple(leaf.shape) for leaf in leaves]
        dtypes = [str(leaf.dtype) for leaf in leaves]
        text = repr((processes, [(d.process_index, d.id) for d in devices], shapes, dtypes, device_index))
        return cls(devices, process_devices, device_index, shapes, dtypes, hashlib.sha1(text.encode()).hexdigest())

    @property
    def processes(self) -> int:
        return len(self.process_devices)

    def slots(self, process: int, leaf: int) -> list[Index]:
        """The index each of ``process``'s devices holds of ``leaf``, in the process's device order."""
        return [self.device_index[leaf][d] for d in self.process_devices[process]]

    def own(self, process: int) -> frozenset[Block]:
        """Every block ``process``'s devices hold (a block on several of its devices counts once)."""
        return frozenset((k, i) for k in range(len(self.shapes)) for i in self.slots(process, k))

    def block_shape(self, block: Block) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in block[1])


@dataclass(frozen=True)
class Placement:
    """Where each process's copy lives."""

    mode: str  # "replica", "peer", or "none" (one process, or no other node to copy to)
    backup: list[int]  # backup[p]: the process that keeps p's copy (p itself in mode "none")
    copies: list[frozenset[Block]]  # copies[p]: p's blocks that backup[p] writes as a copy (empty for replicas)

    def copy_sources(self, process: int) -> list[int]:
        """The processes whose copy ``process`` keeps."""
        return [p for p, b in enumerate(self.backup) if b == process and p != process]


def _shift(order: list[int], apart) -> list[int] | None:
    """The smallest cyclic shift of ``order`` that puts every process apart from its image, as a
    map process -> image (a permutation, so each process keeps exactly one copy); None if none does."""
    n = len(order)
    for k in range(1, n):
        if all(apart(order[i], order[(i + k) % n]) for i in range(n)):
            return {order[i]: order[(i + k) % n] for i in range(n)}
    return None


def place(layout: Layout, hosts: list[int]) -> Placement:
    """The placement for ``layout`` with process p on node ``hosts[p]`` (processes on one node are
    numbered consecutively, as Slurm and the JobSets number them)."""
    processes = layout.processes
    own = [layout.own(p) for p in range(processes)]
    several_nodes = len(set(hosts)) > 1

    def apart(p: int, q: int) -> bool:
        return hosts[p] != hosts[q] if several_nodes else p != q

    by_node = sorted(range(processes), key=lambda p: (hosts[p], p))
    groups: dict[frozenset, list[int]] = {}
    for p in by_node:
        groups.setdefault(own[p], []).append(p)
    backup: dict[int, int] = {}
    for members in groups.values():
        shifted = _shift(members, apart) if len(members) > 1 else None
        if shifted is None:
            break
        backup |= shifted
    else:
        return Placement("replica", [backup[p] for p in range(processes)], [frozenset()] * processes)
    shifted = _shift(by_node, apart)
    if shifted is None:
        return Placement("none", list(range(processes)), [frozenset()] * processes)
    backup_of = [shifted[p] for p in range(processes)]
    return Placement("peer", backup_of, [own[p] - own[backup_of[p]] for p in range(processes)])


Entry = tuple[int, int, int]  # (step, source process, writer process) of a save found on a process's storage


def entry_blocks(own: list[frozenset[Block]], entry: Entry) -> frozenset[Block]:
    """The blocks a save holds: its source's own blocks, or for a copy the source's blocks that its
    writer (the source's backup then) did not hold itself."""
    _, source, writer = entry
    return own[source] if writer == source else own[source] - own[writer]


def holders(layout: Layout, entries: dict[int, set[Entry]], step: int) -> list[int] | None:
    """For each process, a process whose storage holds all its blocks and its data-iterator state
    at ``step`` (itself when it can), or None when some process's are nowhere complete at that
    step. ``entries[h]``: the saves process h found on its storage (every save of a source carries
    the source's iterator state)."""
    own = [layout.own(q) for q in range(layout.processes)]
    held = {
        h: frozenset().union(*(entry_blocks(own, e) for e in found if e[0] == step)) for h, found in entries.items()
    }
    chosen = []
    for p in range(layout.processes):
        candidates = sorted((h != p, h) for h, found in entries.items() if any(e[:2] == (step, p) for e in found))
        holder = next((h for _, h in candidates if own[p] <= held[h]), None)
        if holder is None:
            return None
        chosen.append(holder)
    return chosen
