"""Parameter counts, training FLOPs per token and state memory, read off the real model definition.

Counts come from ``jax.eval_shape`` of ``DeepSeekV3(config).init``: nothing is allocated, so the
671B model is inspected in about a second, and the numbers cannot drift from the model code the way
a hand-written formula can. Each leaf is assigned to a component by its path in one rule table
(``COMPONENT_RULES``); a leaf no rule matches is an error, so a new weight cannot go uncounted.

Conventions (DeepSeek-V3 report, section 3 and Kaplan et al. 2020):

- Parameters are the ``params`` collection plus ``moe_bias`` (the router's score-correction
  bias, E per MoE layer). ``moe_load`` / ``moe_loss`` are per-batch statistics, not parameters.
- *Total* is the main model; the MTP modules are counted apart (their embedding and output head
  are the main model's, so only their own weights count).
- *Active per token* keeps ``num_experts_per_tok / num_experts`` of the routed experts and
  everything else (shared experts, router, embedding, head).
- Training FLOPs per token = 6 x active non-embedding parameters (the output head is a matmul,
  so it is in; the embedding is a lookup, so it is out) + causal attention
  ``3 * S * H * (qk_head_dim + v_head_dim)`` per layer (forward QK^T and PV over S/2 keys on
  average is ``S*H*(qk+v)``; backward is twice that). Each MTP depth adds 6 x its active weights,
  its attention, and 6 x the shared head once more.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.traverse_util import flatten_dict

from MaxText.config import Config
from MaxText.models.deepseek import DeepSeekV3
from MaxText.moe.block import BIAS

# Variable collections that hold parameters (everything else ``init`` creates is statistics).
PARAM_COLLECTIONS = ("params", BIAS)
TRAINABLE_COLLECTION = "params"  # what the optimizer updates: gradients and Adam moments exist for these

# Leaf path glob -> component; the first match wins (``*`` also spans ``/``). Layer-level rules come
# first so that a layer inside an MTP module is split like a main-model layer.
COMPONENT_RULES: tuple[tuple[str, str], ...] = (
    ("*/attention/*", "attention"),  # projections and the q/kv latent norms
    ("*/pre_attention_norm/scale", "layer_norms"),
    ("*/pre_ffn_norm/scale", "layer_norms"),
    ("*/mlp/*", "dense_mlp"),
    ("*/moe/router", "router"),  # gate matrix (params) and correction bias (moe_bias): same path
    ("*/moe/shared_experts/*", "shared_experts"),
    ("*/moe/w*", "routed_experts"),
    ("token_embedding", "embedding"),
    ("output_head", "output_head"),
    ("final_norm/scale", "final_norm"),
    ("mtp_*/projection", "mtp_projection"),
    ("mtp_*/*_norm/scale", "mtp_norms"),  # embedding, hidden and the head's final norm
)
MTP_PREFIX = "mtp_"
COMPONENTS: tuple[str, ...] = tuple(dict.fromkeys(component for _, component in COMPONENT_RULES))
MAIN_COMPONENTS = tuple(c for c in COMPONENTS if not c.startswith(MTP_PREFIX))


@dataclass(frozen=True)
class Leaf:
    """One parameter array, as far as accounting cares."""

    collection: str
    path: str  # e.g. "moe_layers/layers/moe/wi_0"
    size: int
    itemsize: int

    @property
    def is_mtp(self) -> bool:
        return self.path.startswith(MTP_PREFIX)


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts by component, for the main model and (apart) the MTP modules."""

    main: dict[str, int]  # MAIN_COMPONENTS -> count (0 if the config has none)
    mtp_parts: dict[str, int]  # COMPONENTS -> count, all MTP modules together
    active_fraction: tuple[int, int]  # (num_experts_per_tok, num_experts): routed experts a token uses

    @property
    def total(self) -> int:
        """Main model, MTP excluded."""
        return sum(self.main.values())

    @property
    def active(self) -> int:
        """Main-model parameters one token uses."""
        return _active(self.main, self.active_fraction)

    @property
    def mtp(self) -> int:
        """Unique MTP weights (the shared embedding and head are not repeated)."""
        return sum(self.mtp_parts.values())

    @property
    def mtp_active(self) -> int:
        return _active(self.mtp_parts, self.active_fraction)


@dataclass(frozen=True)
class TrainFlops:
    """Training (forward + backward) FLOPs per token, by source."""

    matmul: int  # 6 x active non-embedding main-model parameters
    attention: int  # causal QK^T and PV of the main model's layers
    mtp: int  # MTP modules: their matmuls, their attention and one more pass through the head each

    @property
    def total(self) -> int:
        return self.matmul + self.attention + self.mtp


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes of training state (weights, gradients, Adam moments), activations not included."""

    weights: int  # every parameter, MTP included, in its stored dtype
    gradients: int  # one per trainable parameter, in the parameter's dtype
    optimizer: int  # Adam mu and nu, in opt_state_dtype

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer


# ---------------------------------------------------------------- the parameter tree


def component_of(path: str) -> str:
    """The component a parameter path belongs to (see ``COMPONENT_RULES``)."""
    for pattern, component in COMPONENT_RULES:
        if fnmatch.fnmatchcase(path, pattern):
            return component
    raise ValueError(f"parameter '{path}' matches no rule in accounting.COMPONENT_RULES; add one")


def _trace_leaves(config: Config) -> tuple[Leaf, ...]:
    """Parameter shapes from an abstract ``init`` (shapes do not depend on batch or length: use 1x1)."""
    if config.dtype == "auto":
        config = config.with_platform("cpu")
    model = DeepSeekV3(config)

    def init():
        tokens = jnp.zeros((1, 1), jnp.int32)
        return model.init(jax.random.key(0), tokens, tokens, tokens)

    with nn.logical_axis_rules(()):  # shard nothing, whatever mesh the caller has entered
        variables = nn.meta.unbox(jax.eval_shape(init))
    return leaves_of(variables)


def leaves_of(variables: dict[str, Any]) -> tuple[Leaf, ...]:
    """The parameter leaves of a variables dict (arrays or shapes, e.g. the train state's
    ``{"params": ..., BIAS: ...}``), in ``PARAM_COLLECTIONS`` order."""
    leaves = []
    for collection in PARAM_COLLECTIONS:
        for keys, shape in flatten_dict(dict(variables.get(collection, {}))).items():
            leaves.append(Leaf(collection, "/".join(keys), shape.size, shape.dtype.itemsize))
    return tuple(leaves)


_LEAF_CACHE: dict[str, tuple[Leaf, ...]] = {}


def param_leaves(config: Config) -> tuple[Leaf, ...]:
    """Every parameter leaf of the model ``config`` describes; traced once per distinct config."""
    key = config.model_dump_json()
    if key not in _LEAF_CACHE:
        _LEAF_CACHE[key] = _trace_leaves(config)
    return _LEAF_CACHE[key]


def count_parameters_of(config: Config, variables: dict[str, Any]) -> ParamCounts:
    """``count_parameters`` from variables the caller already has (the train state's abstract
    ``params`` and ``moe_bias``), so that the model is not traced again for them."""
    return _counts(config, leaves_of(variables))


# ---------------------------------------------------------------- counts, FLOPs, memory


def _active(parts: dict[str, int], fraction: tuple[int, int]) -> int:
    # Every routed-expert leaf has a leading E axis, so the integer division is exact.
    k, e = fraction
    return sum(parts.values()) - parts["routed_experts"] + parts["routed_experts"] * k // e


def count_parameters(config: Config) -> ParamCounts:
    """Parameter counts by component, from the real model definition (no allocation)."""
    return _counts(config, param_leaves(config))


def _counts(config: Config, leaves: tuple[Leaf, ...]) -> ParamCounts:
    main, mtp = dict.fromkeys(MAIN_COMPONENTS, 0), dict.fromkeys(COMPONENTS, 0)
    for leaf in leaves:
        (mtp if leaf.is_mtp else main)[component_of(leaf.path)] += leaf.size
    return ParamCounts(main, mtp, (config.num_experts_per_tok, config.num_experts))


def attention_flops_per_layer(config: Config) -> int:
    """Training FLOPs per token of causal attention scores and values in one layer."""
    H, S = config.base_num_query_heads, config.max_target_length
    return 3 * S * H * (config.qk_head_dim + config.v_head_dim)


def train_flops(config: Config, counts: ParamCounts | None = None) -> TrainFlops:
    """Training FLOPs per token split into matmuls, attention and MTP (see the module docstring)."""
    counts = counts or count_parameters(config)
    attention = attention_flops_per_layer(config)
    head = counts.main["output_head"]
    mtp = 6 * counts.mtp_active + config.mtp_num_layers * (attention + 6 * head)
    return TrainFlops(
        matmul=6 * (counts.active - counts.main["embedding"]),
        attention=config.base_num_decoder_layers * attention,
        mtp=mtp,
    )


def train_flops_per_token(config: Config, counts: ParamCounts | None = None) -> float:
    """Model FLOPs of one training token (forward + backward), the numerator of MFU.

    ``6 x active non-embedding parameters + causal attention`` for the main model, plus the MTP
    modules when ``mtp_num_layers > 0``. Counts the model's math, not what remat recomputes.
    Cheap after the first call for a config (the abstract trace is cached); pass ``counts``
    to skip even the cache lookup.
    """
    return float(train_flops(config, counts).total)


def memory_estimate(config: Config) -> MemoryEstimate:
    """Bytes of weights, gradients and AdamW moments over all devices (divide by N if fully sharded)."""
    leaves = param_leaves(config)
    trainable = [leaf for leaf in leaves if leaf.collection == TRAINABLE_COLLECTION]
    moment_bytes = jnp.dtype(config.moment_dtype).itemsize
    return MemoryEstimate(
        weights=sum(leaf.size * leaf.itemsize for leaf in leaves),
        gradients=sum(leaf.size * leaf.itemsize for leaf in trainable),
        optimizer=2 * sum(leaf.size for leaf in trainable) * moment_bytes,
    )
