"""Hugging Face ``config.json`` <-> our config keys, for DeepSeek-V3 (and V2-style) models.

``config_from_hf`` derives every architecture key from a ``deepseek_v3`` (or ``deepseek_v2``)
config.json, so any such model converts, not only the shipped overlays; what our model cannot
compute (another activation, attention biases, V2's max-score group routing, ...) is refused
with one line naming the field. ``hf_config`` is the reverse, written in the release's format
(``rope_theta`` + ``rope_scaling``), which transformers 4.x and 5.x both read.

Where transformers (the installed 5.x) and the reference code differ, transformers wins, since
its logits are what the conversion is checked against:
- YaRN's cos/sin magnitude is ``m(mscale)/m(mscale_all_dim)`` only when both are set, else
  ``m(1)`` (``m(x) = 0.1 x ln(factor) + 1``); the softmax scale takes ``m(mscale_all_dim)^2``
  when ``mscale_all_dim`` is set. Our keys couple the two as ``rope_mscale``/``rope_mscale_all_dim``,
  so ``rope_mscale`` is solved to give transformers' magnitude.
- V2 routing ignores ``norm_topk_prob`` (weights are never renormalised).
"""

from __future__ import annotations

import math
from typing import Any

from MaxText.config import Config
from MaxText.hf import HFCheckpointError

MODEL_TYPES = ("deepseek_v3", "deepseek_v2")

# The architecture keys that describe the context extension (YaRN) rather than the network's shape:
# a checkpoint keeps its own, while a pretraining overlay of the same shape uses plain RoPE.
CONTEXT_EXTENSION_KEYS = (
    "rope_type",
    "rope_factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "rope_mscale",
    "rope_mscale_all_dim",
)

# Our keys that describe the network; a converted checkpoint's config.yml sets all of them.
ARCHITECTURE_KEYS = (
    "vocab_size",
    "base_emb_dim",
    "base_num_decoder_layers",
    "first_num_dense_layers",
    "base_mlp_dim",
    "base_num_query_heads",
    "normalization_layer_epsilon",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "rope_max_timescale",
    "rope_interleave",
    *CONTEXT_EXTENSION_KEYS,
    "num_experts",
    "num_experts_per_tok",
    "shared_experts",
    "base_moe_mlp_dim",
    "routed_score_func",
    "routed_bias",
    "routed_scaling_factor",
    "routed_norm_topk_prob",
    "n_routing_groups",
    "topk_routing_group",
    "mtp_num_layers",
)


def _fail(field: str, message: str) -> HFCheckpointError:
    return HFCheckpointError(f"config.json field '{field}': {message}")


def _required(hf: dict, field: str) -> Any:
    if hf.get(field) is None:
        raise _fail(field, "is missing")
    return hf[field]


def yarn_m(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _rope(hf: dict) -> dict[str, Any]:
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    max_positions = int(hf.get("max_position_embeddings") or 4096)
    if kind == "default":
        plain = {"rope_type": "default", "rope_factor": 1.0, "original_max_position_embeddings": max_positions}
        return {**plain, "rope_max_timescale": theta, "beta_fast": 32.0, "beta_slow": 1.0}
    if kind != "yarn":
        raise _fail("rope_scaling", f"rope type '{kind}' is not supported (yarn or default)")
    if rope.get("truncate", True) is False:
        raise _fail("rope_scaling", "YaRN with truncate=false is not supported")
    original = int(_required(rope, "original_max_position_embeddings"))
    factor = float(rope.get("factor") or max_positions / original)
    mscale, all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    magnitude = rope.get("attention_factor")
    if magnitude is None:  # transformers' _compute_yarn_parameters
        magnitude = yarn_m(factor, mscale) / yarn_m(factor, all_dim) if mscale and all_dim else yarn_m(factor, 1.0)
    all_dim = float(all_dim or 0.0)
    if factor <= 1:
        rope_mscale = 1.0
    elif mscale and rope.get("mscale_all_dim") and rope.get("attention_factor") is None:
        rope_mscale = float(mscale)
    else:  # solve m(rope_mscale) / m(all_dim) = magnitude
        rope_mscale = (float(magnitude) * yarn_m(factor, all_dim) - 1.0) / (0.1 * math.log(factor))
    return {
        "rope_type": "yarn",
        "rope_max_timescale": theta,
        "rope_factor": factor,
        "original_max_position_embeddings": original,
        "beta_fast": float(rope.get("beta_fast") or 32),
        "beta_slow": float(rope.get("beta_slow") or 1),
        "rope_mscale": rope_mscale,
        "rope_mscale_all_dim": all_dim,
    }


def config_from_hf(hf: dict, mtp_layers: int = 0) -> dict[str, Any]:
    """Our architecture keys from a config.json (``mtp_layers``: MTP modules present in the weights)."""
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise _fail("model_type", f"'{model_type}' is not supported (expected one of {', '.join(MODEL_TYPES)})")
    v3 = model_type == "deepseek_v3"
    for field, wanted in (
        ("hidden_act", "silu"),
        ("attention_bias", False),
        ("mlp_bias", False),
        ("moe_layer_freq", 1),
    ):
        if field in hf and hf[field] != wanted:
            raise _fail(field, f"{hf[field]!r} is not supported (only {wanted!r})")
    heads = int(_required(hf, "num_attention_heads"))
    if hf.get("num_key_value_heads") not in (None, heads):
        raise _fail("num_key_value_heads", f"must equal num_attention_heads ({heads}) for MLA")
    layers = int(_required(hf, "num_hidden_layers"))
    experts = int(_required(hf, "n_routed_experts"))
    groups, top_groups = int(hf.get("n_group") or 1), int(hf.get("topk_group") or 1)
    if v3:
        if hf.get("scoring_func", "sigmoid") != "sigmoid":
            raise _fail("scoring_func", f"'{hf['scoring_func']}' is not supported by deepseek_v3 (sigmoid)")
        score, bias, norm_topk = "sigmoid", True, bool(hf.get("norm_topk_prob", True))
    else:
        method = hf.get("topk_method", "greedy")
        if method == "group_limited_greedy" and top_groups < groups:
            raise _fail("topk_method", "group_limited_greedy (max-score groups) is not supported; greedy is")
        if method not in ("greedy", "group_limited_greedy"):
            raise _fail("topk_method", f"'{method}' is not supported for deepseek_v2")
        score, bias, norm_topk, groups, top_groups = "softmax", False, False, 1, 1
    return {
        "vocab_size": int(_required(hf, "vocab_size")),
        "base_emb_dim": int(_required(hf, "hidden_size")),
        "base_num_decoder_layers": layers,
        "first_num_dense_layers": min(int(hf.get("first_k_dense_replace") or 0), layers),
        "base_mlp_dim": int(_required(hf, "intermediate_size")),
        "base_num_query_heads": heads,
        "normalization_layer_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
        "q_lora_rank": int(hf.get("q_lora_rank") or 0),
        "kv_lora_rank": int(_required(hf, "kv_lora_rank")),
        "qk_nope_head_dim": int(_required(hf, "qk_nope_head_dim")),
        "qk_rope_head_dim": int(_required(hf, "qk_rope_head_dim")),
        "v_head_dim": int(_required(hf, "v_head_dim")),
        "rope_interleave": bool(hf.get("rope_interleave", True)) if v3 else True,
        **_rope(hf),
        "num_experts": experts,
        "num_experts_per_tok": int(_required(hf, "num_experts_per_tok")),
        "shared_experts": int(hf.get("n_shared_experts") or 0),
        "base_moe_mlp_dim": int(_required(hf, "moe_intermediate_size")),
        "routed_score_func": score,
        "routed_bias": bias,
        "routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
        "routed_norm_topk_prob": norm_topk,
        "n_routing_groups": groups,
        "topk_routing_group": top_groups,
        "mtp_num_layers": mtp_layers,
    }


def hf_config(c: Config, dtype: str) -> dict[str, Any]:
    """A deepseek_v3 config.json for our config (``dtype``: the dtype the weights are written in)."""
    if c.routed_score_func != "sigmoid":
        raise HFCheckpointError("config key 'routed_score_func': deepseek_v3 routes with sigmoid scores only")
    if c.rope_type == "yarn":
        rope_scaling = {
            "type": "yarn",
            "factor": c.rope_factor,
            "original_max_position_embeddings": c.original_max_position_embeddings,
            "beta_fast": c.beta_fast,
            "beta_slow": c.beta_slow,
            "mscale": c.rope_mscale,
            "mscale_all_dim": c.rope_mscale_all_dim,
        }
        max_positions = int(round(c.original_max_position_embeddings * c.rope_factor))
    else:
        rope_scaling, max_positions = None, c.max_target_length
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": c.vocab_size,
        "hidden_size": c.emb_dim,
        "intermediate_size": c.base_mlp_dim,
        "moe_intermediate_size": c.base_moe_mlp_dim,
        "num_hidden_layers": c.base_num_decoder_layers,
        "first_k_dense_replace": c.first_num_dense_layers,
        "moe_layer_freq": 1,
        "num_nextn_predict_layers": c.mtp_num_layers,
        "num_attention_heads": c.base_num_query_heads,
        "num_key_value_heads": c.base_num_query_heads,
        "q_lora_rank": c.q_lora_rank or None,
        "kv_lora_rank": c.kv_lora_rank,
        "qk_nope_head_dim": c.qk_nope_head_dim,
        "qk_rope_head_dim": c.qk_rope_head_dim,
        "v_head_dim": c.v_head_dim,
        "n_routed_experts": c.num_experts,
        "n_shared_experts": c.shared_experts,
        "num_experts_per_tok": c.num_experts_per_tok,
        "n_group": c.n_routing_groups,
        "topk_group": c.topk_routing_group,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": c.routed_norm_topk_prob,
        "routed_scaling_factor": c.routed_scaling_factor,
        "hidden_act": "silu",
        "rms_norm_eps": c.normalization_layer_epsilon,
        "rope_theta": c.rope_max_timescale,
        "rope_scaling": rope_scaling,
        "rope_interleave": c.rope_interleave,
        "max_position_embeddings": max_positions,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "initializer_range": c.init_weights_std,
        "torch_dtype": dtype,
    }
