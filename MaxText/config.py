"""Load, validate and derive the run configuration.

Layers, lowest precedence first: ``configs/base.yml`` (every key and its default) <
``configs/models/<model_name>.yml`` < extra yml files on the command line < ``key=value``.

The schema below holds types, ranges and cross-field rules only; every default lives in base.yml
(a test keeps the two in step). Loading touches no device and starts no runtime: values that
depend on the hardware (``dtype: auto``, the device count) are resolved later by the caller.
Any bad input raises :class:`ConfigError`, whose one-line message names the key; entry points
turn it into exit code 2.

Types are strict (pydantic strict mode): an int key takes an integer only (``steps=3.0`` is an
error, not 3), a bool key ``true``/``false`` only, a float key a number (ints included), and no
float is inf or nan. A key whose values have a range says so in its annotation (``Count``,
``Probability``, ...), so the range is checked where the type is, with the same one-line error;
``check_rules`` keeps the rules that involve several keys. YAML is read with YAML 1.2's booleans
and floats (``_Yaml``): PyYAML's YAML 1.1 reads ``yes``/``on`` as true and ``1e-4`` as a string.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
import time
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, Strict, ValidationError

from MaxText.layers.saveable import SAVEABLE
from MaxText.parallel.axes import MESH_AXES, STAGE_AXIS, parallelism_key

CONFIG_DIR = Path(__file__).parent / "configs"
BASE_YML = CONFIG_DIR / "base.yml"
MODELS_DIR = CONFIG_DIR / "models"
# A saved config.yml records the run's topology under this key; it is output, not input.
RUNTIME_SECTION = "runtime"
# ``latency_profile`` values that compile twice with the cost model's times (aot/compile.py): each
# collective at its link time, or at its duration with the others in flight in the first schedule
MODEL_PROFILES = ("model", "model_contended")


class ConfigError(ValueError):
    """A bad configuration; the message is one line that names the offending key."""


DType = Literal["auto", "bfloat16", "float16", "float32", "float64"]
ParamDType = Literal["bfloat16", "float32", "float64"]


def _minus_one_or_count(value: int) -> int:
    if value != -1 and value < 1:
        raise ValueError("must be >= 1, or -1 as its base.yml comment explains")
    return value


# Ranges, by what a key means. Cross-key limits (top-k <= experts, ...) are in check_rules.
Count = Annotated[int, Field(ge=1)]  # sizes, periods, counts of things that must exist
NonNegative = Annotated[int, Field(ge=0)]  # counts where 0 means none or off
CountOrMinusOne = Annotated[int, AfterValidator(_minus_one_or_count)]  # -1 is a sentinel (fill, all, = steps)
Probability = Annotated[float, Field(ge=0, le=1)]  # probabilities and fractions
Decay = Annotated[float, Field(ge=0, lt=1)]  # moving-average decays (Adam betas)
Share = Annotated[float, Field(gt=0, le=1)]  # a part of a whole that cannot be 0 (a rate multiplier)
Positive = Annotated[float, Field(gt=0)]  # epsilons, scales, standard deviations
NonNegativeFloat = Annotated[float, Field(ge=0)]  # rates and weights, 0 = off


class Config(BaseModel):
    """Typed view of base.yml. No defaults here: base.yml is the single source.

    Strict (see the module docstring). A type whose YAML form is another type (a tuple is a YAML
    list) opts out with ``Annotated[..., Strict(False)]``."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    # run
    model_name: str
    run_name: str
    base_output_directory: str
    hardware: Literal["auto", "cpu", "gpu"]
    steps: NonNegative
    log_period: Count
    seed: NonNegative
    enable_tensorboard: bool
    # checkpoints
    enable_checkpointing: bool
    checkpoint_period: Count
    max_num_checkpoints_to_keep: CountOrMinusOne
    async_checkpointing: bool
    checkpoint_device_copy: bool
    load_parameters_path: str
    enable_emergency_checkpoint: bool
    local_checkpoint_directory: str
    local_checkpoint_period: Count
    preemption_check_period: Count
    jax_cache_dir: str
    latency_profile: str
    # batch
    per_device_batch_size: Count
    max_target_length: Annotated[int, Field(ge=2)]  # inputs and targets are shifted by one
    gradient_accumulation_steps: Count
    # training health and observability
    max_consecutive_skipped_steps: Count
    loss_spike_rollback: bool
    loss_spike_factor: Annotated[float, Field(gt=1)]
    loss_spike_window: Count
    spike_skip_batches: NonNegative
    max_rollbacks: NonNegative
    profiler: Literal["none", "xplane"]
    profile_start_step: Count
    profile_steps: Count
    # optimizer
    learning_rate: NonNegativeFloat
    warmup_steps: NonNegative
    learning_rate_schedule_steps: CountOrMinusOne
    learning_rate_final_fraction: Probability
    adam_b1: Decay
    adam_b2: Decay
    adam_eps: Positive
    adam_weight_decay: NonNegativeFloat
    gradient_clipping_threshold: NonNegativeFloat
    # precision and memory
    dtype: DType
    weight_dtype: ParamDType
    opt_state_dtype: Literal["auto", "bfloat16", "float32", "float64"]
    remat_policy: Literal["none", "minimal", "names", "full"]
    remat_names: list[str]
    vocab_chunks: Count
    quantization: Literal["none", "fp8_blockwise", "mxfp8"]
    fp8_gemm: Literal["auto", "emulate", "cudnn"]
    fp8_block: Count
    mxfp8_block: Count
    mxfp8_scale_rule: Literal["ceil", "floor"]
    vocab_parallel_axes: Literal["auto"] | list[str]
    # model shape
    vocab_size: Count
    base_emb_dim: Count
    base_num_decoder_layers: Count
    first_num_dense_layers: NonNegative
    base_mlp_dim: Count
    base_num_query_heads: Count
    normalization_layer_epsilon: Positive
    init_weights_std: Positive
    # MLA
    q_lora_rank: NonNegative
    kv_lora_rank: Count
    qk_nope_head_dim: Count
    qk_rope_head_dim: Count
    v_head_dim: Count
    attention: Literal["auto", "dot", "flash", "cudnn", "te"]
    attention_block_q: Count
    attention_block_kv: Count
    attention_max_segments: Count
    # rotary / YaRN
    rope_max_timescale: Annotated[float, Field(gt=1)]  # its log divides
    rope_interleave: bool
    rope_type: Literal["yarn", "default"]
    rope_factor: Annotated[float, Field(ge=1)]
    original_max_position_embeddings: Count
    beta_fast: Positive
    beta_slow: Positive
    rope_mscale: NonNegativeFloat
    rope_mscale_all_dim: NonNegativeFloat
    # MoE
    num_experts: Count
    num_experts_per_tok: Count
    shared_experts: NonNegative
    base_moe_mlp_dim: Count
    capacity_factor: float
    moe_matmul: Literal["auto", "tokamax", "blocked", "ragged_dot", "te"]
    moe_block_rows: Count
    moe_min_block_rows: Count
    moe_ep_comm: Literal["auto", "allgather", "all_to_all", "ragged_all_to_all", "hierarchical", "te"]
    moe_ep_buffer_factor: Positive
    moe_exchange_chunks: Count
    moe_exchange_pipeline: bool
    routed_score_func: Literal["sigmoid", "softmax"]
    routed_bias: bool
    routed_bias_update_rate: Decay
    routed_bias_update_rule: Literal["sign", "proportional"]
    router_learning_rate_scale: Share
    routed_scaling_factor: Positive
    routed_norm_topk_prob: bool
    n_routing_groups: Count
    topk_routing_group: Count
    load_balance_loss_weight: NonNegativeFloat
    # MTP
    mtp_num_layers: NonNegative
    mtp_loss_scaling_factor: NonNegativeFloat
    # data
    dataset_type: Literal["builtin", "tfds", "synthetic"]
    dataset_name: str
    dataset_path: str
    dataset_text_field: str
    train_split: str
    eval_split: str
    builtin_max_files: NonNegative
    tokenizer_type: Literal["byte", "huggingface", "sentencepiece"]
    tokenizer_path: str
    add_bos: bool
    add_eos: bool
    packing: bool
    packing_cross_document_attention: bool
    enable_data_shuffling: bool
    shuffle_window_pieces: NonNegative
    grain_worker_count: NonNegative
    grain_read_threads: NonNegative
    grain_per_worker_buffer_size: Count
    eval_interval: NonNegative
    eval_steps: Count
    synthetic_vocab_size: Count
    synthetic_noise: Probability
    # parallelism
    ici_pipeline_parallelism: Count
    ici_data_parallelism: CountOrMinusOne
    ici_fsdp_parallelism: CountOrMinusOne
    ici_expert_parallelism: CountOrMinusOne
    ici_tensor_parallelism: CountOrMinusOne
    dcn_pipeline_parallelism: Count
    dcn_data_parallelism: CountOrMinusOne
    dcn_fsdp_parallelism: CountOrMinusOne
    dcn_expert_parallelism: CountOrMinusOne
    dcn_tensor_parallelism: CountOrMinusOne
    num_pipeline_microbatches: CountOrMinusOne
    num_pipeline_repeats: Count
    num_pipeline_lanes: Count
    logical_axis_rules: list[Annotated[tuple[str, list[str]], Strict(False)]]

    # ---- derived values: computed here and nowhere else ----
    @property
    def emb_dim(self) -> int:
        return self.base_emb_dim

    @property
    def num_moe_layers(self) -> int:
        return self.base_num_decoder_layers - self.first_num_dense_layers

    @property
    def pipeline_stages(self) -> int:
        """Ways the ``stage`` mesh axis splits the MoE layer stack (1: no pipeline)."""
        return self.ici_pipeline_parallelism * self.dcn_pipeline_parallelism

    @property
    def pipeline_microbatches(self) -> int:
        """Micro-batches each pipelined batch is cut into (``num_pipeline_microbatches``; -1: one per stage)."""
        return self.pipeline_stages if self.num_pipeline_microbatches == -1 else self.num_pipeline_microbatches

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def moment_dtype(self) -> str:
        """The AdamW moments' dtype (``opt_state_dtype``, ``auto``: the weights')."""
        return self.weight_dtype if self.opt_state_dtype == "auto" else self.opt_state_dtype

    @property
    def schedule_steps(self) -> int:
        return self.steps if self.learning_rate_schedule_steps == -1 else self.learning_rate_schedule_steps

    @property
    def output_dir(self) -> Path:
        return Path(self.base_output_directory) / self.run_name

    def ici_parallelism(self) -> list[int]:
        return [getattr(self, parallelism_key("ici", axis)) for axis in MESH_AXES]

    def dcn_parallelism(self) -> list[int]:
        return [getattr(self, parallelism_key("dcn", axis)) for axis in MESH_AXES]

    def micro_batch_size(self, num_devices: int) -> int:
        """Sequences in one micro-batch over all devices."""
        return self.per_device_batch_size * num_devices

    def tokens_per_device(self, num_devices: int) -> int:
        """A device's share of the tokens of one micro-batch."""
        return self.micro_batch_size(num_devices) * self.max_target_length // num_devices

    def routed_tokens_per_device(self, num_devices: int) -> int:
        """Tokens one MoE layer of the stack routes per device: a device's share of a batch, or
        pipelined, of one lane of a pipeline micro-batch (1/(M lanes) of the batch over the 1/p of
        the devices of a stage)."""
        tokens = self.tokens_per_device(num_devices)
        if self.pipeline_stages == 1:
            return tokens
        return tokens * self.pipeline_stages // (self.pipeline_microbatches * self.num_pipeline_lanes)

    def global_batch_size(self, num_devices: int) -> int:
        """Sequences per optimizer step."""
        return self.micro_batch_size(num_devices) * self.gradient_accumulation_steps

    def fast_domain_axes(self) -> list[str]:
        """The mesh axes that stay inside one fast domain (no dcn factor: NVLink inside a rack)."""
        return [axis for axis, dcn in zip(MESH_AXES, self.dcn_parallelism(), strict=True) if dcn == 1]

    def vocab_axes(self) -> tuple[str, ...]:
        """``vocab_parallel_axes``; an unresolved ``auto`` (see ``with_platform``) means the axes
        inside the fast domain: the group's tokens move over them, the weights' rows over the others."""
        if self.vocab_parallel_axes == "auto":
            return tuple(self.fast_domain_axes())
        return tuple(self.vocab_parallel_axes)

    def with_platform(self, platform: str) -> Config:
        """Resolve hardware-dependent values (``dtype``, ``vocab_parallel_axes``: auto) once the JAX
        platform is known. The vocabulary split's token traffic belongs on a GPU's NVLink; between
        CPU processes (gloo) it would only add collectives to every step."""
        update: dict[str, Any] = {}
        if self.dtype == "auto":
            update["dtype"] = "bfloat16" if platform == "gpu" else "float32"
        if self.vocab_parallel_axes == "auto":
            update["vocab_parallel_axes"] = self.fast_domain_axes() if platform == "gpu" else []
        return self.model_copy(update=update) if update else self


# ---------------------------------------------------------------- rules


def _require(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"config key '{key}': {message}")


def check_rules(c: Config) -> None:
    """Cross-field rules: combinations that cannot run, each reported with its key. (A single
    key's range is in its annotation in ``Config``.)"""
    if c.dataset_type == "synthetic":  # other types check vocab_size against their tokenizer
        _require(c.vocab_size >= c.synthetic_vocab_size, "synthetic_vocab_size", "must not exceed vocab_size")
    if c.loss_spike_rollback:
        _require(c.enable_checkpointing, "loss_spike_rollback", "needs enable_checkpointing (it rolls back to one)")
    if c.enable_emergency_checkpoint:
        _require(
            c.enable_checkpointing, "enable_emergency_checkpoint", "needs enable_checkpointing (the persistent tier)"
        )
        _require(bool(c.local_checkpoint_directory), "local_checkpoint_directory", "must name node-local storage")
    _require(
        c.first_num_dense_layers <= c.base_num_decoder_layers,
        "first_num_dense_layers",
        f"must be between 0 and base_num_decoder_layers ({c.base_num_decoder_layers})",
    )
    _require(
        c.latency_profile in ("", *MODEL_PROFILES) or Path(c.latency_profile).suffix in (".pbtxt", ".pb"),
        "latency_profile",
        f'{c.latency_profile!r}: must be "", {", ".join(MODEL_PROFILES)}, or a profile file ending in .pbtxt (text)'
        " or .pb (binary)",
    )
    _require(c.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", "must be even (rotary pairs)")
    if c.rope_type == "yarn":  # frequencies between the two rotation counts are interpolated
        _require(c.beta_fast > c.beta_slow, "beta_fast", f"must exceed beta_slow ({c.beta_slow})")
    _require(
        c.num_experts_per_tok <= c.num_experts,
        "num_experts_per_tok",
        f"top-k {c.num_experts_per_tok} must be between 1 and num_experts ({c.num_experts})",
    )
    _require(
        c.num_experts % c.n_routing_groups == 0,
        "n_routing_groups",
        f"{c.n_routing_groups} groups do not divide num_experts ({c.num_experts})",
    )
    _require(
        c.topk_routing_group <= c.n_routing_groups,
        "topk_routing_group",
        f"must be between 1 and n_routing_groups ({c.n_routing_groups})",
    )
    reachable = c.topk_routing_group * (c.num_experts // c.n_routing_groups)
    _require(
        c.num_experts_per_tok <= reachable,
        "num_experts_per_tok",
        f"top-k {c.num_experts_per_tok} exceeds the {reachable} experts in the {c.topk_routing_group} chosen groups",
    )
    _require(
        c.capacity_factor == -1 or c.capacity_factor > 0,
        "capacity_factor",
        f"must be -1 (dropless) or > 0 (token-dropping baseline), got {c.capacity_factor}",
    )
    halvings = c.moe_block_rows // c.moe_min_block_rows
    _require(
        halvings >= 1 and c.moe_block_rows % c.moe_min_block_rows == 0 and halvings & (halvings - 1) == 0,
        "moe_block_rows",
        f"must be moe_min_block_rows ({c.moe_min_block_rows}) times a power of two, got {c.moe_block_rows}",
    )
    for kind, values in (("ici", c.ici_parallelism()), ("dcn", c.dcn_parallelism())):
        _require(values.count(-1) <= 1, f"{kind}_*_parallelism", "at most one axis may be -1 (fill)")
    _require(
        -1 not in c.ici_parallelism() or -1 not in c.dcn_parallelism(),
        "dcn_*_parallelism",
        "a -1 (fill) in both ici_* and dcn_* is ambiguous; set one of them explicitly",
    )
    _require(
        c.per_device_batch_size * c.max_target_length % c.moe_exchange_chunks == 0,
        "moe_exchange_chunks",
        f"{c.moe_exchange_chunks} chunks do not divide a device's per_device_batch_size x max_target_length"
        f" ({c.per_device_batch_size * c.max_target_length}) tokens",
    )
    _require(
        not c.moe_exchange_pipeline or c.moe_exchange_chunks > 1,
        "moe_exchange_pipeline",
        "true chains the exchange's chunks, but moe_exchange_chunks is 1 (set it to 2 or more, or this to false)",
    )
    _require(
        c.max_target_length % c.vocab_chunks == 0,
        "vocab_chunks",
        f"{c.vocab_chunks} slices do not divide max_target_length ({c.max_target_length})",
    )
    expert_ways = c.ici_expert_parallelism * c.dcn_expert_parallelism
    if expert_ways > 0:  # -1 (fill) is checked when the mesh is built
        _require(
            c.num_experts % expert_ways == 0,
            "ici_expert_parallelism",
            f"num_experts ({c.num_experts}) is not divisible by expert parallelism ({expert_ways})",
        )
    if c.quantization != "none":  # the routed experts' FP8 GEMMs live in the blocked backend
        _require(
            c.moe_matmul in ("auto", "blocked"),
            "moe_matmul",
            f"{c.moe_matmul} has no FP8 path (quantization={c.quantization}); blocked runs the routed experts' "
            "FP8 GEMMs (ragged_dot's weight gradient would tile tokens across experts; tokamax's quantized "
            "kernels and Transformer Engine's MXFP8 grouped GEMM do not run this repository's recipes)",
        )
        _require(
            c.fp8_gemm != "cudnn" or c.quantization == "mxfp8",
            "fp8_gemm",
            f"cudnn's block-scaled GEMM takes MX blocks (quantization=mxfp8), not {c.quantization}'s square "
            "weight blocks; use emulate",
        )
        _require(
            c.capacity_factor == -1,
            "capacity_factor",
            f"the token-dropping baseline has no FP8 path (quantization={c.quantization}); use -1 (dropless)",
        )
    check_pipeline(c)
    unknown = [n for n in c.remat_names if n not in SAVEABLE]
    _require(not unknown, "remat_names", f"unknown tensor names {unknown}; known: {list(SAVEABLE)}")
    unknown = [a for a in c.vocab_parallel_axes if a not in MESH_AXES] if c.vocab_parallel_axes != "auto" else []
    _require(not unknown, "vocab_parallel_axes", f"unknown mesh axes {unknown}; known: {list(MESH_AXES)}")
    for name, axes in c.logical_axis_rules:
        unknown = [a for a in axes if a not in MESH_AXES]
        _require(
            not unknown,
            "logical_axis_rules",
            f"rule '{name}' names unknown mesh axes {unknown}; known: {list(MESH_AXES)}",
        )


def check_pipeline(c: Config) -> None:
    """The pipeline's split of the MoE layer stack (``parallel/pipeline.py``): every stage runs
    ``num_moe_layers / (stages x repeats)`` consecutive layers per repeat, so stages x repeats must
    divide the MoE layers; the dense layers, the embedding, the head and the MTP modules run
    outside the pipeline, on every stage's share of the batch."""
    stages, repeats = c.pipeline_stages, c.num_pipeline_repeats
    if stages == 1:
        return
    layers = c.num_moe_layers
    divisors = [d for d in range(1, layers + 1) if layers % d == 0]
    key = (
        "num_pipeline_repeats"
        if repeats > 1
        else parallelism_key("dcn" if c.dcn_pipeline_parallelism > 1 else "ici", STAGE_AXIS)
    )
    _require(
        layers > 0 and layers % (stages * repeats) == 0,
        key,
        f"{layers} MoE layers do not split into {stages} stages x {repeats} repeats "
        f"(stages x num_pipeline_repeats must divide {layers}: one of {divisors})",
    )
    _require(
        c.pipeline_microbatches >= stages,
        "num_pipeline_microbatches",
        f"{c.pipeline_microbatches} micro-batches cannot fill {stages} stages: the pipeline needs at least one per stage",
    )
    _require(
        c.capacity_factor == -1,
        "capacity_factor",
        "the token-dropping baseline is not pipelined (its capacity is per batch, the pipeline routes micro-batches); "
        "use -1 (dropless)",
    )


# ---------------------------------------------------------------- loading

_BOOL, _FLOAT = "tag:yaml.org,2002:bool", "tag:yaml.org,2002:float"
# YAML 1.2 floats: 1e-4 and 1.5E3 too (YAML 1.1 wants a dot and a signed exponent); integers stay ints.
_FLOAT_RE = re.compile(
    r"^(?:[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)?|[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?"
    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
)


class _Yaml(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's booleans (true/false only: ``yes``, ``on`` stay
    strings, which a bool key then refuses) and floats (``1e-4`` is a number)."""

    yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_BOOL, _FLOAT)]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }


_Yaml.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_Yaml.add_implicit_resolver(_FLOAT, _FLOAT_RE, list("-+0123456789."))


class _YamlDumper(yaml.SafeDumper):
    """Quotes a string that either reading (YAML 1.1 or ``_Yaml``) would take for another type."""


_YamlDumper.add_implicit_resolver(_FLOAT, _FLOAT_RE, list("-+0123456789."))


def _read_yml(path: Path, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"{what} not found: {path}")
    try:
        data = yaml.load(path.read_text(), Loader=_Yaml) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{what} {path} is not valid YAML: {str(err).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path} must be a mapping of key: value")
    return data


def available_models() -> list[str]:
    return sorted(p.stem for p in MODELS_DIR.glob("*.yml"))


def _check_known(layer: dict[str, Any], known: set[str], source: str) -> None:
    for key in layer:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=3, cutoff=0.6)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ConfigError(f"unknown config key '{key}' in {source}{hint}")


def _parse_value(key: str, text: str) -> Any:
    """YAML-parse a command-line value, except for string keys, which keep the text as typed
    (so ``run_name=123`` stays the string "123"), less quotes around the whole of it: a shell
    removes them from ``key=""``, but not when it splits a variable (the recipes' ``MAXTEXT_ARGS``)."""
    field = Config.model_fields.get(key)
    is_text = field is not None and field.annotation is str
    if is_text and len(text) >= 2 and text[0] == text[-1] in "\"'":
        return text[1:-1]
    if not text or is_text:
        return text
    try:
        return yaml.load(text, Loader=_Yaml)
    except yaml.YAMLError:
        return text


def _parse_args(argv: list[str]) -> tuple[list[Path], dict[str, Any]]:
    ymls, overrides = [], {}
    for arg in argv:
        if "=" in arg:
            key, _, text = arg.partition("=")
            overrides[key.strip()] = _parse_value(key.strip(), text)
        elif arg.endswith((".yml", ".yaml")):
            ymls.append(Path(arg))
        else:
            raise ConfigError(f"argument '{arg}' is neither key=value nor a .yml file")
    return ymls, overrides


def _first_error(err: ValidationError) -> str:
    first = err.errors()[0]
    key = ".".join(str(p) for p in first["loc"]) or "?"
    message = first["msg"].lower().removeprefix("value error, ")
    return f"config key '{key}': {message} (got {first.get('input')!r})"


def default_run_name(model_name: str) -> str:
    """``<model_name>-<Slurm job id>`` under Slurm (the same on every process), else a timestamp."""
    job = os.environ.get("SLURM_JOB_ID")
    return f"{model_name}-{job}" if job else f"{model_name}-{time.strftime('%Y%m%d-%H%M%S')}"


def load_config(argv: list[str]) -> Config:
    """Build the run's Config from command-line arguments (``[extra.yml ...] key=value ...``)."""
    base = _read_yml(BASE_YML, "base config")
    known = set(base)
    ymls, overrides = _parse_args(argv)
    extras = []
    for path in ymls:
        layer = _read_yml(path, "config file")
        layer.pop(RUNTIME_SECTION, None)
        _check_known(layer, known, str(path))
        extras.append(layer)
    _check_known(overrides, known, "the command line")

    model_name = base["model_name"]
    for layer in [*extras, overrides]:
        model_name = layer.get("model_name", model_name)
    model_path = MODELS_DIR / f"{model_name}.yml"
    if not model_path.is_file():
        names = available_models()
        close = difflib.get_close_matches(str(model_name), names, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(f"config key 'model_name': unknown model '{model_name}'{hint}; available: {', '.join(names)}")
    overlay = _read_yml(model_path, "model config")
    _check_known(overlay, known, f"models/{model_path.name}")

    merged: dict[str, Any] = {}
    for layer in [base, overlay, *extras, overrides]:
        merged.update(layer)
    if not merged["run_name"]:
        merged["run_name"] = default_run_name(model_name)
    try:
        config = Config(**merged)
    except ValidationError as err:
        raise ConfigError(_first_error(err)) from None
    check_rules(config)
    return config


def load_config_or_exit(argv: list[str]) -> Config:
    """load_config for entry points: bad input prints one line and exits with code 2."""
    try:
        return load_config(argv)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def config_to_yaml(config: Config, runtime: dict[str, Any] | None = None) -> str:
    """The resolved config as YAML, optionally with the run's topology under ``runtime``."""
    data = config.model_dump(mode="json")
    data["logical_axis_rules"] = [[name, list(axes)] for name, axes in config.logical_axis_rules]
    if runtime:
        data[RUNTIME_SECTION] = runtime
    return yaml.dump(data, Dumper=_YamlDumper, sort_keys=False)
