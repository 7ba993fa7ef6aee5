"""Blocks of the train state moved between processes over the devices' own links (NVLink and the
network on GPUs, gloo on CPU), as one collective permute per array.

Each device contributes one row: the bytes of the block it sends, padded to the longest row. Row
``src`` goes to device ``dst`` for each pair; a device that is no pair's destination receives
zeros. Every process must call with the same pairs and row length (a collective).
"""

from functools import cache

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXIS = "devices"


@cache
def _permute(devices: tuple, pairs: tuple[tuple[int, int], ...]):
    mesh = Mesh(np.array(devices), (AXIS,))
    spec = PartitionSpec(AXIS)
    moved = jax.shard_map(lambda rows: jax.lax.ppermute(rows, AXIS, pairs), mesh=mesh, in_specs=spec, out_specs=spec)
    return mesh, NamedSharding(mesh, spec), jax.jit(moved)


def send_rows(devices: list, rows: dict[int, bytes], pairs: list[tuple[int, int]], length: int) -> dict[int, bytes]:
    """Send this process's ``rows`` (position in ``devices`` -> at most ``length`` bytes; each of its
    devices has one, empty when it sends nothing) along ``pairs`` of positions; returns the
    ``length`` bytes each of its devices received, or nothing where none was sent to it."""
    length = max(length, 1)
    mesh, sharding, moved = _permute(tuple(devices), tuple(sorted(pairs)))
    local = sorted(rows)
    shards = [jax.device_put(np.frombuffer(rows[i].ljust(length, b"\0"), np.uint8)[None], devices[i]) for i in local]
    with jax.set_mesh(mesh):  # its own mesh, inside the training's
        out = moved(jax.make_array_from_single_device_arrays((len(devices), length), sharding, shards))
    position = {d.id: i for i, d in enumerate(devices)}
    received = {position[s.device.id]: np.asarray(s.data)[0].tobytes() for s in out.addressable_shards}
    destinations = {dst for _, dst in pairs}
    return {i: (received[i] if i in destinations else b"") for i in local}
