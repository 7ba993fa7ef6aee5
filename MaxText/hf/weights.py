"""Hugging Face tensor names <-> slices of our stacked parameters, with their layouts.

Our layer stacks are ``nn.scan``-ed, so every per-layer weight has a leading layer axis, and the
routed experts add an expert axis: ``moe_layers/layers/moe/wi_0`` is [L, E, D, F] where the HF
checkpoint has one ``model.layers.<i>.mlp.experts.<e>.gate_proj.weight`` [F, D] per layer and
expert. ``hf_table`` lists, for every HF tensor of a configured model, the leaf it belongs to,
its index along the stacked axes and the layout change; it is built from the model's own
abstract parameters (``jax.eval_shape``), so shapes cannot drift from the model definition.

Layouts (HF ``nn.Linear`` weights are [out, in]; ours are [in, out] with heads split out):
``T`` transposes, ``heads_in`` maps [H*K, R] -> [R, H, K] (q_b_proj, kv_b_proj, q_proj) and
``heads_out`` maps [D, H*V] -> [H, V, D] (o_proj); norms, embedding and biases are unchanged.
The correction bias ``mlp.gate.e_score_correction_bias`` lands in the ``moe_bias`` collection.

MTP module k lives under ``model.layers.<num_hidden_layers + k - 1>.`` (enorm, hnorm, eh_proj,
shared_head.norm and a full MoE decoder layer); its ``embed_tokens`` and ``shared_head.head``
are copies of the shared embedding and head, accepted on import and written on export.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from MaxText.config import Config
from MaxText.models.deepseek import DeepSeekV3
from MaxText.moe.block import BIAS
from MaxText.train.state import dummy_inputs

COLLECTIONS = ("params", BIAS)


@dataclass(frozen=True)
class Slot:
    """Where one HF tensor lives in our tree."""

    leaf: tuple[str, ...]  # (collection, *path)
    index: tuple[int, ...]  # position along the leaf's stacked (layer, expert) axes
    layout: str  # "same" | "T" | "heads_in" | "heads_out"
    hf_shape: tuple[int, ...]


def abstract_variables(config: Config) -> dict[str, Any]:
    """{"params": ..., "moe_bias": ...} as ShapeDtypeStructs (nothing allocated)."""
    config = config.with_platform("cpu")  # the activation dtype does not change any shape
    shapes = jax.eval_shape(lambda: DeepSeekV3(config).init(jax.random.key(0), *dummy_inputs(config)))
    unbox = lambda x: x.value if isinstance(x, nn.Partitioned) else x  # noqa: E731
    shapes = jax.tree.map(unbox, shapes, is_leaf=lambda x: isinstance(x, nn.Partitioned))
    return {name: shapes.get(name, {}) for name in COLLECTIONS}


def leaves(tree: Any) -> dict[tuple[str, ...], Any]:
    """{(collection, *path): leaf}."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {tuple(str(k.key) for k in path): leaf for path, leaf in flat}


def to_hf(array: np.ndarray, layout: str) -> np.ndarray:
    """One slot of ours -> the HF tensor."""
    if layout == "same":
        return array
    if layout == "T":
        return array.T
    if layout == "heads_in":  # [R, H, K] -> [H*K, R]
        return array.reshape(array.shape[0], -1).T
    if layout == "heads_out":  # [H, V, D] -> [D, H*V]
        return array.reshape(-1, array.shape[-1]).T
    raise ValueError(layout)


def from_hf(array: np.ndarray, layout: str, slot_shape: tuple[int, ...]) -> np.ndarray:
    """The HF tensor -> one slot of ours, of ``slot_shape``."""
    if layout == "same":
        return array
    if layout in ("T", "heads_in", "heads_out"):
        return array.T.reshape(slot_shape)
    raise ValueError(layout)


def hf_shape(slot_shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
    """The HF tensor's shape for one slot of ours (what ``to_hf`` gives)."""
    if layout == "same":
        return tuple(slot_shape)
    if layout == "T":
        return tuple(reversed(slot_shape))
    if layout == "heads_in":
        return (math.prod(slot_shape[1:]), slot_shape[0])
    if layout == "heads_out":
        return (slot_shape[-1], math.prod(slot_shape[:-1]))
    raise ValueError(layout)


def _layer(prefix: str, base: tuple[str, ...], index: tuple[int, ...], c: Config, moe: bool) -> dict:
    """HF name -> (leaf, index, layout) for one decoder layer."""
    p, b = f"{prefix}.", ("params", *base)
    attention = b + ("attention",)
    out = {
        p + "input_layernorm.weight": (b + ("pre_attention_norm", "scale"), index, "same"),
        p + "post_attention_layernorm.weight": (b + ("pre_ffn_norm", "scale"), index, "same"),
        p + "self_attn.kv_a_proj_with_mqa.weight": (attention + ("wkv_a",), index, "T"),
        p + "self_attn.kv_a_layernorm.weight": (attention + ("kv_norm", "scale"), index, "same"),
        p + "self_attn.kv_b_proj.weight": (attention + ("wkv_b",), index, "heads_in"),
        p + "self_attn.o_proj.weight": (attention + ("wo",), index, "heads_out"),
    }
    if c.q_lora_rank > 0:
        out[p + "self_attn.q_a_proj.weight"] = (attention + ("wq_a",), index, "T")
        out[p + "self_attn.q_a_layernorm.weight"] = (attention + ("q_norm", "scale"), index, "same")
        out[p + "self_attn.q_b_proj.weight"] = (attention + ("wq_b",), index, "heads_in")
    else:
        out[p + "self_attn.q_proj.weight"] = (attention + ("wq",), index, "heads_in")
    ffn = ("gate_proj", "wi_0"), ("up_proj", "wi_1"), ("down_proj", "wo")
    if not moe:
        for hf, ours in ffn:
            out[p + f"mlp.{hf}.weight"] = (b + ("mlp", ours), index, "T")
        return out
    block = b + ("moe",)
    out[p + "mlp.gate.weight"] = (block + ("router",), index, "T")
    if c.routed_bias:
        out[p + "mlp.gate.e_score_correction_bias"] = ((BIAS, *base, "moe", "router"), index, "same")
    for e in range(c.num_experts):
        for hf, ours in ffn:
            out[p + f"mlp.experts.{e}.{hf}.weight"] = (block + (ours,), (*index, e), "T")
    if c.shared_experts > 0:
        for hf, ours in ffn:
            out[p + f"mlp.shared_experts.{hf}.weight"] = (block + ("shared_experts", ours), index, "T")
    return out


def mtp_copies(c: Config) -> dict[str, tuple[str, ...]]:
    """HF names of the MTP modules' copies of the shared embedding and head -> the shared leaf."""
    out = {}
    for k in range(1, c.mtp_num_layers + 1):
        p = f"model.layers.{c.base_num_decoder_layers + k - 1}."
        out[p + "embed_tokens.weight"] = ("params", "token_embedding")
        out[p + "shared_head.head.weight"] = ("params", "output_head")
    return out


def hf_table(config: Config, abstract: dict[str, Any] | None = None) -> dict[str, Slot]:
    """Every HF tensor of the configured model (MTP copies excluded) and where it goes."""
    c = config
    entries: dict[str, tuple] = {
        "model.embed_tokens.weight": (("params", "token_embedding"), (), "same"),
        "model.norm.weight": (("params", "final_norm", "scale"), (), "same"),
        "lm_head.weight": (("params", "output_head"), (), "T"),
    }
    for i in range(c.base_num_decoder_layers):
        moe = i >= c.first_num_dense_layers
        base = ("moe_layers", "layers") if moe else ("dense_layers", "layers")
        slot = i - c.first_num_dense_layers if moe else i
        entries.update(_layer(f"model.layers.{i}", base, (slot,), c, moe))
    for k in range(1, c.mtp_num_layers + 1):
        p, mtp = f"model.layers.{c.base_num_decoder_layers + k - 1}", f"mtp_{k}"
        entries[f"{p}.enorm.weight"] = (("params", mtp, "embedding_norm", "scale"), (), "same")
        entries[f"{p}.hnorm.weight"] = (("params", mtp, "hidden_norm", "scale"), (), "same")
        entries[f"{p}.eh_proj.weight"] = (("params", mtp, "projection"), (), "T")
        entries[f"{p}.shared_head.norm.weight"] = (("params", mtp, "final_norm", "scale"), (), "same")
        entries.update(_layer(p, (mtp, "layer"), (), c, True))

    shapes = leaves(abstract if abstract is not None else abstract_variables(c))
    table, filled, stacked_dims = {}, dict.fromkeys(shapes, 0), {}
    for name, (leaf, index, layout) in entries.items():
        shape = tuple(shapes[leaf].shape)
        table[name] = Slot(leaf, index, layout, hf_shape(shape[len(index) :], layout))
        filled[leaf] += 1
        stacked_dims[leaf] = len(index)
    for leaf, count in filled.items():  # every slot of every leaf is some HF tensor, exactly once
        if leaf[0] == BIAS and not c.routed_bias:
            continue  # no correction bias: the leaves stay zero
        slots = int(np.prod(shapes[leaf].shape[: stacked_dims.get(leaf, 0)], dtype=np.int64))
        assert count == slots and leaf in stacked_dims, f"{'/'.join(leaf)}: {count} HF tensors for {slots} slots"
    return table
