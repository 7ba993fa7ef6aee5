"""Export one of our checkpoints as a Hugging Face DeepSeek-V3 folder that transformers loads.

    python tools/export_hf_checkpoint.py --checkpoint outputs/my-run/checkpoints/2000 --output_path hf/
    python tools/export_hf_checkpoint.py --checkpoint converted/ --output_path hf/ --dtype float32
    python tools/export_hf_checkpoint.py --checkpoint ... --output_path hf/ --dtype fp8   # DeepSeek's FP8 format

``--checkpoint`` is a training step directory or a converted checkpoint; the model's config is
the one saved with it. Writes config.json and safetensors shards (``--max_shard_gb`` each, with
model.safetensors.index.json when there are several). One stacked leaf is held at a time (see
``MaxText/hf/export.py``). Bad input exits with code 2 and one line naming it.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # host arrays only

from MaxText.checkpointing import CheckpointError  # noqa: E402
from MaxText.hf import HFCheckpointError  # noqa: E402
from MaxText.hf.export import export  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="a training step directory or a converted checkpoint")
    parser.add_argument("--output_path", required=True, help="folder to write config.json and *.safetensors into")
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32", "fp8"],
        help="weight dtype written; fp8: DeepSeek's released format (E4M3 linear layers with 128 x 128 scales)",
    )
    parser.add_argument("--max_shard_gb", type=float, default=5.0, help="largest safetensors file, in GB")
    args = parser.parse_args(argv)
    try:
        out = export(args.checkpoint, args.output_path, args.dtype, int(args.max_shard_gb * 1e9))
    except (HFCheckpointError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"exported to {out}: config.json and safetensors")


if __name__ == "__main__":
    main()
