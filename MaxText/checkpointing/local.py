"""The node-local tier: every ``local_checkpoint_period`` steps each process writes its own blocks
of the train state (and its data iterator's state) to ``local_checkpoint_directory``, and its
backup process on another node writes a copy (``placement.py``).

On disk, under ``<local_checkpoint_directory>/<run_name>/process-<writer>/<step>/``, one directory
per saved source: ``process-<source>/`` with ``blocks.bin`` (the blocks' bytes, back to back),
``manifest.json`` (each block's leaf, index, offset and length, and the layout's fingerprint) and
``data.json``. A step is written under a temporary name and renamed when complete, so a process
killed mid-write leaves no step behind; the ``LOCAL_STEPS_KEPT`` newest steps are kept.

What is on the step's path: the copy of the process's blocks to host memory (the next step donates
their buffers) and, in peer mode, one collective permute per array that sends the backup its copy;
the writes run on a background thread. A restore is collective: the processes agree on the newest
step whose blocks are all held somewhere (``placement.holders``), each process reads what it holds,
and a process whose blocks are on another node's storage receives them over the devices' links.
"""

import json
import os
import re
import shutil
import socket
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from MaxText.checkpointing.persistent import Restored, warn
from MaxText.checkpointing.placement import Block, Entry, Layout, Placement, block_index, holders, place
from MaxText.checkpointing.transfer import send_rows
from MaxText.config import Config

LOCAL_STEPS_KEPT = 2  # the newest may be the one a failure interrupted
_STEP = re.compile(r"^\d+$")
_SOURCE = re.compile(r"^process-(\d+)$")


def allgather_bytes(data: bytes) -> list[bytes]:
    """``data`` from every process, in process order (a collective)."""
    if jax.process_count() == 1:
        return [data]
    lengths = np.asarray(multihost_utils.process_allgather(np.int32(len(data)))).reshape(-1)
    padded = np.frombuffer(data.ljust(max(int(lengths.max()), 1), b"\0"), np.uint8)
    gathered = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(lengths), -1)
    return [row[:n].tobytes() for row, n in zip(gathered, lengths, strict=True)]


class LocalCheckpoints:
    """The node-local tier of a run (one per process)."""

    def __init__(self, config: Config, abstract_state: Any):
        self.root = Path(config.local_checkpoint_directory) / config.run_name
        self.me = jax.process_index()
        self.directory = self.root / f"process-{self.me}"
        self.layout = Layout.of(jax.tree.leaves(abstract_state))
        hosts = [zlib.crc32(name) for name in allgather_bytes(socket.gethostname().encode())]
        # processes on one machine count as nodes of their own (placement.py): each reads only its own directory
        self.one_machine = len(set(hosts)) == 1
        if len({len(d) for d in self.layout.process_devices}) > 1:  # transfers pair devices one to one
            self.placement = Placement("none", list(range(len(hosts))), [frozenset()] * len(hosts))
        else:
            self.placement = place(self.layout, hosts)
        if self.placement.mode == "none" and self.layout.processes > 1:
            warn(
                "node-local checkpoints have no copy on another process: a lost node's blocks come from the persistent tier"
            )
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="local-checkpoint")
        self.pending: Future | None = None

    # ---------------------------------------------------------------- saving

    def save(self, step: int, state: Any, data_state: dict | None) -> None:
        """Copy this process's blocks to the host, send its backup the copy it lacks, and write both
        in the background (returns before the write finishes)."""
        self.wait()  # one save at a time
        leaves = jax.tree.leaves(state)
        own: dict[Block, np.ndarray] = {}
        for k, leaf in enumerate(leaves):
            for shard in leaf.addressable_shards:
                block = (k, block_index(shard.index, leaf.shape))
                if block not in own:
                    own[block] = np.array(shard.data)  # a copy: the next step donates the buffer
        copies = self._receive_copies(own)
        data = allgather_bytes(json.dumps(data_state or {}).encode())
        sources = {self.me: (own, data[self.me])}
        for source, blocks in copies.items():
            sources[source] = (blocks, data[source])
        self.pending = self.worker.submit(self._write, step, sources)

    def _receive_copies(self, own: dict[Block, np.ndarray]) -> dict[int, dict[Block, bytes]]:
        """Peer mode: each process's blocks that its backup lacks, sent to the backup; returns the
        copies this process keeps, by source."""
        placement, layout = self.placement, self.layout
        if placement.mode != "peer":
            return {}
        sources = placement.copy_sources(self.me)
        copies: dict[int, dict[Block, bytes]] = {q: {} for q in sources}
        pairs = [
            (src, dst)
            for p, b in enumerate(placement.backup)
            if b != p
            for src, dst in zip(layout.process_devices[p], layout.process_devices[b], strict=True)
        ]
        for k in range(len(layout.shapes)):
            if not any(block[0] == k for blocks in placement.copies for block in blocks):
                continue  # every backup already holds this array's blocks
            length = self._row_length(k)
            mine = layout.process_devices[self.me]
            rows = {d: own[(k, i)].tobytes() for d, i in zip(mine, layout.slots(self.me, k), strict=True)}
            received = send_rows(layout.devices, rows, pairs, length)
            for q in sources:
                for d, i in zip(mine, layout.slots(q, k), strict=True):
                    block = (k, i)
                    if block in placement.copies[q]:
                        copies[q][block] = received[d][: self._nbytes(block)]
        return copies

    def _nbytes(self, block: Block) -> int:
        return int(np.prod(self.layout.block_shape(block))) * np.dtype(self.layout.dtypes[block[0]]).itemsize

    def _row_length(self, leaf: int) -> int:
        return max(self._nbytes((leaf, i)) for i in self.layout.device_index[leaf])

    def _write(self, step: int, sources: dict[int, tuple[dict[Block, Any], bytes]]) -> None:
        final = self.directory / str(step)
        partial = self.directory / f"{step}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        for source, (blocks, data) in sources.items():
            entry = partial / f"process-{source}"
            entry.mkdir(parents=True)
            manifest, offset = [], 0
            with open(entry / "blocks.bin", "wb") as f:
                for (k, index), value in sorted(blocks.items()):
                    raw = value.tobytes() if isinstance(value, np.ndarray) else value
                    f.write(raw)
                    manifest.append([k, [list(pair) for pair in index], offset, len(raw)])
                    offset += len(raw)
            (entry / "data.json").write_bytes(data)
            info = {"step": step, "source": source, "writer": self.me, "fingerprint": self.layout.fingerprint}
            (entry / "manifest.json").write_text(json.dumps({**info, "blocks": manifest}))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        for old in self.steps()[:-LOCAL_STEPS_KEPT]:
            shutil.rmtree(self.directory / str(old), ignore_errors=True)

    def steps(self) -> list[int]:
        """This process's complete local steps, oldest first."""
        if not self.directory.is_dir():
            return []
        return sorted(int(p.name) for p in self.directory.iterdir() if _STEP.match(p.name))

    def wait(self) -> None:
        """Block until the started write is on disk (raises what it raised)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()

    def close(self) -> None:
        self.wait()
        self.worker.shutdown()

    # ---------------------------------------------------------------- restoring

    def _found(self) -> dict[Entry, Path]:
        """Every complete save of this layout on this process's storage: its own and copies, and
        those another process on its node wrote (a node keeps what its earlier processes wrote)."""
        found = {}
        if not self.root.is_dir():
            return found
        for writer_dir in self.root.iterdir():
            if not (writer := _SOURCE.match(writer_dir.name)):
                continue
            if self.one_machine and writer_dir != self.directory:
                continue
            for step_dir in (p for p in writer_dir.iterdir() if _STEP.match(p.name)):
                for entry in step_dir.iterdir():
                    if not (source := _SOURCE.match(entry.name)):
                        continue
                    try:
                        info = json.loads((entry / "manifest.json").read_text())
                    except (OSError, ValueError):
                        continue
                    if info.get("fingerprint") == self.layout.fingerprint:
                        found[(int(step_dir.name), int(source.group(1)), int(writer.group(1)))] = entry
        return found

    def newest(self) -> tuple[int, list[int]] | None:
        """(the newest step whose blocks are all held somewhere, the holder of each process's), the
        same on every process; None when no step is (a collective)."""
        found = self._found()
        every = allgather_bytes(json.dumps(sorted(found)).encode())
        entries = {h: {tuple(e) for e in json.loads(raw)} for h, raw in enumerate(every)}
        for step in sorted({e[0] for found in entries.values() for e in found}, reverse=True):
            if (chosen := holders(self.layout, entries, step)) is not None:
                return step, chosen
        return None

    def restore(self, step: int, chosen: list[int], abstract_state: Any) -> Restored | None:
        """The state and this process's data-iterator state at ``step``, each process's blocks read
        by its holder ``chosen[p]`` and sent to it when that is another process; None on every
        process when any read fails (a collective)."""
        layout, me = self.layout, self.me
        served = [p for p, h in enumerate(chosen) if h == me]
        try:
            blocks, data = self._read(step, served)
            ok = True
        except (OSError, ValueError, KeyError) as err:
            warn(f"node-local checkpoint {step} is unreadable ({err}); using the persistent tier", everywhere=True)
            blocks, data, ok = {}, {}, False
        if not all(raw == b"1" for raw in allgather_bytes(b"1" if ok else b"0")):
            return None
        states = allgather_bytes(json.dumps({str(p): data[p] for p in served if p != me}).encode())
        my_data = data[me] if chosen[me] == me else json.loads(states[chosen[me]])[str(me)]
        mine = {b: blocks[b] for b in layout.own(me)} if chosen[me] == me else {}
        waiting = [p for p, h in enumerate(chosen) if h != p]
        if waiting and me == 0:
            moved = ", ".join(f"process {p}'s blocks from process {chosen[p]}'s storage" for p in waiting)
            print(f"node-local step {step}: {moved}", flush=True)
        while waiting:  # rounds in which each holder sends to one process
            senders: dict[int, int] = {}
            for p in waiting:
                senders.setdefault(chosen[p], p)
            now = set(senders.values())
            waiting = [p for p in waiting if p not in now]
            mine |= self._receive(blocks, senders)
        leaves, treedef = jax.tree.flatten(abstract_state)
        arrays = []
        for k, leaf in enumerate(leaves):
            dtype = np.dtype(layout.dtypes[k])
            parts = [
                jax.device_put(
                    np.frombuffer(mine[(k, i)], dtype).reshape(layout.block_shape((k, i))), layout.devices[d]
                )
                for d, i in zip(layout.process_devices[me], layout.slots(me, k), strict=True)
            ]
            arrays.append(jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, parts))
        path = self.directory / str(step)
        return Restored(step, jax.tree.unflatten(treedef, arrays), json.loads(my_data) or None, path)

    def _read(self, step: int, served: list[int]) -> tuple[dict[Block, bytes], dict[int, str]]:
        """The blocks of the processes this process serves, and their data states, from its storage."""
        entries = {e: path for e, path in self._found().items() if e[0] == step}
        needed = frozenset().union(*(self.layout.own(p) for p in served)) if served else frozenset()
        blocks: dict[Block, bytes] = {}
        data: dict[int, str] = {}
        for (_, source, _), path in sorted(entries.items()):
            if source in served and source not in data:
                data[source] = (path / "data.json").read_text()
            manifest = json.loads((path / "manifest.json").read_text())["blocks"]
            wanted = [(k, tuple(map(tuple, index)), offset, n) for k, index, offset, n in manifest]
            wanted = [w for w in wanted if w[:2] in needed and w[:2] not in blocks]
            if wanted:
                with open(path / "blocks.bin", "rb") as f:
                    for k, index, offset, n in wanted:
                        f.seek(offset)
                        raw = f.read(n)
                        if len(raw) != n or n != self._nbytes((k, index)):
                            raise ValueError(f"{path / 'blocks.bin'} is truncated")
                        blocks[(k, index)] = raw
        missing = needed - blocks.keys()
        if missing or any(p not in data for p in served):
            raise KeyError(f"step {step} lacks {len(missing)} blocks here")
        return blocks, data

    def _receive(self, blocks: dict[Block, bytes], senders: dict[int, int]) -> dict[Block, bytes]:
        """One round: each holder in ``senders`` sends the process it names all its blocks; returns
        the blocks this process received."""
        layout, me = self.layout, self.me
        pairs = [
            (src, dst)
            for holder, p in senders.items()
            for src, dst in zip(layout.process_devices[holder], layout.process_devices[p], strict=True)
        ]
        target = senders.get(me)
        received: dict[Block, bytes] = {}
        for k in range(len(layout.shapes)):
            mine = layout.process_devices[me]
            rows = {d: b"" for d in mine}
            if target is not None:
                for d, i in zip(mine, layout.slots(target, k), strict=True):
                    rows[d] = blocks[(k, i)]
            got = send_rows(layout.devices, rows, pairs, self._row_length(k))
            if me in senders.values():
                for d, i in zip(mine, layout.slots(me, k), strict=True):
                    received[(k, i)] = got[d][: self._nbytes((k, i))]
        return received
