"""What an ahead-of-time compile reports, and its text form."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from MaxText.aot.compute_time import format_breakdown

GB = 1e9


@dataclass
class Choices:
    backend_target: str  # what the target platform would run
    exchange_target: str
    backend_compiled: str  # what was compiled here
    exchange_compiled: str
    attention_target: str
    attention_compiled: str


@dataclass
class AotReport:
    devices: int
    target: str  # "cpu" (simulated devices) or a GPU target's name
    topology: str  # a GPU target's "domains x hosts x GPUs", "" on CPU
    mesh: dict[str, int]
    dtype: str
    quantization: str  # the FP8 recipe of the linear GEMMs and the dispatch, or "none"
    choices: Choices  # what was compiled and what the target would run
    memory: dict[str, int]  # bytes per device
    xla_flops: float  # cost_analysis()["flops"], per device, loops counted once (0 where XLA gives none)
    dot_flops: float  # matmul FLOPs per device from the HLO, loops multiplied by their trip counts
    model_flops: float  # the accounting's training FLOPs per device per step (no remat)
    expected_flops: float  # the accounting plus what the program recomputes (remat) and its attention does
    scope_flops: dict[str, float]  # named scope (routed experts, attention core) -> its HLO FLOPs per device
    scope_expected: dict[str, float]  # the same scopes' expected FLOPs (dropless ideal, causal count)
    uncounted_calls: dict[str, int]  # custom calls whose FLOPs are not counted
    collectives: dict[str, dict[str, float]]
    collectives_by_axes: dict[str, dict[str, float]]
    loops: list[tuple[str, int]]
    largest_collectives: list[tuple[str, float, str]]  # (kind, bytes, JAX op), biggest first
    collectives_by_op: dict[str, float]  # "all-gather of top_k" -> bytes per step
    collectives_by_dtype: dict[str, dict[str, float]]  # "ragged-all-to-all of u8" -> {"count", "bytes"}
    state_bytes: int  # the whole train state over all devices (parameter arithmetic)
    # GPU targets: overlap.OverlapReport.as_dict(); under latency_profile=model[_contended] also the first
    # compile's step and hidden share (default_estimates) and the share of the second program's
    # kernels the profile named (profile_names_found)
    overlap: dict | None
    lower_s: float
    compile_s: float
    warnings: list[str] = field(default_factory=list)
    pipeline: dict | None = None  # stages, repeats, microbatches, bubble (the share of iterations a stage idles)
    # where -> {"while", "conditional"}: data-dependent control flow per step (a host round-trip each on XLA:GPU)
    host_syncs: dict[str, dict[str, int]] = field(default_factory=dict)
    # GPU targets: the bytes per device XLA planned the program for (train/xla_memory.py) and the
    # slop factor that set them; a program past them was rematerialised by XLA to fit
    xla_budget: float = 0.0
    xla_slop: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}" if b else "-"


def _pipeline_lines(pipeline: dict | None) -> list[str]:
    if not pipeline:
        return []
    return [
        f"pipeline: {pipeline['stages']} stages x {pipeline['repeats']} repeats, {pipeline['microbatches']} micro-batches;"
        f" bubble {pipeline['bubble']:.1%} of the iterations (its stages compute on a micro-batch and discard it:"
        " the MoE stack's HLO FLOPs include them)"
    ]


def format_report(r: AotReport, hbm_gb: float | None, limit_gb: float | None = None) -> str:
    """The report as text; ``limit_gb`` is what the program must fit (JAX's allocator's share of
    the ``hbm_gb`` of HBM on a GPU target)."""
    m = r.memory
    mesh = " x ".join(f"{k} {v}" for k, v in r.mesh.items() if v > 1) or "one device"
    where = f"{r.target} target, topology {r.topology}" if r.topology else "simulated CPU devices"
    lines = [
        f"devices {r.devices} ({where}; mesh {mesh}), dtype {r.dtype}, quantization {r.quantization}",
        f"compiled with attention={r.choices.attention_compiled} moe_matmul={r.choices.backend_compiled}"
        f" moe_ep_comm={r.choices.exchange_compiled}; the target runs attention: {r.choices.attention_target};"
        f" moe_matmul: {r.choices.backend_target}; moe_ep_comm: {r.choices.exchange_target}",
        f"lower {r.lower_s:.1f} s, compile {r.compile_s:.1f} s",
        *_pipeline_lines(r.pipeline),
        "",
        "memory per device (XLA memory_analysis)          GB",
        f"  arguments (train state + batch)          {m['arguments'] / GB:10.2f}",
        f"  outputs (new state aliases the donated)  {m['outputs'] / GB:10.2f}  ({m['aliased'] / GB:.2f} aliased)",
        f"  temp (activations, buffers)              {m['temp'] / GB:10.2f}",
        f"  generated code                           {m['code'] / GB:10.2f}",
        f"  total                                    {m['total'] / GB:10.2f}"
        + (f"  of {hbm_gb:.0f} GB HBM" if hbm_gb else "")
        + (f" ({limit_gb:.0f} GB for JAX)" if limit_gb and hbm_gb and limit_gb < hbm_gb else ""),
        f"  state by parameter arithmetic / devices  {r.state_bytes / r.devices / GB:10.2f}",
        *([f"  XLA:GPU planned for (slop factor {r.xla_slop}%)    {r.xla_budget / GB:10.2f}"] if r.xla_budget else []),
        "",
        "FLOPs per device per step                        TFLOP",
        f"  XLA cost_analysis (loops counted once)   {r.xla_flops / 1e12:10.2f}",
        f"  matmuls in the HLO x loop trip counts    {r.dot_flops / 1e12:10.2f}",
        f"  model (tools/model_stats.py accounting)  {r.model_flops / 1e12:10.2f}"
        f"   HLO / model = {_ratio(r.dot_flops, r.model_flops)}",
        f"  model + remat + attention as compiled    {r.expected_flops / 1e12:10.2f}"
        f"   HLO / this  = {_ratio(r.dot_flops, r.expected_flops)}",
    ]
    for scope, flops in r.scope_flops.items():
        expected = r.scope_expected[scope]
        lines.append(
            f"    {scope:<36} {flops / 1e12:10.2f}   HLO / {'dropless ideal' if 'expert' in scope else 'causal count'}"
            f" = {_ratio(flops, expected)}"
        )
    lines.append(f"  while loops: {len(r.loops)}, trip counts {sorted({n for _, n in r.loops})}")
    lines.append(
        "  host round-trips per step (data-dependent while loops, conditionals): "
        + (", ".join(f"{k} {v['while']}, {v['conditional']}" for k, v in sorted(r.host_syncs.items())) or "none")
    )
    if r.uncounted_calls:
        lines.append(f"  custom calls not counted: {r.uncounted_calls}")
    lines += ["", "collectives per device per step                count        GB"]
    for kind, v in r.collectives.items():
        lines.append(f"  {kind:<42} {v['count']:6.0f} {v['bytes'] / GB:10.3f}")
    for key, v in sorted(r.collectives_by_axes.items()):
        lines.append(f"    {key:<40} {v['count']:6.0f} {v['bytes'] / GB:10.3f}")
    lines.append("  by element type (FP8 moves as u8):")
    for key, v in sorted(r.collectives_by_dtype.items()):
        lines.append(f"    {key:<40} {v['count']:6.0f} {v['bytes'] / GB:10.3f}")
    lines.append("  largest single collectives:")
    for kind, nbytes, op in r.largest_collectives[:6]:
        lines.append(f"    {kind:<18} {nbytes / GB:8.3f} GB  {op[-90:]}")
    if r.overlap:
        lines += [
            "",
            "communication hidden behind computation (XLA:GPU's schedule; times modelled)",
            "  category                 count   sync  buffer GB  NVLink GB  network GB   link s   hidden",
        ]
        for name, s in r.overlap["shares"].items():
            lines.append(
                f"  {name:<22} {s['count']:7.0f} {s['synchronous']:6.0f} {s['bytes'] / GB:10.1f}"
                f" {s['nvlink_bytes'] / GB:10.1f} {s['network_bytes'] / GB:11.1f} {s['seconds']:8.3f} {s['hidden']:8.1%}"
            )
        lines.append(
            f"  all: {r.overlap['hidden']:.1%} of communication time hidden; modelled step"
            f" {r.overlap['step_seconds']:.2f} s ({r.overlap['compute_seconds']:.2f} s of computation)"
        )
        lines.append(
            f"  floor {r.overlap['floor_seconds']:.2f} s: no order of each computation's instructions models a shorter step"
            " (the computation, plus the link time a loop body's computation cannot cover)"
        )
        if r.overlap.get("compute"):
            lines += ["", *format_breakdown(r.overlap["compute"])]
    for w in r.warnings:
        lines.append(f"warning: {w}")
    return "\n".join(lines)
