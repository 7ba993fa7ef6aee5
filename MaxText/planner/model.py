"""What a model costs per token: FLOPs by GEMM class, parameters, activation sizes.

For the repository's own models (DeepSeek-V3 configs) every number comes from
``MaxText/models/accounting.py``, the same accounting ``tools/model_stats.py`` prints and the
training loop divides by for MFU: training FLOPs counted as Megatron-LM counts them (3 passes x
2 FLOPs per multiply-accumulate, causal attention halved, output head included, MTP when on). The
planner only splits them by the kernel that runs them, because the kernels reach different fractions of
peak: ``dense`` (plain GEMMs: attention projections, dense MLPs, shared experts, router, head),
``grouped`` (the routed experts' grouped GEMM) and ``attention`` (the softmax(QK^T)V core).

The calibration control, Qwen3-235B-A22B, uses grouped-query attention, which the config (MLA
only) cannot express; ``qwen3_235b`` describes it here from its released ``config.json`` (94
layers, D 4096, 64 query / 4 key-value heads of 128, 128 experts of 1536 top-8, no shared expert,
vocabulary 151,936, untied head). Its FLOPs are checked in the tests against a textbook count.

Activation sizes are elements per token per layer (summed over layers), for the two ways a layer can
be kept for the backward pass: everything it computes (``none``), or only its matmul outputs
(``minimal``: no norm outputs, no SwiGLU product), or what Megatron-LM keeps under its selective
recompute of norms, MLA up-projections and expert activations (``selective``: the latents, the
attention output, the dispatched tokens, the expert fc1 outputs and the expert outputs; modelled
for calibration, not a policy of this repository), or the tensors the config's ``remat_names``
list (``names``: ``named_per_token``; the repository's models only). Under ``full`` remat a layer
keeps its input only.
"""

from __future__ import annotations

from dataclasses import dataclass

from MaxText.config import Config
from MaxText.parallel.axes import MESH_AXES, parallelism_key


@dataclass(frozen=True)
class ModelSpec:
    name: str
    seq_len: int
    layers: int  # transformer layers, MTP modules included
    moe_layers: int  # MoE layers, MTP included
    d_model: int
    vocab: int
    num_experts: int
    top_k: int
    heads: int
    kv_heads: int  # tensor parallelism must divide both head counts
    flops: dict[str, float]  # per token, training (fwd + bwd), model FLOPs: dense / grouped / attention
    params_dense: int  # everything but the routed experts, MTP included
    params_expert: int  # routed experts, all layers
    act_none: int  # elements per token kept by all layers together, nothing recomputed
    act_minimal: int  # elements per token kept when only matmul outputs are saved
    act_selective: int  # elements per token kept under Megatron's selective recompute (see above)
    act_names: float  # elements per token kept under ``remat_policy: names`` (the config's remat_names)
    act_layer: int  # elements per token one layer holds while it runs (the largest layer)
    # elements per token entering or leaving the linear GEMMs FP8 quantizes (each GEMM's K + N:
    # MLA projections, MLPs, shared and routed experts; 0 where not counted)
    fp8_gemm_io: int = 0
    routing_groups: int = 1  # group-limited routing: experts in this many equal groups (routing.py)
    top_groups: int = 1  # a token's experts come from this many of them
    score_func: str = "softmax"  # the router's scores (the group mask sums them)
    config: Config | None = None  # set for the repository's own models (exact sharding rules)

    @property
    def flops_per_token(self) -> float:
        return sum(self.flops.values())

    @property
    def params(self) -> int:
        return self.params_dense + self.params_expert


def _moe_act(D: int, E: int, K: int, F: int, shared_F: int) -> tuple[int, int, int]:
    """(none, minimal, selective) elements per token of an MoE FFN: norm, router, dispatched
    copies, expert gate/up/product, expert outputs, shared expert. ``minimal`` (JAX's
    ``dots_with_no_batch_dims_saveable``) keeps matmul outputs, but the routed experts' matmuls
    run inside the exchange's rematerialised rounds and the blocked backend's own VJP, which the
    policy does not reach: only the router's logits and the shared expert's gate and up projections
    stay (counting the routed experts' overstated the GB300 recipe's memory by half against XLA:GPU's
    compile; docs/LOG.md)."""
    none = D + 2 * E + K * D + 3 * K * F + K * D + 3 * shared_F
    minimal = E + 2 * shared_F
    return none, minimal, none - D - K * F - shared_F


def _dense_act(D: int, F: int) -> tuple[int, int, int]:
    return D + 3 * F, 2 * F, 2 * F


def named_per_token(c: Config, moe: bool) -> float:
    """Elements per token one layer keeps under ``remat_policy: names`` (layers/remat.py), in
    bfloat16 elements: each name in ``remat_names``, the float32 router logits and softmax
    statistics as two. The routed experts' gate and up outputs fill the exchange's layout:
    the config's ``moe_ep_buffer_factor`` x K rows a token (expert parallelism, which every 671B
    layout has; the spec is built once per config, so a buffer factor passed to ``estimate``
    apart from the config's does not reach these rows). The ``blocked`` backend's GEMMs run
    inside its own VJP, unnamed: counted as the default backends keep them."""
    H, D, rope = c.base_num_query_heads, c.emb_dim, c.qk_rope_head_dim
    shared_F = c.shared_experts * c.base_moe_mlp_dim
    elements = {
        "query_latent": c.q_lora_rank,
        "key_value_latent": c.kv_lora_rank + rope,
        "query": H * c.qk_head_dim,
        "key_value": H * (c.qk_nope_head_dim + c.v_head_dim),
        "attention": H * c.v_head_dim + 2 * H,
        "attention_out": D,
        "router_logits": 2 * c.num_experts if moe else 0,
        "mlp_gate_up": 2 * (shared_F if moe else c.base_mlp_dim),
        "routed_gate_up": 2 * c.moe_ep_buffer_factor * c.num_experts_per_tok * c.base_moe_mlp_dim if moe else 0,
    }
    return sum(elements[name] for name in c.remat_names)  # the layer's input aside, as in the others


def dense_rerun_per_token(c: Config, moe: bool) -> float:
    """Forward FLOPs per token of one layer's dense GEMMs that the backward pass runs again under
    ``remat_policy: names``: a GEMM reruns where its output is read by a backward (its own
    consumer's) and is not among ``remat_names``. MLA's down- and up-projections feed the
    projections after them and the attention kernel; the output projection feeds the norm before
    the FFN (its input is the residual stream plus it); the router's logits feed the routing's
    backward, and a SwiGLU's gate and up its product's. The down projections of the dense MLP and
    the shared experts only add to the residual stream, which the next layer's input keeps: never
    rerun. The routed experts and the attention kernel are their own classes (``rerun_share``)."""
    H, D, rope = c.base_num_query_heads, c.emb_dim, c.qk_rope_head_dim
    mlp_F = c.shared_experts * c.base_moe_mlp_dim if moe else c.base_mlp_dim
    query = [("query", (c.q_lora_rank or D) * H * c.qk_head_dim)]
    if c.q_lora_rank:
        query.append(("query_latent", D * c.q_lora_rank))
    gemms = [
        *query,
        ("key_value_latent", D * (c.kv_lora_rank + rope)),
        ("key_value", c.kv_lora_rank * H * (c.qk_nope_head_dim + c.v_head_dim)),
        ("attention_out", H * c.v_head_dim * D),
        ("mlp_gate_up", 2 * D * mlp_F),
    ]
    if moe:
        gemms.append(("router_logits", D * c.num_experts))
    return float(sum(2 * params for name, params in gemms if name not in c.remat_names))


def dense_rerun_names(c: Config) -> float:
    """``dense_rerun_per_token`` over the decoder's layers: the MTP modules' layers are not
    rematerialised (``models/mtp.py``)."""
    moe, dense = dense_rerun_per_token(c, moe=True), dense_rerun_per_token(c, moe=False)
    return c.num_moe_layers * moe + c.first_num_dense_layers * dense


# Keys that change a run but not the parameter shapes: fixed before tracing, so that costing many
# layouts, batches or run names of one architecture traces it once (the trace is cached by config).
_RUN_KEYS = {
    "run_name": "plan",
    "per_device_batch_size": 1,
    "gradient_accumulation_steps": 1,
    "remat_policy": "full",
    **{parallelism_key(kind, axis): 1 for kind in ("ici", "dcn") for axis in MESH_AXES},
    "num_pipeline_microbatches": -1,
    "num_pipeline_repeats": 1,
    "num_pipeline_lanes": 1,
}


def architecture(config: Config, keep_length: bool = True) -> Config:
    """``config`` with the run-only keys fixed (and the sequence length too, unless ``keep_length``)."""
    return config.model_copy(update=_RUN_KEYS if keep_length else {**_RUN_KEYS, "max_target_length": 2})


def from_config(config: Config) -> ModelSpec:
    """A repository config, costed by ``MaxText.models.accounting`` (no recount here)."""
    from MaxText.models.accounting import count_parameters, train_flops

    c = config
    arch = architecture(c)
    counts = count_parameters(arch)
    flops = train_flops(arch, counts)
    K, E = c.num_experts_per_tok, c.num_experts
    routed = counts.main["routed_experts"] + counts.mtp_parts["routed_experts"]
    grouped = 6 * routed * K // E
    attention = flops.attention + c.mtp_num_layers * (flops.attention // max(c.base_num_decoder_layers, 1))
    H, D = c.base_num_query_heads, c.emb_dim
    attn_none = D + c.q_lora_rank + H * c.qk_head_dim + c.kv_lora_rank + c.qk_rope_head_dim
    attn_none += H * (c.qk_nope_head_dim + c.v_head_dim) + H * c.qk_head_dim + 2 * H * c.v_head_dim
    # minimal keeps matmul outputs only: the latents, q, the keys' and values' up-projection, the
    # output projection (the rotary key's concatenation and cuDNN's output are not matmuls)
    attn_min = c.q_lora_rank + H * c.qk_head_dim + c.kv_lora_rank + c.qk_rope_head_dim
    attn_min += H * (c.qk_nope_head_dim + c.v_head_dim) + D
    attn_sel = c.q_lora_rank + c.kv_lora_rank + c.qk_rope_head_dim + H * c.v_head_dim  # latents, attention output
    moe_none, moe_min, moe_sel = _moe_act(D, E, K, c.base_moe_mlp_dim, c.shared_experts * c.base_moe_mlp_dim)
    dense_none, dense_min, dense_sel = _dense_act(D, c.base_mlp_dim)
    moe_layers = c.num_moe_layers + c.mtp_num_layers
    dense_layers = c.first_num_dense_layers
    # K + N of each GEMM quantization covers (quantization/matmul.py): wq_a, wq_b, wkv_a, wkv_b, wo
    ql, kvl = c.q_lora_rank, c.kv_lora_rank
    q_in = (D + ql) + (ql + H * c.qk_head_dim) if ql else D + H * c.qk_head_dim
    attn_io = q_in + (D + kvl + c.qk_rope_head_dim) + (kvl + H * (c.qk_nope_head_dim + c.v_head_dim))
    attn_io += H * c.v_head_dim + D
    moe_io = 3 * (D + c.base_moe_mlp_dim) * (K + c.shared_experts)  # gate, up, down per copy
    dense_io = 3 * (D + c.base_mlp_dim)
    return ModelSpec(
        name=c.model_name,
        seq_len=c.max_target_length,
        layers=c.base_num_decoder_layers + c.mtp_num_layers,
        moe_layers=moe_layers,
        d_model=D,
        vocab=c.vocab_size,
        num_experts=E,
        top_k=K,
        heads=H,
        kv_heads=H,
        flops={
            "dense": float(flops.total - grouped - attention),
            "grouped": float(grouped),
            "attention": float(attention),
        },
        params_dense=counts.total + counts.mtp - routed,
        params_expert=routed,
        act_none=moe_layers * (attn_none + moe_none) + dense_layers * (attn_none + dense_none),
        act_minimal=moe_layers * (attn_min + moe_min) + dense_layers * (attn_min + dense_min),
        act_selective=moe_layers * (attn_sel + moe_sel) + dense_layers * (attn_sel + dense_sel),
        act_names=moe_layers * named_per_token(c, moe=True) + dense_layers * named_per_token(c, moe=False),
        act_layer=attn_none + max(moe_none, dense_none if dense_layers else 0),
        fp8_gemm_io=moe_layers * (attn_io + moe_io) + dense_layers * (attn_io + dense_io),
        routing_groups=c.n_routing_groups,
        top_groups=c.topk_routing_group if c.n_routing_groups > 1 else 1,
        score_func=c.routed_score_func,
        config=c,
    )


# Qwen3-235B-A22B, from its released config.json (Qwen/Qwen3-235B-A22B).
QWEN3_235B = dict(layers=94, D=4096, heads=64, kv_heads=4, head_dim=128, E=128, K=8, F=1536, vocab=151936)


def qwen3_235b(seq_len: int = 4096) -> ModelSpec:
    """Qwen3-235B-A22B (GQA, every layer MoE, no shared expert), counted the same way as
    ``accounting.train_flops``: 6 x active non-embedding parameters + causal attention."""
    q = QWEN3_235B
    L, D, H, G, hd, E, K, F, V = (
        q[k] for k in ("layers", "D", "heads", "kv_heads", "head_dim", "E", "K", "F", "vocab")
    )
    attn_params = D * H * hd + 2 * D * G * hd + H * hd * D + 2 * hd  # q, k, v, o projections; q/k norms
    router = E * D
    expert = 3 * D * F
    dense_per_layer = attn_params + router + 2 * D  # + the two layer norms
    params_dense = L * dense_per_layer + 2 * V * D + D  # embedding, head, final norm
    attention = L * 3 * seq_len * H * (hd + hd)
    attn_none = D + 3 * H * hd + 2 * G * hd + H * hd
    attn_min = attn_none - D
    attn_sel = 2 * H * hd + 2 * G * hd  # q, k, v and the attention output (no up-projections to recompute)
    moe_none, moe_min, moe_sel = _moe_act(D, E, K, F, 0)
    return ModelSpec(
        name="qwen3-235b-a22b",
        seq_len=seq_len,
        layers=L,
        moe_layers=L,
        d_model=D,
        vocab=V,
        num_experts=E,
        top_k=K,
        heads=H,
        kv_heads=G,
        flops={
            "dense": 6.0 * (L * dense_per_layer + V * D + D),
            "grouped": 6.0 * L * K * expert,
            "attention": float(attention),
        },
        params_dense=params_dense,
        params_expert=L * E * expert,
        act_none=L * (attn_none + moe_none),
        act_minimal=L * (attn_min + moe_min),
        act_selective=L * (attn_sel + moe_sel),
        act_names=L * (attn_sel + moe_sel),  # no such policy in its own stack: as selective
        act_layer=attn_none + moe_none,
    )
