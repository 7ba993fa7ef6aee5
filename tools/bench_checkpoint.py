"""How much a checkpoint save slows the training step it overlaps, asynchronous against synchronous.

    python tools/bench_checkpoint.py                    # deepseek3-tiny, synthetic data
    python tools/bench_checkpoint.py model_name=deepseek3-small --rounds 3

Arguments other than the flags are config arguments, as for training. In one process: the jitted
training step (state donated, as in the loop) is timed alone ``--rounds`` times; then, each round,
a save of the current state is started and the next step runs, timed from the save call to the
step's result (what the loop waits for), once with ``async_checkpointing=true`` and once with
``false``; each write is then waited for, untimed. Printed: the fastest of each, and the ratios
``step during an async save / step alone`` (the loop's cost of checkpointing) and the same for a
synchronous save. Then the node-local tier (``enable_emergency_checkpoint``) at a
``local_checkpoint_period`` of 2: pairs of steps, alternately alone and with a local save after
the first (as the loop saves it: the host copy on the step's path, the write in the background,
the next save waiting for the last), each pair timed to its second step's result; printed: the
median pair with a save over the median pair alone. Checkpoints go to a temporary directory.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402

from MaxText.checkpointing import Checkpoints  # noqa: E402
from MaxText.checkpointing.local import LocalCheckpoints  # noqa: E402
from MaxText.config import load_config_or_exit  # noqa: E402
from MaxText.data.source import make_data_source  # noqa: E402
from MaxText.models.deepseek import DeepSeekV3  # noqa: E402
from MaxText.parallel.mesh import make_mesh  # noqa: E402
from MaxText.parallel.sharding import axis_rules, batch_sharding, put_global_batch  # noqa: E402
from MaxText.train.optimizer import make_optimizer  # noqa: E402
from MaxText.train.state import create_train_state  # noqa: E402
from MaxText.train.step import jit_train_step  # noqa: E402


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="*", help="Config arguments as for training ([extra.yml ...] key=value ...).")
    parser.add_argument(
        "--rounds", type=int, default=7, help="Timed steps per case; the fastest is reported (default: %(default)s)."
    )
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    config = load_config_or_exit(["dataset_type=synthetic", "run_name=bench-checkpoint", *args.config])
    config = config.with_platform(jax.devices()[0].platform)
    mesh = make_mesh(config)
    model, optimizer = DeepSeekV3(config), make_optimizer(config)
    state, shardings = create_train_state(model, config, optimizer, mesh)
    batches = batch_sharding(mesh, config)
    step_fn = jit_train_step(model, config, optimizer, shardings, batches)
    data = make_data_source(config, config.global_batch_size(len(jax.devices())), 0, 1)
    times: dict[str, list[float]] = {"step alone": [], "step during async save": [], "step during sync save": []}

    with tempfile.TemporaryDirectory() as tmp, jax.set_mesh(mesh), nn.logical_axis_rules(axis_rules(config)):
        savers = {
            mode: Checkpoints(Path(tmp) / mode, config.model_copy(update={"async_checkpointing": mode == "async"}))
            for mode in ("async", "sync")
        }

        def step(save_to: Checkpoints | None, number: int) -> float:
            nonlocal state
            batch = put_global_batch(next(data), batches)
            start = time.perf_counter()
            if save_to is not None:
                save_to.save(number, state, data.get_state(), config)
            state, metrics = step_fn(state, batch)
            jax.block_until_ready(metrics)
            elapsed = time.perf_counter() - start
            if save_to is not None:
                save_to.wait()
            return elapsed

        step(None, 0)  # compile
        for number in range(1, args.rounds + 1):
            times["step alone"].append(step(None, number))
            times["step during async save"].append(step(savers["async"], number))
            times["step during sync save"].append(step(savers["sync"], number))
        for saver in savers.values():
            saver.close()

        local_config = config.model_copy(update={"local_checkpoint_directory": str(Path(tmp) / "local")})
        local = LocalCheckpoints(local_config, state)
        pairs: dict[str, list[float]] = {"pair alone": [], "pair with a local save": []}

        def pair(number: int, save: bool) -> float:
            nonlocal state
            start = time.perf_counter()
            for offset in (0, 1):
                batch = put_global_batch(next(data), batches)
                state, metrics = step_fn(state, batch)
                if save and offset == 0:
                    local.save(number, state, data.get_state())
            jax.block_until_ready(metrics)
            return time.perf_counter() - start

        for number in range(1, 2 * args.rounds + 1):
            pairs["pair alone"].append(pair(number, False))
            pairs["pair with a local save"].append(pair(number, True))
        local.close()

    fastest = {name: min(values) for name, values in times.items()}
    size = sum(leaf.nbytes for leaf in jax.tree.leaves(state)) / 1e6
    print(f"{config.model_name}: train state {size:.1f} MB, fastest of {args.rounds} rounds")
    for name, seconds in fastest.items():
        print(f"  {name:24s} {seconds * 1e3:8.1f} ms")
    alone = fastest["step alone"]
    print(f"step during an async save / step alone: {fastest['step during async save'] / alone:.2f}x")
    print(f"step during a sync save / step alone:   {fastest['step during sync save'] / alone:.2f}x")
    median = {name: statistics.median(values) for name, values in pairs.items()}
    print(f"node-local saves every 2 steps, median of {2 * args.rounds} pairs of steps:")
    for name, seconds in median.items():
        print(f"  {name:24s} {seconds * 1e3:8.1f} ms")
    print(
        f"steps with a local save every 2 / steps alone: {median['pair with a local save'] / median['pair alone']:.3f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
