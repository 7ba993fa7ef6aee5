"""Our checkpoint -> a Hugging Face DeepSeek-V3 folder (config.json + safetensors shards).

The reverse of ``convert``: every HF tensor is a slot of one of our leaves, laid back out
(``weights.to_hf``). Each slot is read on its own from the checkpoint's tensorstore arrays
(training checkpoints are OCDBT, converted ones plain zarr; ``checkpoint_io.LeafReader``) and the
shards are written tensor by tensor, so peak host memory is about one HF tensor in float32, a
laid-out copy and the output dtype's copy, never a stacked leaf: ~11 GB for the 671B's embedding
or head. The MTP modules' copies of the embedding and head are written too, as in the release.
Correction biases stay float32, as transformers keeps them. The run's tokenizer goes beside them
(``hf/tokenizer.py``), so ``AutoTokenizer`` and ``AutoModelForCausalLM`` both load the folder.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np
from tqdm import tqdm

from MaxText.hf import HFCheckpointError
from MaxText.hf.checkpoint_io import LeafReader, checkpoint_config, names_tokenizer, resolve_checkpoint
from MaxText.hf.config_map import hf_config
from MaxText.hf.convert import SCALE_SUFFIX
from MaxText.hf.safetensors_io import INDEX_FILE, write_safetensors
from MaxText.hf.tokenizer import hf_tokenizer
from MaxText.hf.weights import abstract_variables, hf_shape, hf_table, leaves, mtp_copies, to_hf
from MaxText.moe.block import BIAS
from MaxText.quantization.quantize import Recipe, quantize

DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32)}
# ``dtype="fp8"`` writes DeepSeek's released format: the linear layers FP8 training quantizes
# (attention projections, dense, shared and routed MLPs) as E4M3 with a float32 ``_scale_inv``
# per 128 x 128 block of the [out, in] matrix (weight = fp8 x scale_inv), everything else
# bfloat16 (the correction biases float32). The blocks are ``fp8_blockwise``'s weight blocks:
# the exported weights are the ones its forward pass multiplies.
FP8_WEIGHTS = re.compile(
    r"(self_attn\.(q_a_proj|q_b_proj|q_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
    r"|mlp\.(shared_experts\.|experts\.\d+\.)?(gate_proj|up_proj|down_proj))\.weight$"
)
FP8_BLOCK = 128


def fp8_blocks(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A 2-D weight as E4M3 values and float32 scales per FP8_BLOCK x FP8_BLOCK block (the
    product's one quantizer, ``quantization.quantize``, with the blockwise recipe)."""
    import jax.numpy as jnp

    values, scales = quantize(jnp.asarray(weight, jnp.float32), Recipe("fp8_blockwise", FP8_BLOCK), axis=(0, 1))
    return np.asarray(values), np.asarray(scales)


def export(
    checkpoint: str | Path,
    output_path: str | Path,
    dtype: str = "bfloat16",
    max_shard_bytes: int = 5 * 10**9,
    progress: bool = True,
    tokenizer: str | Path | None = None,
    log: Callable[[str], None] = lambda line: None,
) -> Path:
    """Write the folder; ``checkpoint`` may also be a run folder or its checkpoints/ folder (the
    newest complete step). ``tokenizer``: None for the run's, a Hugging Face tokenizer (a
    tokenizer.json or its folder) instead, or "none". ``log`` gets one line on the step taken
    from a run folder and one on the tokenizer."""
    out = Path(output_path)
    checkpoint, taken = resolve_checkpoint(checkpoint)
    if taken:
        log(taken)
    config = checkpoint_config(checkpoint).with_platform("cpu")
    hf = hf_config(config, "bfloat16" if dtype == "fp8" else dtype)
    hf_tok = hf_tokenizer(config, names_tokenizer(checkpoint), tokenizer, hf["max_position_embeddings"])
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

    def out_dtype(name, leaf) -> np.dtype:
        if leaf[0] == BIAS:
            return np.dtype(np.float32)
        if dtype == "fp8":
            return np.dtype(ml_dtypes.float8_e4m3fn) if FP8_WEIGHTS.search(name) else DTYPES["bfloat16"]
        return DTYPES[dtype]

    sizes = []  # (HF name, shape, dtype, entry): an FP8 weight is followed by its scales
    for i, (name, leaf, index, layout) in enumerate(entries):
        shape = hf_shape(shapes[leaf].shape[len(index) :], layout)
        sizes.append((name, shape, out_dtype(name, leaf), i))
        if sizes[-1][2] == np.dtype(ml_dtypes.float8_e4m3fn):
            blocks = tuple(math.ceil(n / FP8_BLOCK) for n in shape)
            sizes.append((name + SCALE_SUFFIX, blocks, np.dtype(np.float32), i))
    shards: list[list[int]] = [[]]
    used = 0
    for i, (name, shape, dt, _) in enumerate(sizes):
        if name.endswith(SCALE_SUFFIX):  # scales stay in their weight's shard
            shards[-1].append(i)
            continue
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
    scales: dict[str, np.ndarray] = {}  # an FP8 weight's scales, until written right after it
    for number, shard in enumerate(shards, 1):
        file = "model.safetensors" if len(shards) == 1 else f"model-{number:05d}-of-{len(shards):05d}.safetensors"

        def tensors(shard=shard):
            for i in shard:
                name, shape, dt, entry = sizes[i]
                if name in scales:
                    yield name, scales.pop(name)
                    continue
                _, leaf, index, layout = entries[entry]
                bar.update()
                value = to_hf(slot(leaf, index), layout)
                if dt == np.dtype(ml_dtypes.float8_e4m3fn):
                    value, scales[name + SCALE_SUFFIX] = fp8_blocks(value)
                yield name, value.astype(dt)

        write_safetensors(out / file, {sizes[i][0]: (sizes[i][1], sizes[i][2]) for i in shard}, tensors())
        weight_map.update({sizes[i][0]: file for i in shard})
    bar.close()
    if len(shards) > 1:
        total = sum(math.prod(shape) * dt.itemsize for _, shape, dt, _ in sizes)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2))
    if dtype == "fp8":  # what DeepSeek's release declares
        hf["quantization_config"] = {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
        }
    hf_tok.write(out)
    hf.update(hf_tok.ids)  # bos/eos/pad_token_id, which transformers' generation config is built from
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    log(hf_tok.note)
    return out
