"""What this repository's pipeline schedule (``MaxText/parallel/pipeline.py``) adds to a step, for
the planner's sharded stack with pipeline stages.

Every stage runs ``r m + p - 1`` iterations of its ``J = moe_layers / (p r)`` layers (the bubble's
share is the planner's usual ``(p - 1) / (r m)`` on top of the step), all micro-batches
forward before any backward, each layer rematerialised by the remat policy as without the
pipeline (the forward runs once). So, against the unpipelined stack:

- FLOPs and exchange passes are the same per token (plus the bubble's iterations);
- FSDP gathers a stage's weights in each lane's forward and backward and scatters their gradients
  once per lane: ``2 m n`` gathers and ``m n`` scatters per step before the bubble with ``n``
  lanes (``num_pipeline_lanes``), as ``m n`` accumulated micro-batches would (each lane runs its
  own loop of the stage's layers: XLA:GPU's compiles of the 671B move 1.19x the gathers' bytes with
  2 lanes of 2 micro-batches as with 1 lane of 4);
- the stage transfers are counted exposed (``estimate.py``): lanes leave XLA's schedule room to
  hide some of them, and it hides a part.

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


def applies(spec: ModelSpec, layout: Layout, stack: Stack) -> bool:
    """The repository's own pipeline: its sharded stack, with stages, for one of its models."""
    return stack.state == "sharded" and layout.pp > 1 and spec.config is not None


def fsdp_passes(spec: ModelSpec, layout: Layout) -> tuple[float, float]:
    """(gathers, scatters) of a stage's weights per step, before the bubble: one gather forward
    and one backward, and one scatter, per lane of each micro-batch."""
    passes = layout.microbatches * spec.config.num_pipeline_lanes
    return 2 * passes, passes


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
