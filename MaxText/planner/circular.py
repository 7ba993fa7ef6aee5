"""What this repository's pipeline schedule (``MaxText/parallel/pipeline.py``) adds to a step, for
the planner's sharded stack with pipeline stages.

Every stage runs ``r m + p - 1`` iterations of its ``J = moe_layers / (p r)`` layers (the bubble's
share is the planner's usual ``(p - 1) / (r m)`` on top of the step), all micro-batches
forward before any backward, each iteration rematerialised from its input. So, against the
unpipelined stack:

- the stack's forward runs once more: +1/3 of its training FLOPs in every class, and two more
  exchange passes per MoE layer (7, not 5: the rerun's dispatch and combine);
- FSDP gathers a stage's weights for each iteration's forward, rerun and backward, and scatters
  its gradients once per iteration: ``3 m`` gathers and ``m`` scatters of the stage's weights per
  step before the bubble, where the unpipelined step has ``2 m`` and ``m``.

Bytes here, as everywhere in the planner, are a step's without the bubble; the step time's
``(1 + bubble)`` adds the bubble's iterations (XLA's program moves ``(r m + p - 1) / (r m)`` times
the planner's bytes of every kind inside the pipeline).

The layers outside the pipeline (dense, MTP, head) are counted with the stack's weights here: at the
671B they are 4 of 62 layers.
"""

from __future__ import annotations

from MaxText.planner.constants import Stack
from MaxText.planner.layout import Layout
from MaxText.planner.model import ModelSpec

STACK_EXCHANGE_PASSES = 7  # dispatch and combine forward, again in the rerun, backward; the rounds' one more
EXCHANGE_PASSES = 5  # the same without the rerun (comms.py: sharded stacks)


def applies(spec: ModelSpec, layout: Layout, stack: Stack) -> bool:
    """The repository's own pipeline: its sharded stack, with stages, for one of its models."""
    return stack.state == "sharded" and layout.pp > 1 and spec.config is not None


def stack_share(spec: ModelSpec, kind: str) -> float:
    """The pipelined MoE stack's share of a FLOP class: of the routed experts' layers (MTP's
    included) for ``grouped``, of all layers otherwise."""
    stacked = spec.config.num_moe_layers
    return stacked / spec.moe_layers if kind == "grouped" else stacked / spec.layers


def rerun_extra(spec: ModelSpec, kind: str) -> float:
    """Executed FLOPs the rerun forward adds to a class, as a share of its model FLOPs."""
    return stack_share(spec, kind) / 3


def exchange_passes(spec: ModelSpec) -> float:
    """Exchange passes per MoE layer, averaged over the stack and the MTP modules' layers."""
    share = stack_share(spec, "grouped")
    return share * STACK_EXCHANGE_PASSES + (1 - share) * EXCHANGE_PASSES


def fsdp_passes(layout: Layout) -> tuple[float, float]:
    """(gathers, scatters) of a stage's weights per step, before the bubble."""
    return 3 * layout.microbatches, layout.microbatches


def split_problem(spec: ModelSpec, layout: Layout) -> str | None:
    """Why the repository's pipeline cannot run ``layout`` for this model, or None: its MoE stack
    must split into stages x repeats chunks (``Config.check_pipeline``), each stage needs a
    micro-batch, and the planner's model of other stacks is not the repository's."""
    if spec.config is None:
        return "pipelines of a model the repository does not build are modelled only"
    layers, chunks = spec.config.num_moe_layers, layout.pp * layout.vpp
    if layers % chunks:
        return f"pipeline: {layers} MoE layers do not split into {layout.pp} stages x {layout.vpp} repeats"
    if layout.microbatches < layout.pp:
        return f"pipeline: {layout.microbatches} micro-batches cannot fill {layout.pp} stages"
    if layout.vpp > 1:  # the [layers] storage is regathered into the circular order each step: not costed here
        return "pipeline: repeats > 1 regather the stack's weights every step (not modelled)"
    if layout.gbs % layout.num_gpus:
        return f"pipeline: {layout.gbs} sequences per step are not whole sequences per GPU"
    return None
