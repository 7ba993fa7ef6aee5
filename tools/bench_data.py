"""Tokens per second the input pipeline delivers on one host, against what a training step consumes.

    python tools/bench_data.py                          # deepseek3-tiny on the built-in corpus
    python tools/bench_data.py grain_worker_count=0 --seconds 10
    python tools/bench_data.py dataset_type=tfds dataset_name=my_corpus dataset_path=data/

Arguments other than the flags are config arguments, as for training. Two measurements in one
run, with the same config: (1) the training data source alone, drained as fast as it goes for
``--seconds`` after its first batch (worker start-up excluded); (2) ``--steps`` real training
steps of the model reading that source, timed after compilation (the loop's own ``tokens_per_s``
over its last ``log_period`` window). Tokens are sequence slots (batch x max_target_length, as
a training step counts them); the share that is real text rather than packing padding is printed
too. The pipeline must stay well ahead (ratio >> 1) or the devices wait on data.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from MaxText.config import Config, ConfigError, load_config_or_exit  # noqa: E402


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="*", help="Config arguments as for training ([extra.yml ...] key=value ...).")
    parser.add_argument(
        "--seconds",
        type=float,
        default=5.0,
        help="Seconds to drain the pipeline for, after its first batch (default: %(default)s).",
    )
    parser.add_argument(
        "--steps", type=int, default=30, help="Training steps to run, timed after the first (default: %(default)s)."
    )
    parser.add_argument("--json", action="store_true", help="Print one JSON object instead of lines of text.")
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.steps < 2:
        parser.error("--seconds must be > 0 and --steps >= 2")
    return args


def pipeline_tokens_per_s(config: Config, rows: int, seconds: float) -> dict:
    """Drain this host's training source for ``seconds``."""
    from MaxText.data.source import make_data_source

    source = make_data_source(config, rows, 0, 1)
    next(source)  # worker start-up and the first reads are not throughput
    batches, real = 0, 0
    start = time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        batch = next(source)
        batches += 1
        real += int((batch["targets_segmentation"] != 0).sum())
    if hasattr(source, "close"):
        source.close()
    slots = batches * rows * config.max_target_length
    return {"batches": batches, "tokens_per_s": slots / elapsed, "real_token_fraction": real / max(slots, 1)}


def training_tokens_per_s(config: Config, steps: int) -> float:
    """Tokens per second of ``steps`` real training steps (the last ``log_period`` window, so compilation is out)."""
    from MaxText.data.builtin import cache_dir
    from MaxText.train.loop import train

    with tempfile.TemporaryDirectory() as out:
        window = min(config.log_period, steps - 1)
        run = config.model_copy(
            update={
                "dataset_path": str(cache_dir(config)) if config.dataset_type == "builtin" else config.dataset_path,
                "steps": steps,
                "log_period": window,
                "base_output_directory": out,
                "run_name": "bench-data",
                "enable_tensorboard": False,
                "eval_interval": 0,
            }
        )
        return train(run).final_metrics["tokens_per_s"]


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    config = load_config_or_exit(args.config)
    import jax

    config = config.with_platform(jax.devices()[0].platform)
    rows = config.global_batch_size(jax.device_count()) // jax.process_count()
    try:
        pipeline = pipeline_tokens_per_s(config, rows, args.seconds)
        training = training_tokens_per_s(config, args.steps)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    result = {
        "model_name": config.model_name,
        "dataset_type": config.dataset_type,
        "grain_worker_count": config.grain_worker_count,
        "batch": [rows, config.max_target_length],
        "pipeline_tokens_per_s": pipeline["tokens_per_s"],
        "pipeline_real_token_fraction": pipeline["real_token_fraction"],
        "training_tokens_per_s": training,
        "ratio": pipeline["tokens_per_s"] / training,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{config.model_name} on {config.dataset_type} data, batch {rows} x {config.max_target_length}, "
            f"{config.grain_worker_count} grain worker(s):"
        )
        print(
            f"  pipeline  {result['pipeline_tokens_per_s']:12,.0f} tokens/s per host "
            f"({100 * result['pipeline_real_token_fraction']:.1f}% real text, the rest packing padding)"
        )
        print(f"  training  {training:12,.0f} tokens/s ({args.steps} steps)")
        print(f"  ratio     {result['ratio']:12.1f}x  (pipeline / training)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
