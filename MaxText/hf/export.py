"""Our checkpoint -> a Hugging Face DeepSeek-V3 folder (config.json + safetensors shards).

The reverse of ``convert``: every HF tensor is a slot of one of our leaves, laid back out
(``weights.to_hf``). Each slot is read on its own from the checkpoint's tensorstore arrays
(training checkpoints are OCDBT, converted ones plain zarr; ``checkpoint_io.LeafReader``) and the
shards are written tensor by tensor, so peak host memory is about one HF tensor in float32, a
laid-out copy and the output dtype's copy, never a stacked leaf: ~11 GB for the 671B's embedding
or head. The MTP modules' copies of the embedding and head are written too, as in the release.
Correction biases stay float32, as transformers keeps them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import ml_dtypes
import numpy as np
from tqdm import tqdm

from MaxText.hf import HFCheckpointError
from MaxText.hf.checkpoint_io import LeafReader, checkpoint_config
from MaxText.hf.config_map import hf_config
from MaxText.hf.safetensors_io import INDEX_FILE, write_safetensors
from MaxText.hf.weights import abstract_variables, hf_shape, hf_table, leaves, mtp_copies, to_hf
from MaxText.moe.block import BIAS

DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32)}


def export(
    checkpoint: str | Path,
    output_path: str | Path,
    dtype: str = "bfloat16",
    max_shard_bytes: int = 5 * 10**9,
    progress: bool = True,
) -> Path:
    out = Path(output_path)
    config = checkpoint_config(checkpoint).with_platform("cpu")
    hf = hf_config(config, dtype)
    abstract = abstract_variables(config)
    shapes = leaves(abstract)
    reader = LeafReader(checkpoint)
    missing = [leaf for leaf in shapes if leaf[0] == "params" and not reader.has(leaf)]
    if missing:
        raise HFCheckpointError(f"checkpoint {checkpoint} lacks {'/'.join(missing[0])} ({len(missing)} leaves missing)")

    # (HF name, leaf, index, layout) in HF order (layer by layer), so shards hold whole layers.
    entries = [(name, s.leaf, s.index, s.layout) for name, s in hf_table(config, abstract).items()]
    for name, leaf in mtp_copies(config).items():
        entries.append((name, leaf, (), "T" if leaf[-1] == "output_head" else "same"))

    def out_dtype(leaf) -> np.dtype:
        return np.dtype(np.float32) if leaf[0] == BIAS else DTYPES[dtype]

    sizes = []
    for name, leaf, index, layout in entries:
        shape = hf_shape(shapes[leaf].shape[len(index) :], layout)
        sizes.append((name, shape, out_dtype(leaf)))
    shards: list[list[int]] = [[]]
    used = 0
    for i, (_, shape, dt) in enumerate(sizes):
        size = math.prod(shape) * dt.itemsize
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(i)
        used += size

    out.mkdir(parents=True, exist_ok=True)

    def slot(leaf, index) -> np.ndarray:
        if reader.has(leaf):
            return reader.read(leaf, index)
        return np.zeros(shapes[leaf].shape[len(index) :], np.float32)  # a parameters-only checkpoint: no biases

    bar = tqdm(total=len(entries), desc="export", unit="tensor", disable=not progress, dynamic_ncols=True)
    weight_map = {}
    for number, shard in enumerate(shards, 1):
        file = "model.safetensors" if len(shards) == 1 else f"model-{number:05d}-of-{len(shards):05d}.safetensors"

        def tensors(shard=shard):
            for i in shard:
                name, leaf, index, layout = entries[i]
                bar.update()
                yield name, to_hf(slot(leaf, index), layout).astype(sizes[i][2])

        write_safetensors(out / file, {sizes[i][0]: (sizes[i][1], sizes[i][2]) for i in shard}, tensors())
        weight_map.update({sizes[i][0]: file for i in shard})
    bar.close()
    if len(shards) > 1:
        total = sum(math.prod(shape) * dt.itemsize for _, shape, dt in sizes)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    return out
