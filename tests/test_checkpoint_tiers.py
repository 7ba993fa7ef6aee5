"""The node-local checkpoint tier (MaxText/checkpointing/local.py, placement.py, tiers.py): where
each process's copy goes on layouts written out by hand, which process serves whose blocks at a
restore, and a save and restore on this process's 8 devices against the state saved, bit for bit,
with the choice between the tiers. Processes killed under Slurm: tests/test_slurm_cluster.py."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from MaxText.checkpointing import Checkpoints
from MaxText.checkpointing.local import LocalCheckpoints
from MaxText.checkpointing.placement import Layout, holders, place
from MaxText.checkpointing.tiers import restore_newest
from MaxText.config import ConfigError
from tests.conftest import make_config

A, B = 101, 202  # two host names


def layout(blocks_per_process: list[list[str]], replicated: bool = True) -> Layout:
    """Processes with one device each holding the named block of a sharded leaf, and (replicated)
    a second leaf every device holds whole."""
    n = len(blocks_per_process)
    sharded = [
        ((0, 4),) if b[0] == "x" else ((4, 8),) if b[0] == "y" else ((8 + i, 9 + i),)
        for i, b in enumerate(blocks_per_process)
    ]
    device_index = [sharded] + ([[((0, 2),)] * n] if replicated else [])
    shapes = [(16,)] + ([(2,)] if replicated else [])
    return Layout(list(range(n)), [[i] for i in range(n)], device_index, shapes, ["float32"] * len(shapes), "f")


def test_data_parallel_replicas_on_other_nodes_are_each_others_copy():
    """Processes 0 and 2 hold the same blocks, 1 and 3 the same, on nodes A A B B: each one's
    replica on the other node is its backup and nothing is sent."""
    placement = place(layout([["x"], ["y"], ["x"], ["y"]]), [A, A, B, B])
    assert placement.mode == "replica"
    assert placement.backup == [2, 3, 0, 1]
    assert all(not copies for copies in placement.copies)


def test_without_replicas_each_process_copies_to_the_next_node():
    """Every process holds its own block (fsdp over all of them), two per node: process p's backup
    is p + 2 on the other node, and it sends only the blocks the backup lacks (not the replicated leaf)."""
    placement = place(layout([["a"], ["b"], ["c"], ["d"]]), [A, A, B, B])
    assert (placement.mode, placement.backup) == ("peer", [2, 3, 0, 1])
    assert placement.copies[0] == {(0, ((8, 9),))}
    assert placement.copy_sources(2) == [0]


def test_a_replica_on_the_same_node_is_no_copy():
    """Replicas 0 and 1 share node A and 2 and 3 node B: a replica on the same node would be lost
    with it, so each process copies to the next node instead."""
    placement = place(layout([["x"], ["x"], ["y"], ["y"]]), [A, A, B, B])
    assert (placement.mode, placement.backup) == ("peer", [2, 3, 0, 1])
    assert placement.copies[0] == {(0, ((0, 4),))}


def test_processes_on_one_machine_count_as_nodes_and_one_process_has_no_copy():
    assert place(layout([["a"], ["b"]]), [A, A]).backup == [1, 0]
    assert place(layout([["a"]]), [A]).mode == "none"


def test_a_lost_processs_blocks_come_from_whoever_holds_them():
    """Two processes, each holding its block and the other's copy. Each serves itself while its
    own save is there; with process 1's storage gone, process 0 serves both; a step missing from
    both, or a copy without its writer's own blocks, is nowhere complete."""
    lay = layout([["a"], ["b"]])
    saved = {0: {(4, 0, 0), (4, 1, 0), (2, 0, 0), (2, 1, 0)}, 1: {(4, 1, 1), (4, 0, 1), (2, 1, 1), (2, 0, 1)}}
    assert holders(lay, saved, 4) == [0, 1]
    assert holders(lay, {0: saved[0], 1: set()}, 4) == [0, 0]
    assert holders(lay, {0: set(), 1: set()}, 4) is None
    assert holders(lay, {0: {(4, 1, 0)}, 1: set()}, 4) is None  # process 0's copy needs its own blocks beside it
    assert holders(lay, saved, 6) is None


def test_emergency_checkpoints_need_a_directory_and_the_persistent_tier():
    with pytest.raises(ConfigError, match="local_checkpoint_directory"):
        make_config("enable_emergency_checkpoint=true")
    with pytest.raises(ConfigError, match="enable_emergency_checkpoint"):
        make_config("enable_emergency_checkpoint=true", "local_checkpoint_directory=/x", "enable_checkpointing=false")


def _state(mesh, seed: int) -> dict:
    """A small train-state-like tree: sharded float32 and bfloat16 arrays, a replicated scalar."""
    rng = np.random.default_rng(seed)
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    return {
        "w": put(rng.standard_normal((16, 8)).astype(np.float32), P("fsdp", "expert")),
        "b": put(jnp.asarray(rng.standard_normal(8), jnp.bfloat16), P("expert")),
        "step": put(np.int32(seed), P()),
    }


def _abstract(state: dict) -> dict:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def _same(a: dict, b: dict) -> bool:
    return all(
        x.dtype == y.dtype and x.sharding == y.sharding and np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def test_local_saves_restore_bit_for_bit_and_the_newest_tier_wins(tmp_path):
    """On a 4 x 2 mesh of this process's devices: local saves of steps 2, 4 and 6 keep the newest
    two and restore step 6 exactly (data-iterator state included); the persistent tier's step 4
    loses to it, its step 8 wins; a truncated block file sends the restore to the persistent tier."""
    config = make_config(
        "run_name=tiers",
        f"base_output_directory={tmp_path}",
        "enable_emergency_checkpoint=true",
        f"local_checkpoint_directory={tmp_path / 'local'}",
        "async_checkpointing=false",
    )
    mesh = jax.make_mesh((4, 2), ("fsdp", "expert"))
    states = {step: _state(mesh, step) for step in (2, 4, 6, 8)}
    abstract = _abstract(states[2])
    local = LocalCheckpoints(config, abstract)
    assert local.placement.mode == "none"
    for step in (2, 4, 6):
        local.save(step, states[step], {"step": step})
    local.wait()
    assert local.steps() == [4, 6]
    manifest = json.loads((local.directory / "6" / "process-0" / "manifest.json").read_text())
    assert len(manifest["blocks"]) == 8 + 2 + 1  # every block once: w's 8, b's 2, the scalar

    persistent = Checkpoints(tmp_path / "checkpoints", config)
    persistent.save(4, states[4], {"step": 4}, config)
    persistent.wait()
    restored = restore_newest(persistent, local, abstract)
    assert (restored.step, restored.data_state) == (6, {"step": 6}) and _same(restored.state, states[6])
    assert restored.path == local.directory / "6"

    persistent.save(8, states[8], {"step": 8}, config)
    persistent.wait()
    restored = restore_newest(persistent, local, abstract)
    assert restored.step == 8 and _same(restored.state, states[8])

    blocks = local.directory / "6" / "process-0" / "blocks.bin"
    blocks.write_bytes(blocks.read_bytes()[:-4])
    assert local.restore(6, [0], abstract) is None
    persistent.close()
    local.close()


def test_a_save_of_another_layout_is_not_read(tmp_path):
    """The same run on another mesh: its local saves do not match the layout and are not offered."""
    config = make_config(
        "run_name=layout", "enable_emergency_checkpoint=true", f"local_checkpoint_directory={tmp_path}"
    )
    state = _state(jax.make_mesh((4, 2), ("fsdp", "expert")), 1)
    local = LocalCheckpoints(config, _abstract(state))
    local.save(2, state, {})
    local.close()
    other = _state(jax.make_mesh((2, 4), ("fsdp", "expert")), 1)
    assert LocalCheckpoints(config, _abstract(other)).newest() is None
    assert LocalCheckpoints(config, _abstract(state)).newest() == (2, [0])


def test_checkpoint_cost_follows_youngs_rule_and_loses_half_a_period():
    """tools/checkpoint_cost.py's model on round numbers: 8 TB of state over 1,024 GPUs in 8
    replicas (62.5 GB per GPU), 2 s steps, the Llama 3 failure rate."""
    from MaxText.planner.checkpoints import Run, Storage, local_tier, persistent_tier, plan

    run = Run(gpus=1024, gpus_per_node=4, replicas=8, state_bytes=8e12, step_seconds=2.0)
    storage = Storage(50e9, 100e9, 10e9, 20e9, 100e9, restart_seconds=300, shared_share=0.1)
    rate = 419 / (54 * 24 * 3600 * 16_384) * 1024  # failures per second
    blocking = 62.5e9 / 100e9
    local = local_tier(run, storage, copies=False)
    assert local.period_steps == round((2 * blocking / rate) ** 0.5 / 2)  # Young: above the 13-step write
    assert (local.write_seconds, local.restore_seconds) == pytest.approx((25.0, 12.5))
    persistent = persistent_tier(run, storage)
    assert persistent.period_steps == 800  # 160 s of writing is 10% of 1,600 s
    assert local_tier(run, storage, copies=True).write_seconds == pytest.approx(50.0)  # the backup's copy beside
    two = plan(run, storage, [persistent, local])
    lost = local.period_steps * 2 / 2 + 12.5 + 300
    assert two.lost_per_failure_seconds == pytest.approx(lost)
    overhead = blocking / (800 * 2) + blocking / (local.period_steps * 2)
    assert two.goodput == pytest.approx(1 - overhead - rate * lost)
    one = plan(run, storage, [persistent])
    assert one.lost_per_failure_seconds == pytest.approx(800 + 80 + 300) and one.goodput < two.goodput
