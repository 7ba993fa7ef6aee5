"""Memory per GPU: training state by how the stack stores it, activations by remat policy, buffers.

State. ``sharded`` (this repository): every parameter is split over the mesh by the repository's
own rules (``MaxText/parallel/sharding.py`` ``parameter_specs`` on an abstract ``init``, so the
MLA up-projections that cannot split over fsdp x expert are counted as the training step stores
them), each with its gradient in ``weight_dtype`` and two Adam moments in ``opt_state_dtype``; a layout those rules cannot
split is refused here with the repository's own message. ``distributed_optimizer`` (Megatron): bf16
weights and fp32 main gradients on every data-parallel rank, fp32 master weights and Adam moments
split over data parallelism; with FP8 the quantised weights replace the BF16 copy (one byte, two
for MXFP8's row- and column-wise copies).

Activations. Tokens per GPU per micro-batch ``t = mbs * S / tensor``. ``none`` keeps everything,
``minimal`` the matmul outputs, ``full`` each layer's input plus one layer's working set. With
pipelining the first stage holds ``pp * (1 + (pp - 1) / (pp * vpp))`` micro-batches of its
``1/pp`` of the layers (Narayanan et al. 2021, interleaved 1F1B). Without pipelining the fp32
logits and their gradient are added, one ``vocab_chunks`` slice of the sequence at a time (with
pipelining the last stage holds them but fewer micro-batches). Buffers: for this repository's
sharded stacks, one MoE layer's exchange buffers and expert layout as ``moe/expert_parallel.py``
sizes them (``moe_working_bytes``; docs/LOG.md compares it with XLA:GPU's compile of the GB200
recipe); for Megatron's, the dispatch/combine receive buffers; and, for
sharded state, two layers of gathered weights (one computing, one prefetched), plus, with emulated
FP8, the computing layer's dequantized copies (MX: a row-wise and a column-wise one, bf16).
"""

from __future__ import annotations

import math
from functools import lru_cache

from MaxText.parallel.axes import MESH_AXES
from MaxText.planner import circular
from MaxText.planner.constants import ACTIVATION_BYTES, Stack
from MaxText.planner.layout import Layout
from MaxText.planner.model import ModelSpec, architecture


@lru_cache(maxsize=4)
def _boxed_leaves(config_json: str) -> tuple[tuple[tuple[str | None, ...], tuple[int, ...], int, bool], ...]:
    """(logical names, shape, itemsize, trainable) of every parameter, from an abstract init."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from MaxText.config import Config
    from MaxText.models.accounting import PARAM_COLLECTIONS, TRAINABLE_COLLECTION
    from MaxText.models.deepseek import DeepSeekV3

    config = Config.model_validate_json(config_json).with_platform("cpu")

    def init():
        tokens = jnp.zeros((1, 1), jnp.int32)
        return DeepSeekV3(config).init(jax.random.key(0), tokens, tokens, tokens)

    with nn.logical_axis_rules(()):
        variables = jax.eval_shape(init)
    leaves = []
    for collection in PARAM_COLLECTIONS:
        boxes = jax.tree.leaves(variables.get(collection, {}), is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
        for box in boxes:
            names = tuple(box.names) if isinstance(box, nn.LogicallyPartitioned) else ()
            value = box.value if isinstance(box, nn.LogicallyPartitioned) else box
            leaves.append((names, tuple(value.shape), value.dtype.itemsize, collection == TRAINABLE_COLLECTION))
    return tuple(leaves)


def sharded_state_bytes(spec: ModelSpec, layout: Layout) -> float:
    """Bytes of weights, gradients and Adam moments per GPU under the repository's sharding rules;
    with pipeline stages the first stage's: ceil(layers / stages) of the MoE stack (what its rule
    stores there when stages divide the layers), the rest on every stage. Gradient accumulation
    (micro-batches without a pipeline) holds two gradients: the running sum the step's scan
    carries and the micro-batch's own (train/step.py)."""
    import jax.numpy as jnp

    from MaxText.config import ConfigError
    from MaxText.models.decoder import PIPELINE_LAYERS
    from MaxText.parallel.sharding import parameter_mesh_axes, parameter_rules, spec_axes

    axis_sizes = {a: layout.size(a) for a in MESH_AXES if a != "stage"}  # the stack's split: below
    if spec.config is None:  # no repository model: split everything over every axis but data
        return 16.0 * spec.params / (layout.num_gpus // layout.size("data"))
    rules = parameter_rules(spec.config, axis_sizes)
    moment_bytes = jnp.dtype(spec.config.moment_dtype).itemsize
    gradients = 2 if layout.pp == 1 and layout.microbatches > 1 else 1
    total = 0.0
    for names, shape, itemsize, trainable in _boxed_leaves(
        architecture(spec.config, keep_length=False).model_dump_json()
    ):
        ways = 1
        if names:
            try:
                assigned = parameter_mesh_axes(names, shape, rules, axis_sizes)
            except ValueError as err:
                raise ConfigError(f"config key 'logical_axis_rules': a parameter {shape} {err}") from None
            for axes in assigned:
                for axis in spec_axes(axes):
                    ways *= axis_sizes.get(axis, 1)
        # the weight, its gradients, Adam's two moments
        per_element = (1 + gradients) * itemsize + 2 * moment_bytes if trainable else itemsize
        if PIPELINE_LAYERS in names:
            layers = shape[names.index(PIPELINE_LAYERS)]
            ways *= layers / math.ceil(layers / layout.pp)
        total += math.prod(shape) / ways * per_element
    return total


def distributed_optimizer_bytes(spec: ModelSpec, layout: Layout, precision: str) -> float:
    dense = spec.params_dense / (layout.tp * layout.pp)
    experts = spec.params_expert / layout.expert_shards
    dp_dense, dp_experts = layout.size("data", "fsdp", "expert"), layout.size("data", "fsdp")
    weights = {"bf16": 2, "fp8": 1, "mxfp8": 2}[precision]  # FP8 weights replace the BF16 copy (fp8-param-gather)
    per_param = weights + 4  # + the fp32 main gradient
    return dense * (per_param + 12 / dp_dense) + experts * (per_param + 12 / dp_experts)


def kept_per_token(spec: ModelSpec, remat: str, layers: float) -> float:
    """Elements per token that ``layers`` of the model's average layer keep for the backward pass
    under ``remat`` (``full``: each layer's input, plus one layer's working set)."""
    share = layers / spec.layers
    kept = {
        "none": spec.act_none,
        "minimal": spec.act_minimal,
        "selective": spec.act_selective,
        "names": spec.act_names,
    }
    if remat in kept:
        return kept[remat] * share
    return spec.d_model * layers + spec.act_layer


def circular_pipeline_activation_bytes(spec: ModelSpec, layout: Layout) -> float:
    """This repository's pipeline (``MaxText/parallel/pipeline.py``): every micro-batch runs
    forward before any runs backward, each of a stage's ``m r + p - 1`` iterations keeping what the
    remat policy keeps of its ``J = moe_layers / (p r)`` layers (so the m micro-batches' activations
    are a stage's share of the batch's, as unpipelined, plus the bubble's iterations). A GPU also
    holds the micro-batches' input, output and waiting buffers and their gradients (four per
    micro-batch); outside the pipeline, the dense layers, the MTP modules and the head run on the
    whole batch's tokens of the GPU (``m / p`` micro-batches' worth), with their fp32 logits one
    ``vocab_chunks`` slice at a time."""
    t = layout.mbs * spec.seq_len / layout.tp  # tokens per GPU per micro-batch inside a stage
    m, pp, r, D = layout.microbatches, layout.pp, layout.vpp, spec.d_model
    stacked = spec.config.num_moe_layers
    batch = t * m / pp
    per_stage, iterations = stacked / (pp * r), m * r + pp - 1
    if layout.remat == "full":  # every layer's input for every iteration, one lane's working set at a time
        inside = D * per_stage * t * iterations + spec.act_layer * t / spec.config.num_pipeline_lanes
    else:
        inside = kept_per_token(spec, layout.remat, per_stage) * t * iterations
    inside += 4 * m * t * D
    outside = kept_per_token(spec, layout.remat, spec.layers - stacked) * batch
    logits = batch * spec.vocab * 4 * 2 / spec.config.vocab_chunks
    return (inside + outside) * ACTIVATION_BYTES + logits


def activation_bytes(spec: ModelSpec, layout: Layout) -> float:
    t = layout.mbs * spec.seq_len / layout.tp
    pp, vpp = layout.pp, layout.vpp
    in_flight = 1 + (pp - 1) / (pp * vpp)  # micro-batches x stage fraction, relative to one whole model
    kept = kept_per_token(spec, layout.remat, spec.layers * in_flight)
    chunks = spec.config.vocab_chunks if spec.config is not None else 1  # one slice of the sequence at a time
    logits = t * spec.vocab * 4 * 2 / chunks if pp == 1 else 0.0  # the last stage holds fewer micro-batches
    return t * kept * ACTIVATION_BYTES + logits


def buffer_bytes(
    spec: ModelSpec, layout: Layout, stack: Stack, exchange_buffer_factor: float, fp8_copies: int = 0
) -> float:
    t = layout.mbs * spec.seq_len / layout.tp
    D, K = spec.d_model, spec.top_k
    if circular.applies(spec, layout, stack) and spec.config.mtp_num_layers:
        t *= layout.microbatches / layout.pp  # the MTP's MoE layer, outside the pipeline, routes the whole batch
    if stack.state == "sharded" and spec.config is not None and layout.ep > 1:
        # this repository's exchange and expert layout, as its own accounting sizes them
        from MaxText.moe.expert_parallel import moe_working_bytes

        config = spec.config.model_copy(update={"moe_ep_buffer_factor": exchange_buffer_factor, "dtype": "bfloat16"})
        name = stack.exchange if stack.exchange in ("allgather", "hierarchical") else "ragged_all_to_all"
        # In chunks (moe_exchange_chunks) each chunk sizes its own buffers, and XLA's schedule
        # keeps two chunks' alive at once (one exchanging while the other computes).
        chunks = spec.config.moe_exchange_chunks if name != "allgather" else 1
        per_node = layout.local(*layout.ep_axes)
        exchange = min(chunks, 2) * moe_working_bytes(config, int(t) // chunks, layout.ep, name, per_node)
    elif stack.exchange == "allgather":
        exchange = 2 * t * layout.ep * D * ACTIVATION_BYTES
    else:
        exchange = 2 * exchange_buffer_factor * t * min(K, layout.ep) * D * ACTIVATION_BYTES
    gathered = 0.0
    if stack.state == "sharded":
        per_layer = spec.params_dense / spec.layers / layout.tp + spec.params_expert / spec.moe_layers / (
            layout.expert_shards / layout.pp
        )
        gathered = (2 + fp8_copies) * per_layer * ACTIVATION_BYTES
    return exchange + gathered


def memory_per_gpu(
    spec: ModelSpec,
    layout: Layout,
    stack: Stack,
    precision: str,
    exchange_buffer_factor: float,
    fp8_kernels: str = "fused",
) -> dict[str, float]:
    """Bytes per GPU by kind, and their total (the worst pipeline stage)."""
    fp8_copies = 2 if precision != "bf16" and fp8_kernels == "emulated" else 0
    if stack.state == "sharded":
        state = sharded_state_bytes(spec, layout)
    else:
        state = distributed_optimizer_bytes(spec, layout, precision)
    pipelined_here = circular.applies(spec, layout, stack)
    parts = {
        "state": state,
        "activations": (circular_pipeline_activation_bytes if pipelined_here else activation_bytes)(spec, layout),
        "buffers": buffer_bytes(spec, layout, stack, exchange_buffer_factor, fp8_copies),
    }
    parts["total"] = sum(parts.values())
    return parts
