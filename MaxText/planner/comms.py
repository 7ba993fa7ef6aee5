"""Communication volume and time of each collective, per GPU per step.

A group over some mesh axes has ``l`` GPUs in each of ``r`` NVLink domains. Costs are the
bandwidth terms of the standard algorithms (latency terms are negligible at these sizes):

- all-gather / reduce-scatter of a tensor of ``B`` bytes (whole): hierarchically, ``B (l-1)/l``
  over NVLink and ``B (r-1)/(r l)`` over the network (each GPU carries ``1/l`` of the cross-domain
  share through its own NIC); all-reduce is twice that.
- dispatch/combine (all-to-all, balanced routing): each token copy goes to a uniformly random EP
  rank: ``(l-1)/ep`` of the bytes stay in the domain, ``(ep-l)/ep`` cross the network; the two run
  concurrently. The ``allgather`` exchange instead gathers every token on every EP rank.
- pipeline sends: each micro-batch crosses each virtual stage boundary forward and backward.
- tensor parallelism (sequence parallel): an all-gather before and a reduce-scatter after attention
  and each FFN, forward and backward (experts spread over the tensor ranks skip the FFN pair).

Passes: dispatch and combine run forward and backward (4 exchanges per MoE layer), 6 with ``full``
remat (the forward is rerun). Sharded state (FSDP) gathers the weights forward and backward and
scatters the gradients on every micro-batch; Megatron's distributed optimizer does so once per
step. Gathers move bf16 weights; gradients move in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

from MaxText.planner.constants import ACTIVATION_BYTES, COLLECTIVE_EFFICIENCY, Stack
from MaxText.planner.layout import Layout
from MaxText.planner.model import ModelSpec
from MaxText.planner.systems import System

GRAD_BYTES = 4
WEIGHT_BYTES = 2


@dataclass(frozen=True)
class Collective:
    name: str
    kind: str  # dispatch | tensor | fsdp | dp | pipeline: how it overlaps (estimate.py)
    bytes_nvlink: float  # per GPU per step
    bytes_network: float
    seconds: float


def _gather(
    B: float, layout: Layout, axes: tuple[str, ...], system: System, times: float
) -> tuple[float, float, float]:
    local, r = layout.local(*axes), layout.domains(*axes)
    nvl, net = times * B * (local - 1) / local, times * B * (r - 1) / (r * local)
    return (
        nvl,
        net,
        nvl / (system.nvlink_bw * COLLECTIVE_EFFICIENCY) + net / (system.scaleout_bw * COLLECTIVE_EFFICIENCY),
    )


def collectives(spec: ModelSpec, layout: Layout, system: System, stack: Stack) -> list[Collective]:
    out: list[Collective] = []
    tokens = layout.gbs * spec.seq_len / layout.num_gpus  # per GPU per step
    passes = 6 if layout.remat == "full" else 4
    D, K, ep = spec.d_model, spec.top_k, layout.ep
    in_domain = layout.local(*layout.ep_axes)
    eff = stack.dispatch_efficiency
    if ep > 1:
        if stack.exchange == "allgather":
            B = tokens * spec.moe_layers * ep * D * ACTIVATION_BYTES  # whole gathered token set
            nvl, net, _ = _gather(B, layout, layout.ep_axes, system, passes)
            seconds = nvl / (system.nvlink_bw * eff) + net / (system.scaleout_bw * eff)
        else:
            sent = tokens * spec.moe_layers * K * D * ACTIVATION_BYTES * passes
            nvl, net = sent * (in_domain - 1) / ep, sent * (ep - in_domain) / ep
            seconds = max(nvl / (system.nvlink_bw * eff), net / (system.scaleout_bw * eff))
        out.append(Collective("dispatch/combine", "dispatch", nvl, net, seconds))

    dense_full = spec.params_dense / (layout.tp * layout.pp)  # a replica's dense weights on one GPU
    expert_full = spec.params_expert / layout.expert_shards
    if stack.state == "sharded":
        m = layout.microbatches
        for name, P, axes in (("dense", dense_full, ("fsdp", "expert")), ("expert", expert_full, ("fsdp",))):
            if layout.size(*axes) > 1:
                nvl, net, s = _gather(P * WEIGHT_BYTES, layout, axes, system, 2 * m)
                nvl2, net2, s2 = _gather(P * GRAD_BYTES, layout, axes, system, m)
                out.append(
                    Collective(f"fsdp {name} all-gather + reduce-scatter", "fsdp", nvl + nvl2, net + net2, s + s2)
                )
        if layout.size("data") > 1:  # gradients of the fsdp-sharded state, once per step
            shard = dense_full / layout.size("fsdp", "expert") + expert_full / layout.size("fsdp")
            nvl, net, s = _gather(shard * GRAD_BYTES, layout, ("data",), system, 2)
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
