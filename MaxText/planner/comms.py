"""Communication volume and time of each collective, per GPU per step.

A group over some mesh axes has ``l`` GPUs in each of ``r`` NVLink domains. Costs are the
bandwidth terms of the standard algorithms (latency terms are negligible at these sizes):

- all-gather / reduce-scatter of a tensor of ``B`` bytes (whole): hierarchically, ``B (l-1)/l``
  over NVLink and ``B (r-1)/(r l)`` over the network (each GPU carries ``1/l`` of the cross-domain
  share through its own NIC); all-reduce is twice that.
- dispatch/combine (all-to-all, balanced routing): each token copy goes to a uniformly random EP
  rank: ``(l-1)/ep`` of the bytes stay in the domain, ``(ep-l)/ep`` cross the network; the two run
  concurrently. The ``allgather`` exchange instead gathers every token on every EP rank. The
  ``hierarchical`` exchange (DeepEP, HybridEP) sends a token once to each remote domain holding one
  of its experts and forwards it over NVLink there: network bytes per token are the distinct remote
  domains it reaches, which node-limited routing bounds (``routing.py``).
- pipeline sends: each micro-batch crosses each virtual stage boundary forward and backward.
- tensor parallelism (sequence parallel): an all-gather before and a reduce-scatter after attention
  and each FFN, forward and backward (experts spread over the tensor ranks skip the FFN pair).
- the vocabulary split (``layers/vocab_parallel.py``, this repository's sharded stack): the embedding
  and the output head are not gathered; over a group of ``n`` GPUs each lookup reduce-scatters its
  rows and its backward gathers their gradients (bfloat16), each head gathers the hidden states
  (again in the backward, which recomputes the logits) and reduce-scatters their gradient (float32), once
  for the main model and once per MTP depth: ``(n-1) t D`` elements per GPU each. The group is what
  ``vocab_parallel_axes: auto`` takes on GPU, the batch axes inside a domain, for every layout
  costed (the compiled figure is in docs/LOG.md).

Passes: dispatch and combine run forward and backward (4 exchanges per MoE layer); with ``full``
remat Megatron's recompute reruns both (6). This repository's exchange rematerialises its rounds
whatever ``remat_policy`` says, and XLA reruns only the dispatch, the rerun combine's output being
unused: 5 (XLA:GPU's compile of the 671B has 5 x 58 + 4 ragged-all-to-alls, with full and with
minimal remat). With FP8 dispatch (``dispatch_bytes``: a stack whose exchange carries it, this
repository's ``quantization``) the forward dispatch and its rerun move FP8 values and scales
(``quantization/dispatch.py``: 1 + 1/32 bytes per element for MX), the other three bf16.
DeepSeek's own stack (4 passes, no MoE recompute) sends the forward dispatch and the backward's
gradient dispatch in FP8 (1x128 tiles with a float32 scale: 1 + 4/128 bytes), both combines bf16. Sharded state (FSDP) gathers the
weights forward and backward and scatters the gradients on every micro-batch; Megatron's
distributed optimizer does so once per step. Gathers move bf16 weights. Megatron reduces fp32
main gradients; the sharded step reduces the gradients of its bf16 weight copies in bf16 (the
cotangent's dtype, converted to fp32 after the reduction: XLA:GPU's reduce-scatters and
all-reduces of them are bf16).
"""

from __future__ import annotations

from dataclasses import dataclass

from MaxText.parallel.axes import MESH_AXES
from MaxText.planner import circular, routing
from MaxText.planner.constants import ACTIVATION_BYTES, COLLECTIVE_EFFICIENCY, Stack
from MaxText.planner.layout import Layout
from MaxText.planner.model import ModelSpec
from MaxText.planner.systems import System

GRAD_BYTES = 4
# Exchange passes per MoE layer of the sharded stacks: dispatch and combine forward, the remat
# rerun's dispatch, and the backward's two.
EXCHANGE_PASSES = 5
WEIGHT_BYTES = 2


@dataclass(frozen=True)
class Collective:
    name: str
    kind: str  # dispatch | tensor | vocab | fsdp | dp | pipeline: how it overlaps (estimate.py)
    bytes_nvlink: float  # per GPU per step
    bytes_network: float
    seconds: float


def gather_link_bytes(B: float, local: int, domains: int) -> tuple[float, float]:
    """(NVLink, network) bytes one GPU moves to all-gather or reduce-scatter a tensor of ``B``
    bytes over ``local`` GPUs in each of ``domains`` NVLink domains, hierarchically."""
    return B * (local - 1) / local, B * (domains - 1) / (domains * local)


def exchange_link_bytes(sent: float, local: int, group: int) -> tuple[float, float]:
    """(NVLink, network) bytes of an all-to-all sending ``sent`` bytes spread evenly over ``group``
    GPUs, ``local`` of them in this GPU's domain (its own share stays put)."""
    return sent * (local - 1) / group, sent * (group - local) / group


def hierarchical_link_bytes(token_bytes: float, spec: ModelSpec, local: int, group: int) -> tuple[float, float]:
    """(NVLink, network) bytes of a hierarchical exchange of tokens worth ``token_bytes`` (one copy
    each) whose ``K`` copies go to a group of ``group`` GPUs, ``local`` per domain: one copy per
    distinct remote domain crosses the network (``routing.remote_domains``); NVLink carries the
    copies for the other GPUs of the token's own domain and forwards, in each remote domain, the
    copies that are not for the GPU that received the token."""
    K, domains = spec.top_k, group // local
    far = routing.remote_domains(spec.num_experts, K, spec.routing_groups, spec.top_groups, domains, spec.score_func)
    near = K * (local - 1) / group + K * (group - local) / group * (local - 1) / local
    return token_bytes * near, token_bytes * far


def link_seconds(nvl: float, net: float, system: System, efficiency: float = COLLECTIVE_EFFICIENCY) -> float:
    """Time of gather-like traffic: inside the domains, then across them."""
    return nvl / (system.nvlink_bw * efficiency) + net / (system.scaleout_bw * efficiency)


def exchange_seconds(nvl: float, net: float, system: System, efficiency: float = COLLECTIVE_EFFICIENCY) -> float:
    """Time of an all-to-all: both links at once."""
    return max(nvl / (system.nvlink_bw * efficiency), net / (system.scaleout_bw * efficiency))


def _gather(
    B: float, layout: Layout, axes: tuple[str, ...], system: System, times: float
) -> tuple[float, float, float]:
    nvl, net = gather_link_bytes(times * B, layout.local(*axes), layout.domains(*axes))
    return nvl, net, link_seconds(nvl, net, system)


def vocab_group_size(spec: ModelSpec, layout: Layout) -> int:
    """GPUs in the vocabulary split's group under ``layout``: of the configured axes, the batch axes
    without a dcn part whose product divides the vocabulary (1: no split)."""
    if spec.config is None:
        return 1
    from MaxText.parallel.sharding import config_vocab_group

    fast = [a for a in spec.config.vocab_axes() if layout.dcn.get(a, 1) == 1]
    group = config_vocab_group(spec.config, {a: layout.size(a) for a in MESH_AXES}, fast)
    return layout.size(*group) if group else 1


def collectives(
    spec: ModelSpec, layout: Layout, system: System, stack: Stack, dispatch_bytes: float | None = None
) -> list[Collective]:
    """Every collective of a step; ``dispatch_bytes``: bytes per element of an FP8 dispatch."""
    out: list[Collective] = []
    tokens = layout.gbs * spec.seq_len / layout.num_gpus  # per GPU per step
    sharded = stack.state == "sharded"
    pipelined = circular.applies(spec, layout, stack)
    if sharded:
        passes = EXCHANGE_PASSES
    else:
        passes = 6 if layout.remat == "full" else 4
    grad_bytes = ACTIVATION_BYTES if sharded else GRAD_BYTES
    D, K, ep = spec.d_model, spec.top_k, layout.ep
    in_domain = layout.local(*layout.ep_axes)
    eff = stack.dispatch_efficiency
    # in FP8: the forward dispatch and its rerun (sharded), or the forward dispatch and the backward's
    # dispatch of gradients (DeepSeek's: the combine and its backward stay bf16)
    fp8_passes = 2 if dispatch_bytes else 0
    exchanged = ACTIVATION_BYTES * (passes - fp8_passes) + (dispatch_bytes or 0.0) * fp8_passes  # bytes x passes
    if ep > 1:
        if stack.exchange == "allgather":
            B = tokens * spec.moe_layers * ep * D * exchanged  # whole gathered token set, every pass
            nvl, net, _ = _gather(B, layout, layout.ep_axes, system, 1)
            seconds = link_seconds(nvl, net, system, eff)
        elif stack.exchange == "hierarchical":
            sent = tokens * spec.moe_layers * K * D * exchanged
            nvl, net = hierarchical_link_bytes(sent / K, spec, in_domain, ep)
            seconds = exchange_seconds(nvl, net, system, eff)
        else:
            sent = tokens * spec.moe_layers * K * D * exchanged
            nvl, net = exchange_link_bytes(sent, in_domain, ep)
            seconds = exchange_seconds(nvl, net, system, eff)
        out.append(Collective("dispatch/combine", "dispatch", nvl, net, seconds))

    dense_full = spec.params_dense / (layout.tp * layout.pp)  # a replica's dense weights on one GPU
    expert_full = spec.params_expert / layout.expert_shards
    n = vocab_group_size(spec, layout) if sharded else 1
    if n > 1:  # the embedding and the head stay split: their tokens move instead (over NVLink)
        dense_full -= 2 * spec.vocab * D / (layout.tp * layout.pp)
        c = spec.config
        heads = 1 + c.mtp_num_layers
        elements = heads * (n - 1) * tokens * D  # per lookup or head pass
        head_passes = 2  # the split head's backward gathers the hidden states again
        sent = elements * (2 * ACTIVATION_BYTES + head_passes * ACTIVATION_BYTES + GRAD_BYTES)
        out.append(Collective("vocabulary split", "vocab", sent, 0.0, link_seconds(sent, 0.0, system)))
    if sharded:
        m = layout.microbatches
        gathers, scatters = circular.fsdp_passes(spec, layout) if pipelined else (2 * m, m)
        if layout.size("fsdp", "expert") > 1:  # dense weights: gathered forward and backward, gradients scattered
            nvl, net, s = _gather(dense_full * WEIGHT_BYTES, layout, ("fsdp", "expert"), system, gathers)
            nvl2, net2, s2 = _gather(dense_full * grad_bytes, layout, ("fsdp", "expert"), system, scatters)
            out.append(Collective("fsdp dense all-gather + reduce-scatter", "fsdp", nvl + nvl2, net + net2, s + s2))
        if layout.size("fsdp") > 1:  # routed experts: gathered over fsdp forward and backward, gradients scattered
            nvl, net, s = _gather(expert_full * WEIGHT_BYTES, layout, ("fsdp",), system, gathers)
            nvl2, net2, s2 = _gather(expert_full * grad_bytes, layout, ("fsdp",), system, scatters)
            out.append(Collective("fsdp expert all-gather + reduce-scatter", "fsdp", nvl + nvl2, net + net2, s + s2))
        if layout.size("data") > 1:  # gradients of the fsdp-sharded state, once per step
            shard = dense_full / layout.size("fsdp", "expert") + expert_full / layout.size("fsdp")
            nvl, net, s = _gather(shard * grad_bytes, layout, ("data",), system, 2)
            out.append(Collective("data-parallel all-reduce", "dp", nvl, net, s))
    else:
        for name, P, axes in (
            ("dense", dense_full, ("data", "fsdp", "expert")),
            ("expert", expert_full, ("data", "fsdp")),
        ):
            if layout.size(*axes) > 1:
                nvl, net, s = _gather(P * (GRAD_BYTES + WEIGHT_BYTES), layout, axes, system, 1)
                out.append(Collective(f"dp {name} reduce-scatter + all-gather", "dp", nvl, net, s))

    if layout.tp > 1:  # sequence-parallel all-gather + reduce-scatter around attention and the FFN
        group_tokens = layout.gbs * spec.seq_len * layout.tp / layout.num_gpus
        per_sublayer = 6 if layout.remat == "full" else 4  # forward AG + RS, backward RS + AG (+ rerun forward)
        ffn_layers = spec.layers - (spec.moe_layers if layout.experts_over_tensor else 0)
        B = group_tokens * (spec.layers + ffn_layers) * D * ACTIVATION_BYTES
        nvl, net, s = _gather(B, layout, ("tensor",), system, per_sublayer)
        out.append(Collective("tensor-parallel all-gather + reduce-scatter", "tensor", nvl, net, s))

    if layout.pp > 1:
        t = layout.mbs * spec.seq_len / layout.tp
        sent = 2 * layout.microbatches * layout.vpp * t * D * ACTIVATION_BYTES
        cross = layout.domains("stage") > 1
        bw = (system.scaleout_bw if cross else system.nvlink_bw) * COLLECTIVE_EFFICIENCY
        out.append(
            Collective("pipeline send/recv", "pipeline", 0.0 if cross else sent, sent if cross else 0.0, sent / bw)
        )
    return out
