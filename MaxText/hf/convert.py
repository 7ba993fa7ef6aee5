"""Hugging Face DeepSeek-V3 checkpoint -> our Orbax checkpoint and config overlay, streaming.

Output, in ``output_path``:
- ``config.yml``: every architecture key derived from config.json (``config_map``), usable as
  the extra yml of a run: ``python -m MaxText.train <out>/config.yml load_parameters_path=<out>``;
  and, where the folder has a ``tokenizer.json``, that tokenizer (a fine-tune must feed the
  model the ids it was trained on, and the export then writes the same tokenizer back);
- ``state/``: an Orbax checkpoint of ``{"params": ..., "moe_bias": ...}`` (the MoE correction
  biases are train state, not parameters); ``load_parameters_path=<out>`` warm-starts both.

Memory. Our stacked leaves (``moe_layers/layers/moe/wi_0`` is [58, 256, 7168, 2048] for the
671B, 872 GB in float32) never exist in memory: Orbax first writes the tree with one-element
placeholders (so its metadata is its own), then each leaf is re-created with tensorstore at its
full shape, chunked one (layer, expert) slot per chunk, and every HF tensor is written into its
slot as it is read. Peak host memory is about one HF tensor in its file dtype plus three
float32-sized copies of it (read or dequantized, laid out, and tensorstore's write buffer) on top
of the Python/JAX baseline (~270 MB). For the 671B the largest tensors are the embedding and head
(129280 x 7168: 1.85 GB in bf16, 3.7 GB in float32), so ~13 GB. Measured (docs/LOG.md): 540 MB
peak RSS converting a 665M-parameter FP8 model whose stacked expert leaves are 805 MB each.
Everything is validated (names, shapes, scales) before anything is written.

FP8: a weight stored as ``F8_E4M3`` comes with ``<name>_scale_inv`` [ceil(m/128), ceil(n/128)]
(float32); the weight is ``fp8 * scale_inv`` block by block, edge blocks partial.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
import yaml
from tqdm import tqdm

from MaxText.config import ConfigError, available_models, load_config
from MaxText.hf import HFCheckpointError
from MaxText.hf.config_map import ARCHITECTURE_KEYS, CONTEXT_EXTENSION_KEYS, config_from_hf
from MaxText.hf.safetensors_io import SafetensorsFolder
from MaxText.hf.weights import Slot, abstract_variables, from_hf, hf_table, leaves, mtp_copies

SCALE_SUFFIX = "_scale_inv"
STATE_DIR = "state"
MAX_CHUNK_BYTES = 512 * 2**20


def read_hf_config(hf_dir: Path) -> dict:
    if not hf_dir.is_dir():
        raise HFCheckpointError(f"--hf_path {hf_dir} is not a directory")
    path = hf_dir / "config.json"
    if not path.is_file():
        raise HFCheckpointError(f"no config.json in {hf_dir}: not a Hugging Face checkpoint directory")
    try:
        return json.loads(path.read_text())
    except ValueError as err:
        raise HFCheckpointError(f"{path} is not valid JSON ({err})") from None


def count_mtp_layers(hf: dict, names: set[str]) -> int:
    """MTP modules whose weights are present (``model.layers.<num_hidden_layers + k - 1>.*``)."""
    layers, count = int(hf.get("num_hidden_layers") or 0), 0
    while any(n.startswith(f"model.layers.{layers + count}.") for n in names):
        count += 1
    return count


def matching_model_name(arch: dict) -> str | None:
    """The shipped overlay with exactly this network, if any (its training settings then apply).
    The context extension is not compared: the checkpoint's config.yml sets its own (YaRN for the
    release) over the overlay's pretraining RoPE."""
    shape = {key: value for key, value in arch.items() if key not in CONTEXT_EXTENSION_KEYS}
    for name in available_models():
        config = load_config([f"model_name={name}", "run_name=match"])
        if all(getattr(config, key) == value for key, value in shape.items()):
            return name
    return None


def overlay_text(overlay: dict, source: Path) -> str:
    head = f"# Converted from the Hugging Face checkpoint {source.name}: its architecture as config keys.\n"
    return head + yaml.safe_dump(overlay, sort_keys=False)


def tokenizer_keys(hf_dir: Path) -> dict[str, str]:
    """The run keys that give a run the checkpoint's own tokenizer, if its folder has one."""
    tokenizer = hf_dir / "tokenizer.json"
    if not tokenizer.is_file():
        return {}
    return {"tokenizer_type": "huggingface", "tokenizer_path": str(tokenizer.absolute())}


def load_overlay(overlay: dict, source: Path):
    """The Config a run with this overlay as its extra yml gets (loaded the way a run loads it)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.yml"
        path.write_text(overlay_text(overlay, source))
        try:
            return load_config([str(path), "run_name=convert"]).with_platform("cpu")
        except ConfigError as err:
            raise HFCheckpointError(f"config.json gives an invalid model: {err}") from None


def _names(names, limit: int = 5) -> str:
    names = sorted(names)
    return ", ".join(names[:limit]) + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def check_tensors(folder: SafetensorsFolder, table: dict[str, Slot], sources: dict[str, str], optional: set[str]):
    """Every expected tensor present with its shape, nothing unexpected; FP8 weights with their scales."""
    wanted = set(sources.values()) | optional
    scales = {n for n in folder.tensors if n.endswith(SCALE_SUFFIX) and n[: -len(SCALE_SUFFIX)] in folder}
    unexpected = set(folder.tensors) - wanted - scales
    if unexpected:
        raise HFCheckpointError(f"unexpected tensors in {folder.directory}: {_names(unexpected)}")
    missing = {src for src in sources.values() if src not in folder}
    if missing:
        raise HFCheckpointError(f"tensors missing from {folder.directory}: {_names(missing)}")
    for name, src in sources.items():
        shape = folder.tensors[src].shape
        if shape != table[name].hf_shape:
            raise HFCheckpointError(
                f"tensor {src} has shape {list(shape)}, the config needs {list(table[name].hf_shape)}"
            )
    for name in set(sources.values()) | (optional & set(folder.tensors)):
        info = folder.tensors[name]
        if info.dtype.startswith("F8") and name + SCALE_SUFFIX not in folder:
            raise HFCheckpointError(f"tensor {name} is {info.dtype} but {name}{SCALE_SUFFIX} is missing")


def dequantize_fp8(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int], name: str) -> np.ndarray:
    """``weight * scale_inv`` per (block x block) tile, in float32; edge tiles are partial."""
    (m, n), (bm, bn) = weight.shape, block
    if scale_inv.shape != (math.ceil(m / bm), math.ceil(n / bn)):
        raise HFCheckpointError(
            f"tensor {name}{SCALE_SUFFIX} has shape {list(scale_inv.shape)}, "
            f"{name} [{m}, {n}] in {bm}x{bn} blocks needs {[math.ceil(m / bm), math.ceil(n / bn)]}"
        )
    out = weight.astype(np.float32)
    scale = scale_inv.astype(np.float32)
    for i in range(scale.shape[0]):  # one block row at a time: no full-size scale array
        out[i * bm : (i + 1) * bm] *= np.repeat(scale[i], bn)[:n]
    return out


def read_float32(folder: SafetensorsFolder, name: str, block: tuple[int, int]) -> np.ndarray:
    array = folder.read(name)
    if folder.tensors[name].dtype.startswith("F8"):
        return dequantize_fp8(array, folder.read(name + SCALE_SUFFIX), block, name)
    return array.astype(np.float32)


class SlotWriter:
    """An Orbax checkpoint written one slot at a time (see the module docstring)."""

    def __init__(self, directory: Path, shapes: dict[tuple[str, ...], tuple[tuple[int, ...], np.dtype, int]]):
        skeleton: dict = {}
        for leaf, (_, dtype, _) in shapes.items():
            node = skeleton
            for key in leaf[:-1]:
                node = node.setdefault(key, {})
            node[leaf[-1]] = np.zeros((1,), dtype)
        ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False)).save(directory, skeleton)
        self.stores = {}
        for leaf, (shape, dtype, stacked) in shapes.items():
            path = directory / ".".join(leaf)
            if not (path / ".zarray").is_file():
                raise RuntimeError(
                    f"Orbax did not lay out {'/'.join(leaf)} as {path}; the streaming writer needs zarr leaves"
                )
            meta = json.loads((path / ".zarray").read_text())
            meta = {k: v for k, v in meta.items() if k not in ("dtype", "fill_value")}
            spec = {
                "driver": "zarr",
                "kvstore": {"driver": "file", "path": str(path)},
                "dtype": np.dtype(dtype).name,
                "metadata": {**meta, "shape": list(shape), "chunks": _chunks(shape, stacked, np.dtype(dtype))},
            }
            self.stores[leaf] = ts.open(spec, create=True, delete_existing=True).result()

    def write(self, leaf: tuple[str, ...], index: tuple[int, ...], array: np.ndarray) -> None:
        self.stores[leaf][index].write(array).result()


def _chunks(shape: tuple[int, ...], stacked: int, dtype: np.dtype) -> list[int]:
    """One slot per chunk; a slot over MAX_CHUNK_BYTES is split along its first dim."""
    chunks = [1] * stacked + list(shape[stacked:])
    if len(chunks) > stacked:
        pieces = math.ceil(math.prod(chunks) * dtype.itemsize / MAX_CHUNK_BYTES)
        chunks[stacked] = max(1, math.ceil(chunks[stacked] / pieces))
    return [max(c, 1) for c in chunks]


def convert(hf_path: str | Path, output_path: str | Path, dtype: str = "float32", progress: bool = True) -> Path:
    """Convert; returns the output directory. Bad input raises HFCheckpointError before any write."""
    hf_dir, out = Path(hf_path), Path(output_path)
    hf = read_hf_config(hf_dir)
    folder = SafetensorsFolder(hf_dir)
    arch = config_from_hf(hf, count_mtp_layers(hf, set(folder.tensors)))
    if arch["normalization_layer_epsilon"] != 1e-6:  # transformers' q_a/kv_a norms ignore rms_norm_eps
        print(
            f"warning: rms_norm_eps {arch['normalization_layer_epsilon']} is used by every norm here, "
            "transformers keeps 1e-6 in the q/kv latent norms",
            file=sys.stderr,
        )
    name = matching_model_name(arch)
    overlay = {**({"model_name": name} if name else {}), **{key: arch[key] for key in ARCHITECTURE_KEYS}}
    overlay |= tokenizer_keys(hf_dir)
    config = load_overlay(overlay, hf_dir)
    abstract = abstract_variables(config)
    table = hf_table(config, abstract)
    sources = {n: n for n in table}
    optional = set(mtp_copies(config))
    if hf.get("tie_word_embeddings") and "lm_head.weight" not in folder:
        sources["lm_head.weight"] = "model.embed_tokens.weight"
    check_tensors(folder, table, sources, optional)
    if (out / STATE_DIR).exists():
        raise HFCheckpointError(f"{out / STATE_DIR} already exists; choose another --output_path")
    block = tuple((hf.get("quantization_config") or {}).get("weight_block_size") or (128, 128))

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yml").write_text(overlay_text(overlay, hf_dir))
    stacked_dims = {slot.leaf: len(slot.index) for slot in table.values()}
    shapes = {}
    for leaf, value in leaves(abstract).items():
        stacked = stacked_dims.get(leaf, 0)  # a leaf no HF tensor fills (biases without routed_bias) stays zero
        shapes[leaf] = (tuple(value.shape), np.dtype(dtype) if leaf[0] == "params" else np.dtype(np.float32), stacked)
    writer = SlotWriter((out / STATE_DIR).absolute(), shapes)
    order = sorted(table, key=lambda n: (folder.tensors[sources[n]].file, folder.tensors[sources[n]].start))
    for name in tqdm(order, desc="convert", unit="tensor", disable=not progress, dynamic_ncols=True):
        slot = table[name]
        leaf_shape, leaf_dtype, _ = shapes[slot.leaf]
        value = from_hf(read_float32(folder, sources[name], block), slot.layout, leaf_shape[len(slot.index) :])
        writer.write(slot.leaf, slot.index, value.astype(leaf_dtype, copy=False))
    for leaf in set(shapes) - set(stacked_dims):
        writer.write(leaf, (), np.zeros(shapes[leaf][0], shapes[leaf][1]))
    return out
