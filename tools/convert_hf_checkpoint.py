"""Convert a Hugging Face DeepSeek-V3 checkpoint (config.json + safetensors, bf16 or FP8) to ours.

    python tools/convert_hf_checkpoint.py --hf_path DeepSeek-V3/ --output_path converted/
    python -m MaxText.train converted/config.yml load_parameters_path=converted/ ...

Writes ``<output_path>/config.yml`` (the architecture as config keys, the extra yml of a run) and
``<output_path>/state/`` (an Orbax checkpoint of the parameters and the MoE correction biases).
Tensors stream one at a time (see ``MaxText/hf/convert.py`` for the memory figures). Bad input
(no config.json or weights, an unsupported model type, missing, unexpected or misshapen tensors)
exits with code 2 and one line naming it.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # shapes and host arrays only

from MaxText.hf import HFCheckpointError  # noqa: E402
from MaxText.hf.convert import convert  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--hf_path", required=True, metavar="DIR", help="Folder with the checkpoint's config.json and *.safetensors."
    )
    parser.add_argument(
        "--output_path", required=True, metavar="DIR", help="Folder to write config.yml and state/ into."
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="Parameter dtype written (default: %(default)s).",
    )
    args = parser.parse_args(argv)
    try:
        out = convert(args.hf_path, args.output_path, args.dtype)
    except HFCheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"converted to {out}: config.yml, state/")
    print(f"continue training with: python -m MaxText.train {out / 'config.yml'} load_parameters_path={out}")


if __name__ == "__main__":
    main()
