"""Ahead-of-time compilation of the real train step for a cluster's mesh, on simulated CPU devices.

The training loop's own pieces (config loader, ``make_mesh``, ``abstract_train_state``,
``jit_train_step``) are lowered from ``jax.ShapeDtypeStruct`` inputs carrying their shardings and
compiled for N devices (``--xla_force_host_platform_device_count=N``, set by ``tools/aot_compile.py``
before JAX starts); nothing is allocated. XLA's SPMD partitioner then shows what one GPU of the
cluster would hold: ``memory_analysis()`` gives the arguments (state + batch), outputs, temporaries
and code per device, and the optimized HLO gives FLOPs and every collective (``hlo_stats.py``,
which also corrects for ``while`` loops, counted once by XLA's cost analysis).

Two things differ from a GPU compile, on purpose and reported: ``dtype: auto`` is resolved for the
target platform (``hardware``, GPU unless it says cpu), and MoE choices XLA:CPU cannot run are
replaced by their CPU-legal equivalents: Transformer Engine / ``ragged_dot`` by ``blocked`` (same
FLOPs, dense per-block matmuls; XLA:CPU would expand ``ragged_dot`` into a dense matmul over every
expert), ``te`` / ``ragged_all_to_all`` exchanges by ``all_to_all`` (the same slots, moved whole:
an upper bound on the bytes a ragged exchange moves).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import flax.linen as nn
import jax
import jax.numpy as jnp

from MaxText.config import Config
from MaxText.layers.attention_ops import resolve_attention
from MaxText.models.accounting import count_parameters, train_flops
from MaxText.models.deepseek import DeepSeekV3
from MaxText.moe.blocked import level_rows
from MaxText.moe.experts import moe_context, resolve_backend, resolve_exchange
from MaxText.parallel.mesh import make_mesh
from MaxText.parallel.sharding import axis_rules, batch_sharding
from MaxText.train.hlo_stats import hlo_stats
from MaxText.train.optimizer import make_optimizer
from MaxText.train.state import abstract_train_state
from MaxText.train.step import jit_train_step

BATCH_KEYS = ("inputs", "targets", "inputs_position", "inputs_segmentation", "targets_segmentation")
# XLA:CPU cannot run these; compile the nearest CPU-legal choice instead.
CPU_BACKEND = {"te": "blocked", "ragged_dot": "blocked"}
CPU_EXCHANGE = {"te": "all_to_all", "ragged_all_to_all": "all_to_all"}
CPU_ATTENTION = {"te": "flash", "cudnn": "flash"}  # fused flash attention -> the blockwise JAX one


def target_platform(config: Config) -> str:
    return "cpu" if config.hardware == "cpu" else "gpu"


@dataclass
class Choices:
    backend_target: str  # what the target platform would run
    exchange_target: str
    backend_compiled: str  # what was compiled here
    exchange_compiled: str
    attention_target: str
    attention_compiled: str


def for_cpu_compile(config: Config) -> tuple[Config, Choices]:
    """The config compiled here: dtype for the target platform, MoE choices XLA:CPU can run."""
    platform = target_platform(config)
    config = config.with_platform(platform)
    backend = resolve_backend(config.moe_matmul, platform)
    exchange = resolve_exchange(config.moe_ep_comm, platform)
    if backend == "ragged_dot" and platform == "gpu":
        backend_target = "te if Transformer Engine imports, else ragged_dot"
    else:
        backend_target = backend
    exchange_target = (
        "te if Transformer Engine imports, else ragged_all_to_all" if exchange == "ragged_all_to_all" else exchange
    )
    attention = resolve_attention(config, config.max_target_length, platform)
    if config.attention == "auto" and platform == "gpu":
        attention_target = "te if Transformer Engine imports, else cudnn"
    else:
        attention_target = attention
    choice = Choices(
        backend_target,
        exchange_target,
        CPU_BACKEND.get(backend, backend),
        CPU_EXCHANGE.get(exchange, exchange),
        attention_target,
        CPU_ATTENTION.get(attention, attention),
    )
    config = config.model_copy(
        update={
            "moe_matmul": choice.backend_compiled,
            "moe_ep_comm": choice.exchange_compiled,
            "attention": choice.attention_compiled,
        }
    )
    return config, choice


@dataclass
class AotReport:
    devices: int
    mesh: dict[str, int]
    dtype: str
    choices: Choices  # what was compiled and what the target would run
    memory: dict[str, int]  # bytes per device
    xla_flops: float  # cost_analysis()["flops"], per device, loops counted once
    dot_flops: float  # matmul FLOPs per device from the HLO, loops multiplied by their trip counts
    model_flops: float  # the accounting's training FLOPs per device per step (no remat)
    expected_flops: float  # the accounting plus what the program recomputes (remat) and its attention does
    collectives: dict[str, dict[str, float]]
    collectives_by_axes: dict[str, dict[str, float]]
    loops: list[tuple[str, int]]
    largest_collectives: list[tuple[str, float, str]]  # (kind, bytes, JAX op), biggest first
    collectives_by_op: dict[str, float]  # "all-gather of top_k" -> bytes per step
    state_bytes: int  # the whole train state over all devices (parameter arithmetic)
    lower_s: float
    compile_s: float
    warnings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def abstract_batch(config: Config, mesh) -> dict[str, jax.ShapeDtypeStruct]:
    rows = config.global_batch_size(mesh.size)
    sharding = batch_sharding(mesh, config)
    return {k: jax.ShapeDtypeStruct((rows, config.max_target_length), jnp.int32, sharding=sharding) for k in BATCH_KEYS}


def expected_step_flops(config: Config, tokens: int) -> tuple[float, float]:
    """(model FLOPs, FLOPs the compiled program should do) for ``tokens`` tokens.

    The accounting counts the model's math: 6 x active weights, and causal attention as forward
    (QK^T and PV over S/2 keys on average) + backward (twice the forward). The program does more:
    remat (``full`` or ``minimal``, as an upper bound) recomputes each scanned decoder layer's
    forward inside the backward (+1/3 of its training FLOPs; the MTP module's layer is not
    rematerialised); with ``vocab_chunks`` > 1 the loss recomputes every head's forward
    (+1/3 of its training FLOPs); ``dot`` attention computes every [S, S] score (2x the causal count);
    ``flash`` visits (n+1)/n of the causal blocks (n query blocks, the diagonal ones whole) and its
    backward recomputes the scores (5 matmuls against autodiff's 4: 7/6)."""
    counts = count_parameters(config)
    flops = train_flops(config, counts)
    head = 6 * counts.main["output_head"]
    layers = flops.matmul - head
    per_layer_attention = flops.attention / max(config.base_num_decoder_layers, 1)
    remat = config.remat_policy != "none"
    if config.attention == "dot":
        attention_factor, remat_attention = 2.0, 2.0 * (1 + 1 / 3)
    else:  # flash
        n = -(-config.max_target_length // config.attention_block_q)
        attention_factor = (n + 1) / n * 7 / 6
        remat_attention = (n + 1) / n * 9 / 6
    main = layers * (1 + 1 / 3 if remat else 1) + flops.attention * (remat_attention if remat else attention_factor)
    mtp = flops.mtp + config.mtp_num_layers * per_layer_attention * (attention_factor - 1)
    if config.vocab_chunks > 1:
        head += head / 3 * (1 + config.mtp_num_layers)
    return float(flops.total) * tokens, (main + head + mtp) * tokens


def balanced_block_trips(config: Config, tokens_per_device: int, ep: int) -> Callable[[set[int]], float]:
    """Trip counts of the data-dependent loops: the blocked backend's per-level loop under
    balanced routing (each local expert gets ``ep x T x K / E`` copies, cut into blocks of halving
    sizes as ``expert_blocks`` does) and flash attention's causal loop over key blocks. A loop is
    told apart by the dims all its matmuls share (block size and expert hidden dim, or key block
    and head dim)."""
    levels = level_rows(config.moe_block_rows, config.moe_min_block_rows)
    copies = ep * tokens_per_device * config.num_experts_per_tok // config.num_experts
    padded = -(-copies // levels[-1]) * levels[-1]
    per_expert = [padded // levels[0]] + [(padded % levels[0]) // B % 2 for B in levels[1:]]
    local_experts = config.num_experts // ep

    # flash attention's inner loop visits the key blocks up to the diagonal: (n + 1) / 2 on average
    flash_blocks = -(-config.max_target_length // config.attention_block_kv)
    head_dims = {config.qk_head_dim, config.v_head_dim}

    def trips(dims: set[int]) -> float:
        sizes = [B for B in levels if B in dims]
        if sizes and config.base_moe_mlp_dim in dims:
            return local_experts * per_expert[levels.index(max(sizes))]
        if config.attention_block_kv in dims and dims & head_dims:
            return (flash_blocks + 1) / 2
        return 1

    return trips


def compile_train_step(config: Config, num_devices: int | None = None) -> tuple[AotReport, object]:
    """Lower and compile the train step for the first ``num_devices`` devices (all by default);
    return the report and the compiled executable."""
    config, choice = for_cpu_compile(config)
    devices = jax.devices()[: num_devices or len(jax.devices())]
    mesh = make_mesh(config, devices)
    model = DeepSeekV3(config)
    optimizer = make_optimizer(config)
    state = abstract_train_state(model, config, optimizer, mesh)
    batch = abstract_batch(config, mesh)
    state_shardings = jax.tree.map(lambda leaf: leaf.sharding, state)
    step = jit_train_step(model, config, optimizer, state_shardings, batch_sharding(mesh, config))
    tokens_per_device = config.micro_batch_size(len(devices)) * config.max_target_length // len(devices)
    with jax.set_mesh(mesh), nn.logical_axis_rules(axis_rules(config)), moe_context(config, mesh, tokens_per_device):
        t0 = time.perf_counter()
        lowered = step.lower(state, batch)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
    mem = compiled.memory_analysis()
    memory = {
        "arguments": mem.argument_size_in_bytes,
        "outputs": mem.output_size_in_bytes,
        "aliased": mem.alias_size_in_bytes,
        "temp": mem.temp_size_in_bytes,
        "code": mem.generated_code_size_in_bytes,
    }
    memory["total"] = memory["arguments"] + memory["outputs"] - memory["aliased"] + memory["temp"] + memory["code"]
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    ep = mesh.shape[expert_axis_name] if (expert_axis_name := _exp_axis(config)) else 1
    block_trips = balanced_block_trips(config, tokens_per_device, ep)
    stats = hlo_stats(compiled.as_text(), dict(mesh.shape), block_trips)
    tokens = config.global_batch_size(len(devices)) * config.max_target_length
    model_flops, expected = expected_step_flops(config, tokens)
    state_bytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(state))
    report = AotReport(
        devices=len(devices),
        mesh=dict(mesh.shape),
        dtype=config.dtype,
        choices=choice,
        memory=memory,
        xla_flops=float(cost.get("flops", 0.0)),
        dot_flops=stats.dot_flops,
        model_flops=model_flops / len(devices),
        expected_flops=expected / len(devices),
        collectives=stats.collectives,
        collectives_by_axes=stats.by_axes,
        loops=stats.loops,
        largest_collectives=stats.largest,
        collectives_by_op=stats.by_op,
        state_bytes=state_bytes,
        lower_s=t1 - t0,
        compile_s=t2 - t1,
    )
    return report, compiled


def _exp_axis(config: Config) -> str | None:
    axes = nn.logical_to_mesh_axes(("exp",), axis_rules(config))[0]
    return axes if isinstance(axes, str) else None


GB = 1e9


def format_report(r: AotReport, hbm_gb: float | None) -> str:
    m = r.memory
    mesh = " x ".join(f"{k} {v}" for k, v in r.mesh.items() if v > 1) or "one device"
    lines = [
        f"devices {r.devices} (mesh {mesh}), dtype {r.dtype}",
        f"compiled with attention={r.choices.attention_compiled} moe_matmul={r.choices.backend_compiled}"
        f" moe_ep_comm={r.choices.exchange_compiled}; the target runs attention: {r.choices.attention_target};"
        f" moe_matmul: {r.choices.backend_target}; moe_ep_comm: {r.choices.exchange_target}",
        f"lower {r.lower_s:.1f} s, compile {r.compile_s:.1f} s",
        "",
        "memory per device (XLA memory_analysis)          GB",
        f"  arguments (train state + batch)          {m['arguments'] / GB:10.2f}",
        f"  outputs (new state aliases the donated)  {m['outputs'] / GB:10.2f}  ({m['aliased'] / GB:.2f} aliased)",
        f"  temp (activations, buffers)              {m['temp'] / GB:10.2f}",
        f"  generated code                           {m['code'] / GB:10.2f}",
        f"  total                                    {m['total'] / GB:10.2f}"
        + (f"  of {hbm_gb:.0f} GB HBM" if hbm_gb else ""),
        f"  state by parameter arithmetic / devices  {r.state_bytes / r.devices / GB:10.2f}",
        "",
        "FLOPs per device per step                        TFLOP",
        f"  XLA cost_analysis (loops counted once)   {r.xla_flops / 1e12:10.2f}",
        f"  matmuls in the HLO x loop trip counts    {r.dot_flops / 1e12:10.2f}",
        f"  model (tools/model_stats.py accounting)  {r.model_flops / 1e12:10.2f}"
        f"   HLO / model = {r.dot_flops / max(r.model_flops, 1):.3f}",
        f"  model + remat + attention as compiled    {r.expected_flops / 1e12:10.2f}"
        f"   HLO / this  = {r.dot_flops / max(r.expected_flops, 1):.3f}",
        f"  while loops: {len(r.loops)}, trip counts {sorted({n for _, n in r.loops})}",
        "",
        "collectives per device per step                count        GB",
    ]
    for kind, v in r.collectives.items():
        lines.append(f"  {kind:<42} {v['count']:6.0f} {v['bytes'] / GB:10.3f}")
    for key, v in sorted(r.collectives_by_axes.items()):
        lines.append(f"    {key:<40} {v['count']:6.0f} {v['bytes'] / GB:10.3f}")
    lines.append("  largest single collectives:")
    for kind, nbytes, op in r.largest_collectives[:6]:
        lines.append(f"    {kind:<18} {nbytes / GB:8.3f} GB  {op[-90:]}")
    for w in r.warnings:
        lines.append(f"warning: {w}")
    return "\n".join(lines)
