"""Ahead-of-time compilation of the real train step for a cluster's mesh, nothing allocated.

The training loop's own pieces (config loader, ``make_mesh``, ``abstract_train_state``,
``jit_train_step``) are lowered from ``jax.ShapeDtypeStruct`` inputs carrying their shardings and
compiled for N devices of one of two kinds:

- simulated CPU devices (``--xla_force_host_platform_device_count=N``, set by
  ``tools/aot_compile.py`` before JAX starts): XLA:CPU's figures, with the MoE and attention
  choices XLA:CPU cannot run replaced by their CPU-legal equivalents (Transformer Engine and
  ``ragged_dot`` by ``blocked``, the same FLOPs as per-block dense matmuls; ``te`` and
  ``ragged_all_to_all`` exchanges by ``all_to_all``, the same slots moved whole; cuDNN attention by
  ``flash``); bfloat16 collectives run in float32 there.
- a GPU target's compile-only devices (``targets.py``; JAX's CUDA plugin, ``make gpu-compile-deps``):
  XLA:GPU's own program for that GPU and the cluster's NVLink domains, its memory, the collectives
  at the dtypes the GPU sends and the latency-hiding scheduler's placement of them
  (``overlap.py``). ``auto`` keys resolve as on a GPU without Transformer Engine: TE's custom calls
  ask the device for its properties while tracing, so an explicit ``te`` is refused.

Either way ``memory_analysis()`` gives the arguments (state + batch), outputs, temporaries and
code per device, and the optimized HLO gives FLOPs and every collective (``hlo_stats.py``, which
also corrects for ``while`` loops, counted once by XLA's cost analysis).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np
from jax.experimental.compilation_cache import compilation_cache

from MaxText.aot.hlo_stats import hlo_stats
from MaxText.aot.overlap import CostInputs, ScheduledProgram
from MaxText.aot.report import AotReport, Choices
from MaxText.aot.targets import GpuTarget, answering_device_queries
from MaxText.aot.thunks import read_dump
from MaxText.config import MODEL_PROFILES, Config, ConfigError
from MaxText.layers.attention_ops import ATTENTION_SCOPE, resolve_attention
from MaxText.layers.vocab_parallel import vocab_group
from MaxText.models.accounting import count_parameters, train_flops
from MaxText.models.deepseek import DeepSeekV3
from MaxText.moe.blocked import level_rows
from MaxText.moe.expert_parallel import devices_per_node, expert_axis
from MaxText.moe.experts import EXPERTS_SCOPE, config_backend, moe_context, resolve_exchange
from MaxText.parallel.mesh import make_mesh
from MaxText.parallel.pipeline import bubble_fraction
from MaxText.parallel.platform import compiling_for
from MaxText.parallel.sharding import axis_rules, batch_sharding
from MaxText.planner.routing import expected_domains
from MaxText.planner.systems import System, system_of_device
from MaxText.quantization.quantize import check_quantization
from MaxText.train import xla_memory
from MaxText.train.optimizer import make_optimizer
from MaxText.train.preflight import abstract_batch, compiled_memory, step_io_bytes
from MaxText.train.state import abstract_train_state
from MaxText.train.step import jit_train_step

# XLA:CPU cannot run these; compile the nearest CPU-legal choice instead.
CPU_BACKEND = {"te": "blocked", "ragged_dot": "blocked", "tokamax": "blocked"}
CPU_EXCHANGE = {"te": "all_to_all", "ragged_all_to_all": "all_to_all"}
CPU_ATTENTION = {"te": "flash", "cudnn": "flash"}  # fused flash attention -> the blockwise JAX one
# The exchanges that take a device's tokens in ``moe_exchange_chunks`` chunks.
CHUNKED_EXCHANGES = ("all_to_all", "ragged_all_to_all", "hierarchical")
# What a deviceless GPU compile can take instead of Transformer Engine, per key.
INSTEAD_OF_TE = {
    "moe_matmul": "tokamax, blocked or ragged_dot",
    "moe_ep_comm": "ragged_all_to_all, all_to_all or allgather",
    "attention": "cudnn, flash or dot",
}
SCOPES = (EXPERTS_SCOPE, ATTENTION_SCOPE)
# The debug option that gives XLA:GPU's latency-hiding scheduler a profile of instruction costs.
PROFILE_OPTION = "xla_gpu_pgle_profile_file_or_directory_path"


def pipeline_summary(config: Config) -> dict | None:
    """The pipeline's shape and bubble, None without one."""
    if config.pipeline_stages == 1:
        return None
    stages, repeats, microbatches = config.pipeline_stages, config.num_pipeline_repeats, config.pipeline_microbatches
    return {
        "stages": stages,
        "repeats": repeats,
        "microbatches": microbatches,
        "lanes": config.num_pipeline_lanes,
        "bubble": bubble_fraction(stages, repeats, microbatches),
    }


def target_platform(config: Config) -> str:
    return "cpu" if config.hardware == "cpu" else "gpu"


def _with_choices(config: Config, choice: Choices) -> Config:
    update = {
        "moe_matmul": choice.backend_compiled,
        "moe_ep_comm": choice.exchange_compiled,
        "attention": choice.attention_compiled,
    }
    return config.model_copy(update=update)


def _resolved(config: Config, platform: str) -> tuple[tuple[str, str, str], Choices]:
    """(moe_matmul, moe_ep_comm, attention) as ``platform`` runs them without Transformer Engine,
    and a ``Choices`` whose target names say where TE takes over (``auto`` on a GPU)."""
    names = (
        config_backend(config, platform, te=False),
        resolve_exchange(config.moe_ep_comm, platform, te=False),
        resolve_attention(config, config.max_target_length, platform, te=False),
    )

    def target(key: str, name: str) -> str:
        # auto attention goes to TE only where it would go to cuDNN (16-bit on a GPU); auto's
        # grouped matmul never goes to TE
        takes_te = platform == "gpu" and getattr(config, key) == "auto" and key != "moe_matmul"
        takes_te = takes_te and (key != "attention" or name == "cudnn")
        return f"te if Transformer Engine imports, else {name}" if takes_te else name

    targets = [target(key, name) for key, name in zip(INSTEAD_OF_TE, names, strict=True)]
    return names, Choices(targets[0], targets[1], *names[:2], targets[2], names[2])


def for_cpu_compile(config: Config) -> tuple[Config, Choices]:
    """The config compiled on simulated CPU devices: dtype for the target platform, MoE and
    attention choices XLA:CPU can run."""
    platform = target_platform(config)
    config = config.with_platform(platform)
    (backend, exchange, attention), choice = _resolved(config, platform)
    choice.backend_compiled = CPU_BACKEND.get(backend, backend)
    choice.exchange_compiled = CPU_EXCHANGE.get(exchange, exchange)
    choice.attention_compiled = CPU_ATTENTION.get(attention, attention)
    return _with_choices(config, choice), choice


def for_gpu_compile(config: Config) -> tuple[Config, Choices]:
    """The config compiled for a GPU target: ``auto`` as on a GPU without Transformer Engine,
    an explicit ``te`` refused (its custom calls need the device while tracing)."""
    config = config.with_platform("gpu")
    for key in INSTEAD_OF_TE:
        if getattr(config, key) == "te":
            raise ConfigError(
                f"config key '{key}': te cannot be compiled for a GPU target without the GPU (Transformer "
                f"Engine's custom calls query the device while tracing); compile {INSTEAD_OF_TE[key]} here"
            )
    _, choice = _resolved(config, "gpu")
    return _with_choices(config, choice), choice


def attention_factors(config: Config) -> tuple[float, float]:
    """(without remat, with remat): the attention FLOPs the compiled backend runs per step,
    relative to the accounting's causal count (forward QK^T and PV over the causal half, backward
    twice that). ``dot`` computes every [S, S] score (2x); ``flash`` visits (n+1)/n of the causal
    blocks (n query blocks, the diagonal ones whole) and its backward recomputes the scores (5
    matmuls against autodiff's 4: 7/6); cuDNN's flash kernel runs forward ``qk + v`` and backward
    ``3 qk + 2 v`` (scores recomputed; autodiff's ``2 qk + 2 v``) over the causal half. Remat
    reruns the forward once more."""
    if config.attention == "dot":
        return 2.0, 2.0 * (1 + 1 / 3)
    if config.attention == "cudnn":
        qk, v = config.qk_head_dim, config.v_head_dim
        backward = (3 * qk + 2 * v) / (qk + v)
        return (1 + backward) / 3, (2 + backward) / 3
    n = -(-config.max_target_length // config.attention_block_q)
    return (n + 1) / n * 7 / 6, (n + 1) / n * 9 / 6


def expected_step_flops(config: Config, tokens: int, head_split: bool = False) -> dict[str, float]:
    """FLOPs of ``tokens`` tokens: ``model`` (the accounting), ``compiled`` (what the program
    should do: the accounting plus what remat recomputes and what its attention does), and the
    expected FLOPs of the two named scopes, the routed experts at their dropless ideal
    (6 x the K of E experts' weights per token) and the attention core.

    Remat (``full`` or ``minimal``, as an upper bound) recomputes each scanned decoder layer's
    forward inside the backward (+1/3 of its training FLOPs; the MTP module's layer is not
    rematerialised); with ``vocab_chunks`` > 1, or the head split over the vocabulary
    (``head_split``), the loss recomputes every head's forward (+1/3 of its training FLOPs).
    Pipelined, the MoE stack's stages compute through the bubble too
    (``(r m + p - 1) / (r m)`` of the useful iterations; each layer is rematerialised as without
    the pipeline, nothing more). A rerun of the routed experts is +2/9
    of their training FLOPs (their down-projection's output is not needed: the router weight
    scales its input), +1/3 with ``blocked``."""
    counts = count_parameters(config)
    flops = train_flops(config, counts)
    head = 6 * counts.main["output_head"]
    layers = flops.matmul - head
    per_layer_attention = flops.attention / max(config.base_num_decoder_layers, 1)
    remat = 1 + 1 / 3 if config.remat_policy != "none" else 1
    plain, rematted = attention_factors(config)
    attention = flops.attention * (rematted if remat > 1 else plain)
    mtp_attention = config.mtp_num_layers * per_layer_attention * plain
    main = layers * remat + attention
    mtp = flops.mtp + mtp_attention - config.mtp_num_layers * per_layer_attention
    if config.vocab_chunks > 1 or head_split:
        head += head / 3 * (1 + config.mtp_num_layers)
    active = config.num_experts_per_tok / config.num_experts
    # Remat's rerun of the routed experts: all three GEMMs for ``blocked`` (the router weight
    # scales their output, and its gradient reads it), the two input projections for the others
    # (it scales the hidden activations, so no gradient reads the down-projection's output).
    rerun = 1 / 3 if config.moe_matmul == "blocked" else 2 / 9  # one rerun of their forward
    routed_remat = 1 + rerun if remat > 1 else 1
    routed = counts.main["routed_experts"] * routed_remat
    main -= 6 * active * counts.main["routed_experts"] * (remat - routed_remat)
    if config.pipeline_stages > 1:  # the stack's layers also compute through the bubble's iterations
        stages, repeats, m = config.pipeline_stages, config.num_pipeline_repeats, config.pipeline_microbatches
        extra = 1 / (1 - bubble_fraction(stages, repeats, m)) - 1  # idle iterations over the useful ones
        layer_share = config.num_moe_layers / max(config.base_num_decoder_layers, 1)
        parts = counts.main
        stack = 6 * (parts["attention"] * layer_share + parts["router"] + parts["shared_experts"]) * remat
        stack += 6 * active * parts["routed_experts"] * routed_remat
        stack_attention = per_layer_attention * config.num_moe_layers * (rematted if remat > 1 else plain)
        main += (stack + stack_attention) * extra
        attention += stack_attention * extra
        routed *= 1 + extra
    experts = 6 * active * (routed + counts.mtp_parts["routed_experts"])
    return {
        "model": float(flops.total) * tokens,
        "compiled": (main + head + mtp) * tokens,
        EXPERTS_SCOPE: experts * tokens,
        ATTENTION_SCOPE: (attention + mtp_attention) * tokens,
    }


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

    def trips(common: set[int], every: set[int]) -> float:
        sizes = [B for B in levels if B in common]
        if sizes and config.base_moe_mlp_dim in every:
            return local_experts * per_expert[levels.index(max(sizes))]
        if config.attention_block_kv in common and every & head_dims:
            return (flash_blocks + 1) / 2
        return 1

    return trips


def balanced_expert_rows(config: Config, tokens_per_device: int) -> Callable[[int], float]:
    """The rows a grouped GEMM kernel computes of a layout's ``M``: every copy routed to the
    device's experts under balanced routing (``tokens_per_device x K`` with or without expert
    parallelism), at most the layout's rows (the rest is padding or room for imbalance)."""
    copies = tokens_per_device * config.num_experts_per_tok
    return lambda rows: min(rows, copies)


def ragged_rows(
    config: Config, tokens_per_device: int, ep: int, exchange: str = "ragged_all_to_all"
) -> tuple[int, int | None]:
    """The rows a ragged exchange moves per device under balanced routing, and on the two-hop
    exchange those its hop inside a node moves (else None). One hop: each token once to each of
    up to ``min(K, ep)`` devices (out into the slots, and back into the packed layout). Two hops:
    each token once to each node its experts reach across nodes, and inside a node one row per
    (token, device) pair, a row carrying the token's copies for that device (``_rows_per_token``)."""
    per_node = devices_per_node(config, ep)
    if exchange != "hierarchical" or per_node in (1, ep):
        return tokens_per_device * min(config.num_experts_per_tok, ep), None
    across = round(tokens_per_device * _rows_per_token(config, ep // per_node))
    return across, round(tokens_per_device * _rows_per_token(config, ep))


def _rows_per_token(config: Config, domains: int) -> float:
    """The ``domains`` (equal blocks of consecutive experts: nodes, devices) a token's experts
    reach, as the repository's router picks them on balanced scores (``planner/routing.py``)."""
    return expected_domains(
        config.num_experts,
        config.num_experts_per_tok,
        config.n_routing_groups,
        config.topk_routing_group,
        domains,
        config.routed_score_func,
    )


def routed_per_chunk(config: Config, devices: int, exchange: str) -> int:
    """The routed tokens one device's MoE kernels and buffers take at a time: all of its own, or
    one chunk's with a chunked ``exchange`` (``moe_exchange_chunks``)."""
    routed = config.routed_tokens_per_device(devices)
    return routed // config.moe_exchange_chunks if exchange in CHUNKED_EXCHANGES else routed


def cost_model_inputs(config: Config, mesh: jax.sharding.Mesh, system: System, exchange: str, ep: int) -> CostInputs:
    """What the cost model (``overlap.py``) needs besides a program compiled for ``mesh`` on
    ``system`` with ``ep``-way expert parallelism and ``exchange``: each device's NVLink domain,
    the rows a ragged exchange moves and the data-dependent loops' trips and grouped GEMMs' rows
    under balanced routing. The two-hop exchange's rows come from sampling the router, which runs
    on the host's devices: called outside a compile-only mesh."""
    devices = mesh.devices.size
    routed = routed_per_chunk(config, devices, exchange)
    domain_size = system.domain_gpus(devices)
    rows, inside_rows = ragged_rows(config, routed, ep, exchange)
    return CostInputs(
        system,
        np.array([d.id // domain_size for d in mesh.devices.flat]),
        rows,
        balanced_block_trips(config, routed, ep),
        balanced_expert_rows(config, routed),
        inside_rows,
    )


def profile_guided(
    compile_once: Callable[[dict], tuple], options: dict, setting: str, inputs: CostInputs | None
) -> tuple[tuple, ScheduledProgram | None]:
    """Compile for a GPU under ``latency_profile`` (base.yml): ``""`` once, XLA's scheduler with
    its own estimates; a file, once with that profile; ``model`` or ``model_contended``, twice, the
    second time with the cost model's time for every instruction of the first
    (``ScheduledProgram.latency_profile``: a collective's link time, or with ``model_contended`` its
    duration beside the others in flight), which is what a profile measured on the GPU would tell
    it if the model were right. Up to the scheduler both compiles are the same, so the
    instructions' names match (the AOT report says how many did: ``profile_names_found``).
    ``compile_once(options)`` returns a tuple whose first element is the compiled program; this
    returns the last one's and the first program as the cost model read it (None when there was
    one compile)."""
    if not setting:
        return compile_once(options), None
    if setting not in MODEL_PROFILES:
        return compile_once(
            {**options, PROFILE_OPTION: _stable_copy(Path(setting).read_bytes(), Path(setting).suffix)}
        ), None
    first = ScheduledProgram(compile_once(options)[0].as_text(), inputs)
    profile = first.latency_profile(contended=setting == "model_contended").encode()
    return compile_once({**options, PROFILE_OPTION: _stable_copy(profile, ".pbtxt")}), first


def _stable_copy(profile: bytes, suffix: str) -> str:
    """A path for the profile named by its contents: JAX's compilation cache keys a program by its
    compile options, the path among them, so the same profile must keep the same path (a run that
    restarts finds its step in the cache) and a changed one must not."""
    folder = Path(tempfile.gettempdir()) / "latency-profiles"
    folder.mkdir(exist_ok=True)
    path = folder / f"{hashlib.sha256(profile).hexdigest()[:32]}{suffix}"
    if not path.exists():  # written whole, then renamed: processes on one host may race here
        partial = path.with_name(f"{path.name}.{os.getpid()}")
        partial.write_bytes(profile)
        os.replace(partial, path)
    return str(path)


def compile_for_devices(
    lowered: jax.stages.Lowered, options: dict, config: Config, mesh: jax.sharding.Mesh
) -> jax.stages.Compiled:
    """The training loop's compile of its step: on a GPU under ``latency_profile``
    (``profile_guided``), elsewhere once. Called where the step is traced: the mesh and the
    logical-axis rules name the expert axis."""
    device = mesh.devices.flat[0]
    if device.platform != "gpu" or not config.latency_profile:
        return lowered.compile(compiler_options=options or None)
    inputs = None
    if config.latency_profile in MODEL_PROFILES:
        if (system := system_of_device(device.device_kind)) is None:
            raise ConfigError(
                f"config key 'latency_profile': {config.latency_profile}, but the cost model has no GPU named"
                f" {device.device_kind!r}"
            )
        ep = mesh.shape[axis] if (axis := expert_axis()) else 1
        inputs = cost_model_inputs(config, mesh, system, resolve_exchange(config.moe_ep_comm, "gpu"), ep)
    (compiled,), _ = profile_guided(
        lambda opts: (lowered.compile(compiler_options=opts),), options, config.latency_profile, inputs
    )
    return compiled


def compile_train_step(
    config: Config,
    devices: list | None = None,
    target: GpuTarget | None = None,
    memory_fraction: float = xla_memory.JAX_MEMORY_FRACTION,
):
    """Lower and compile the train step for ``devices`` (default: every JAX device), which are a
    GPU ``target``'s compile-only devices when one is given, with XLA planning for the
    ``memory_fraction`` of the HBM that JAX's allocator takes (``train/xla_memory.py``); return the
    report and the compiled executable."""
    if target is None:
        return _compile(*for_cpu_compile(config), list(devices if devices is not None else jax.devices()), None)
    check_quantization(config, "gpu", target.compute_capability)
    with compiling_for("gpu"), answering_device_queries(target, devices[0]):  # the model is traced from here on
        return _compile(*for_gpu_compile(config), list(devices), target, memory_fraction)


@contextlib.contextmanager
def _without_persistent_cache() -> Iterator[None]:
    """The report reads XLA's warnings and the HLO's metadata, which only a compile gives: an
    executable from JAX's persistent compilation cache brings neither (its key leaves the metadata
    out). JAX decides once per process whether it uses the cache, so the decision is reset on the
    way in and out: a switch of the whole process, not safe beside another thread's compiles."""
    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
        compilation_cache.reset_cache()


def _compile_lowered(
    lowered: jax.stages.Lowered, dump_thunks: bool, options: dict
) -> tuple[jax.stages.Compiled, set[str] | None]:
    """The compiled program, and for a GPU target the loops and conditionals its runtime decides
    on the host (``thunks.py``, from XLA's dump of the thunk sequence; None without one)."""
    with _without_persistent_cache():
        if not dump_thunks:
            return lowered.compile(compiler_options=options or None), None
        with tempfile.TemporaryDirectory(prefix="aot-dump-") as folder:
            compiled = lowered.compile(compiler_options={**options, "xla_dump_to": folder})
            return compiled, read_dump(Path(folder))


def _compile(
    config: Config,
    choice: Choices,
    devices: list,
    target: GpuTarget | None,
    memory_fraction: float = xla_memory.JAX_MEMORY_FRACTION,
):
    mesh = make_mesh(config, devices)
    model = DeepSeekV3(config)
    optimizer = make_optimizer(config)
    state = abstract_train_state(model, config, optimizer, mesh)
    batch = abstract_batch(config, mesh)
    state_shardings = jax.tree.map(lambda leaf: leaf.sharding, state)
    step = jit_train_step(model, config, optimizer, state_shardings, batch_sharding(mesh, config))
    tokens_per_device = config.tokens_per_device(len(devices))
    with jax.set_mesh(mesh), nn.logical_axis_rules(axis_rules(config)):
        ep = mesh.shape[axis] if (axis := expert_axis()) else 1
    if target:  # outside the compile-only mesh: see cost_model_inputs
        inputs = cost_model_inputs(config, mesh, target.hardware, choice.exchange_compiled, ep)
        block_trips, expert_rows = inputs.dynamic_trips, inputs.expert_rows
    else:
        routed = routed_per_chunk(config, len(devices), choice.exchange_compiled)
        block_trips, expert_rows = balanced_block_trips(config, routed, ep), balanced_expert_rows(config, routed)
    with jax.set_mesh(mesh), nn.logical_axis_rules(axis_rules(config)), moe_context(config, mesh, tokens_per_device):
        head_split = bool(vocab_group(config.vocab_size, config.vocab_axes()))
        t0 = time.perf_counter()
        lowered = step.lower(state, batch)
        t1 = time.perf_counter()
        io_bytes = step_io_bytes(state, batch)
        options = {}
        if target:  # XLA plans for the allocator's share of the HBM, as the training loop has it
            options = xla_memory.compiler_options(target.hbm_bytes, memory_fraction * target.hbm_bytes, io_bytes)
        first = None
        # custom partitioning (cuDNN attention) calls back into Python here
        if target:
            (compiled, host_decided), first = profile_guided(
                lambda opts: _compile_lowered(lowered, True, opts), options, config.latency_profile, inputs
            )
        else:
            compiled, host_decided = _compile_lowered(lowered, False, options)
        t2 = time.perf_counter()
    memory = compiled_memory(compiled)
    slop = xla_memory.slop_used(options)  # the slop factor XLA planned the program with
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    text = compiled.as_text()
    stats = hlo_stats(text, dict(mesh.shape), block_trips, SCOPES, expert_rows, host_decided)
    tokens = config.global_batch_size(len(devices)) * config.max_target_length
    expected = {k: v / len(devices) for k, v in expected_step_flops(config, tokens, head_split).items()}
    state_bytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(state))
    schedule = None
    if target:
        program = ScheduledProgram(text, inputs)
        schedule = program.overlap().as_dict()
        if first:  # the first compile's schedule, XLA's own estimates
            default = first.overlap()
            schedule["default_estimates"] = {"step_seconds": default.step_seconds, "hidden": default.total.hidden}
            profiled = {i.name for i in first.scheduled()}
            placed = [i.name for i in program.scheduled()]
            schedule["profile_names_found"] = sum(n in profiled for n in placed) / max(len(placed), 1)
    report = AotReport(
        devices=len(devices),
        target=target.name if target else "cpu",
        topology=target.topology(len(devices)) if target else "",
        mesh=dict(mesh.shape),
        dtype=config.dtype,
        quantization=config.quantization,
        choices=choice,
        memory=memory,
        xla_flops=float((cost or {}).get("flops", 0.0)),
        dot_flops=stats.dot_flops,
        model_flops=expected["model"],
        expected_flops=expected["compiled"],
        scope_flops={s: stats.flops_by_scope[s] for s in SCOPES},
        scope_expected={s: expected[s] for s in SCOPES},
        uncounted_calls=stats.uncounted,
        collectives=stats.collectives,
        collectives_by_axes=stats.by_axes,
        loops=stats.loops,
        largest_collectives=stats.largest,
        collectives_by_op=stats.by_op,
        collectives_by_dtype=stats.by_dtype,
        state_bytes=state_bytes,
        overlap=schedule,
        lower_s=t1 - t0,
        compile_s=t2 - t1,
        pipeline=pipeline_summary(config),
        host_syncs=stats.host_syncs,
        xla_budget=xla_memory.xla_budget(target.hbm_bytes, io_bytes, slop) if target else 0.0,
        xla_slop=slop if target else 0,
    )
    return report, compiled
