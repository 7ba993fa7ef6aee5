"""A circular (virtual-stage) pipeline over the ``stage`` mesh axis, in SPMD.

A stack of ``L = repeats x stages x per_stage`` identical layers is cut into ``stages`` x
``repeats`` chunks of ``per_stage`` consecutive layers; chunk ``c`` runs on stage ``c % stages``,
so the layers wrap around the stages ``repeats`` times (layer ``l`` is in repeat
``l // (stages * per_stage)``, on stage ``(l // per_stage) % stages``). The batch is split into
``m`` micro-batches that enter stage 0 one per iteration; every stage runs the same program on
its own micro-batch, then hands its output to the next stage with a ``ppermute``; the last
stage's output returns to stage 0 for the next repeat, or is the stack's output after the last.

    iteration t: stage s works on item k = t - s (micro-batch k % m, repeat k // m), when 0 <= k < m * repeats

A stage with no item (the first ``s`` and last ``stages - 1 - s`` iterations) idles in a
*bubble*: (stages - 1) of the m * repeats + stages - 1 iterations. It computes on one of the
micro-batches instead of whatever its buffers held (a finite input, so its backward pass, whose
incoming gradient is zero, stays finite for any layer that is finite on real data), its output
goes nowhere and its statistics are dropped, so bubbles change no number; ``fill`` sets what the
buffers hold before real data reaches them (tests fill them with NaN to show it). An item leaves the last stage at least one iteration before it
re-enters stage 0 when ``m >= stages``; with more micro-batches it waits in stage 0's buffer.

The loop is a ``scan`` over iterations (compile time does not grow with m), each iteration's
stage computation rematerialised in the backward pass from its input (what the scan keeps per
iteration is one micro-batch's activation). Every stage also holds the m micro-batches' input,
the buffer of items between repeats and the output (SPMD: one program), and the output is summed
over the stages once at the end (an all-reduce of the stack's output). Parameters are kept stage-major: each leaf
``[repeats, stages, per_stage, ...]`` (``to_stages``), whose row-major flattening is the layer
order, with the ``stages`` dim split over the mesh axis, so each stage holds its own layers.

Shape legend: R repeats, P stages, J layers per stage, M micro-batches, B rows of a micro-batch.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from MaxText.parallel.axes import STAGE_AXIS

TRANSFER_SCOPE = "stage_transfer"  # the named scope of the stage transfers (op names carry it: aot/overlap.py)
Params = Any
LayerFn = Callable[[Params, jax.Array, Any], tuple[jax.Array, Any]]  # (a layer's params, x, side) -> (x, stats)


def bubble_fraction(stages: int, repeats: int, microbatches: int) -> float:
    """The share of iterations a stage idles: (p - 1) / (r m + p - 1)."""
    return (stages - 1) / (repeats * microbatches + stages - 1)


def to_stages(stack: Params, stages: int, repeats: int) -> Params:
    """Layer-stacked leaves [L, ...] -> stage-major [R, P, J, ...] (a reshape: the layer order is
    the row-major order of (repeat, stage, layer in stage))."""

    def split(leaf):
        per_stage, rest = divmod(leaf.shape[0], stages * repeats)
        if rest:
            raise ValueError(f"{leaf.shape[0]} layers do not split into {stages} stages x {repeats} repeats")
        return leaf.reshape(repeats, stages, per_stage, *leaf.shape[1:])

    return jax.tree.map(split, stack)


def from_stages(staged: Params) -> Params:
    """Stage-major leaves [R, P, J, ...] -> layer-stacked [L, ...]."""
    return jax.tree.map(lambda leaf: leaf.reshape(-1, *leaf.shape[3:]), staged)


def circular_pipeline(
    layer_fn: LayerFn,
    staged: Params,
    x_MB: jax.Array,
    side_MB: Any = None,
    axis: str = STAGE_AXIS,
    fill: float = 0.0,
) -> tuple[jax.Array, Any]:
    """Every micro-batch of ``x_MB`` [M, B, ...] through all the layers of ``staged`` (leaves
    [R, P, J, ...], ``to_stages``), in order; the outputs [M, B, ...] and each layer's statistics
    summed over the micro-batches, leaves [R, P, J, ...] (bubbles excluded).

    ``layer_fn(params, x, side) -> (x, stats)`` is one layer on one micro-batch; ``side`` is that
    micro-batch's slice of ``side_MB`` (leaves [M, ...]: what every layer reads and none changes,
    such as positions), looked up by each stage rather than passed along. It runs inside a
    ``shard_map`` that is manual over ``axis`` only: the other mesh axes (FSDP, experts, the
    batch split) stay XLA's, as outside the pipeline."""
    R, stages = jax.tree.leaves(staged)[0].shape[:2]
    M = x_MB.shape[0]
    if jax.sharding.get_abstract_mesh().shape.get(axis, 1) != stages:
        raise ValueError(f"the parameters have {stages} stages, the mesh axis '{axis}' is not {stages} ways")
    if M < stages:
        raise ValueError(f"{M} micro-batches cannot fill {stages} stages: the pipeline needs at least one per stage")
    iterations = M * R + stages - 1

    def stage(params, r, x, side):  # this stage's J layers of repeat r on one micro-batch
        def one_layer(x, layer_params):
            return layer_fn(layer_params, x, side)

        mine = jax.tree.map(lambda leaf: jax.lax.dynamic_index_in_dim(leaf, r, 0, keepdims=False)[0], params)
        return jax.lax.scan(one_layer, x, mine)

    def local(params, x_MB, side_MB):  # one stage's view: params [R, 1, J, ...], every micro-batch
        s = jax.lax.axis_index(axis)

        def side_of(i):  # micro-batch i's side inputs
            return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), side_MB)

        stats_shape = jax.eval_shape(stage, params, 0, x_MB[0], side_of(0))[1]
        stats = jax.tree.map(lambda a: jnp.zeros((R, *a.shape), a.dtype), stats_shape)
        # What this stage works on next: at stage 0 the first micro-batch, elsewhere nothing yet.
        state = jnp.where(s == 0, x_MB[0], jnp.full_like(x_MB[0], fill))
        waiting = jnp.full_like(x_MB, fill)  # stage 0: items back from the last stage, by micro-batch

        def iteration(carry, t):
            state, waiting, stats = carry
            k = t - s
            busy = (k >= 0) & (k < M * R)
            r = jnp.clip(k // M, 0, R - 1)
            i = jnp.mod(k, M)
            # A bubble computes on a real micro-batch (finite: no 0 x inf in its backward pass).
            x = jnp.where(busy, state, jax.lax.dynamic_index_in_dim(x_MB, i, 0, keepdims=False))
            y, layer_stats = jax.checkpoint(stage)(params, r, x, side_of(i))
            stats = jax.tree.map(
                lambda total, new: total.at[r].add(jnp.where(busy, new, jnp.zeros_like(new))), stats, layer_stats
            )
            with jax.named_scope(TRANSFER_SCOPE):
                arrived = jax.lax.ppermute(y, axis, [(j, (j + 1) % stages) for j in range(stages)])
            # At stage 0, ``arrived`` is the last stage's item t - (P - 1): keep it by micro-batch.
            last = t - (stages - 1)
            keep = (s == 0) & (last >= 0) & (last < M * R)
            back_slot = jnp.mod(last, M)
            kept = jnp.where(keep, arrived, jax.lax.dynamic_index_in_dim(waiting, back_slot, 0, keepdims=False))
            waiting = jax.lax.dynamic_update_index_in_dim(waiting, kept, back_slot, 0)
            # Stage 0's next item is t + 1: a new micro-batch in the first repeat, else one back.
            following = t + 1
            next_slot = jnp.mod(following, M)
            new = jax.lax.dynamic_index_in_dim(x_MB, next_slot, 0, keepdims=False)
            back = jax.lax.dynamic_index_in_dim(waiting, next_slot, 0, keepdims=False)
            state = jnp.where(s == 0, jnp.where(following < M, new, back), arrived)
            return (state, waiting, stats), None

        (_, waiting, stats), _ = jax.lax.scan(iteration, (state, waiting, stats), jnp.arange(iterations))
        # Stage 0 holds the outputs (every item's last pass came back to it); the others give zeros.
        out = jax.lax.psum(jnp.where(s == 0, waiting, jnp.zeros_like(waiting)), axis)
        return out, jax.tree.map(lambda a: a[:, None], stats)

    by_stage = P(None, axis)  # every leaf [R, P, ...]: parameters in, statistics out
    return jax.shard_map(
        local,
        in_specs=(by_stage, P(), P()),
        out_specs=(P(), by_stage),
        axis_names={axis},
        check_vma=False,
    )(staged, x_MB, side_MB)
