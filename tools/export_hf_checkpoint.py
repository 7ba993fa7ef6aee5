"""Export one of our checkpoints as a Hugging Face DeepSeek-V3 folder that transformers loads.

    python tools/export_hf_checkpoint.py --checkpoint outputs/my-run --output_path hf/      # its newest step
    python tools/export_hf_checkpoint.py --checkpoint outputs/my-run/checkpoints/2000 --output_path hf/
    python tools/export_hf_checkpoint.py --checkpoint converted/ --output_path hf/ --dtype float32
    python tools/export_hf_checkpoint.py --checkpoint ... --output_path hf/ --dtype fp8   # DeepSeek's FP8 format
    python tools/export_hf_checkpoint.py --checkpoint ... --output_path hf/ --tokenizer DeepSeek-V3/

``--checkpoint`` is a run folder or its ``checkpoints/`` folder (the newest complete step is taken,
and a line names it), a training step directory, or a converted checkpoint; the model's config
is the one saved with it. Writes config.json, safetensors shards (``--max_shard_gb`` each, with
model.safetensors.index.json when there are several) and the run's tokenizer (tokenizer.json and
tokenizer_config.json: the byte tokenizer rebuilt as a fast tokenizer, a tokenizer.json copied;
a SentencePiece model is refused, see ``MaxText/hf/tokenizer.py``), so that
``AutoTokenizer.from_pretrained`` and ``AutoModelForCausalLM.from_pretrained`` both load the
folder. One stacked leaf is held at a time (see ``MaxText/hf/export.py``). Bad input exits with
code 2 and one line naming it, before anything is written.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # host arrays only

from MaxText.checkpointing import CheckpointError  # noqa: E402
from MaxText.hf import HFCheckpointError  # noqa: E402
from MaxText.hf.export import export  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--checkpoint",
        required=True,
        metavar="PATH",
        help="A run folder or its checkpoints/ folder (the newest complete step is taken), a training step "
        "directory, or a converted checkpoint.",
    )
    parser.add_argument(
        "--output_path",
        required=True,
        metavar="DIR",
        help="Folder to write config.json, the safetensors and the tokenizer into.",
    )
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32", "fp8"],
        help="Weight dtype written; fp8 is DeepSeek's released format, E4M3 linear layers with 128 x 128 scales "
        "(default: %(default)s).",
    )
    parser.add_argument(
        "--max_shard_gb", type=float, default=5.0, help="Largest safetensors file, in GB (default: %(default)s)."
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="A Hugging Face tokenizer (a tokenizer.json, or a folder holding one and its tokenizer_config.json) "
        "to write instead of the run's, whatever the run's tokenizer type; 'none' writes no tokenizer "
        "(default: the run's tokenizer, from its saved config).",
    )
    args = parser.parse_args(argv)
    try:
        out = export(
            args.checkpoint,
            args.output_path,
            args.dtype,
            int(args.max_shard_gb * 1e9),
            tokenizer=args.tokenizer,
            log=lambda line: print(line, flush=True),
        )
    except (HFCheckpointError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"exported to {out}: {', '.join(written(out))}")


def written(folder: Path) -> list[str]:
    """The folder's files, the safetensors shards counted rather than named."""
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    shards = [n for n in names if n.endswith(".safetensors")]
    others = [n for n in names if n not in shards]
    return [*others, f"{len(shards)} safetensors file{'s' if len(shards) > 1 else ''}"]


if __name__ == "__main__":
    main()
