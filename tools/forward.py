"""Logits of a checkpoint on given token ids, for parity checks and debugging.

    python tools/forward.py --checkpoint converted/ --input_ids ids.npy --output logits.npy --dtype float32
    python tools/forward.py --checkpoint outputs/my-run --input_ids ids.npy --output logits.npy

``--checkpoint`` is a converted checkpoint, a training step directory, or a run folder (or its
checkpoints/ folder), which gives its newest complete step, as for the export tool.

``--input_ids`` is a [batch, length] integer array (.npy); ``--output`` gets the main head's
logits [batch, length, vocab] as float32. Positions are 0..length-1 and every row is one
document (causal attention over the whole row). The MoE correction biases of the checkpoint are
used (they decide the routing). Runs on one device of whatever JAX finds.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np


def forward_logits(checkpoint: str | Path, input_ids: np.ndarray, dtype: str | None = None) -> np.ndarray:
    import jax
    import jax.numpy as jnp

    from MaxText.hf.checkpoint_io import checkpoint_config, resolve_checkpoint, restore_variables
    from MaxText.hf.weights import abstract_variables
    from MaxText.models.deepseek import DeepSeekV3
    from MaxText.moe.block import LOAD, LOSS

    checkpoint, _ = resolve_checkpoint(checkpoint)
    overrides = [f"dtype={dtype}"] if dtype else []
    config = checkpoint_config(checkpoint, *overrides).with_platform(jax.devices()[0].platform)
    variables = restore_variables(checkpoint, config, abstract_variables(config))
    tokens = jnp.asarray(input_ids, jnp.int32)
    B, S = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    model = DeepSeekV3(config)
    apply = jax.jit(lambda v, t, p, s: model.apply(v, t, p, s, mutable=[LOAD, LOSS])[0].logits_BSV)
    return np.asarray(apply(variables, tokens, positions, jnp.ones((B, S), jnp.int32)), np.float32)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--checkpoint",
        required=True,
        help="A converted checkpoint, a training step directory, or a run folder (its newest complete step).",
    )
    parser.add_argument("--input_ids", required=True, help="A .npy file of [batch, length] integer token ids.")
    parser.add_argument(
        "--output", required=True, help="The .npy file to write the [batch, length, vocab] float32 logits to."
    )
    parser.add_argument("--dtype", default=None, help="Activation dtype (default: the checkpoint config's).")
    args = parser.parse_args(argv)

    from MaxText.checkpointing import CheckpointError
    from MaxText.hf import HFCheckpointError

    try:
        ids = np.load(args.input_ids)
    except (OSError, ValueError) as err:
        print(f"error: --input_ids {args.input_ids}: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        print(
            f"error: --input_ids must be a [batch, length] integer array, got {ids.dtype} {list(ids.shape)}",
            file=sys.stderr,
        )
        raise SystemExit(2)
    try:
        from MaxText.hf.checkpoint_io import resolve_checkpoint

        checkpoint, taken = resolve_checkpoint(args.checkpoint)
        if taken:
            print(taken)
        logits = forward_logits(checkpoint, ids, args.dtype)
    except (HFCheckpointError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    np.save(args.output, logits)
    print(f"logits {list(logits.shape)} written to {args.output}")


if __name__ == "__main__":
    main()
