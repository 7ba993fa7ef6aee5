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
buffers hold before real data reaches them (tests fill them with NaN to show it). An item leaves
the last stage at least one iteration before it re-enters stage 0 when ``m >= stages``; with more
micro-batches it waits in stage 0's buffer.

*Lanes* hide the stage transfers. Each micro-batch's rows are dealt into ``lanes`` interleaved
lanes (rows l, l + lanes, ...) that go through an iteration one after another: a lane's output
is sent while the next lane computes, and the last lane's output is sent at the start of the next
iteration, under the other lanes' work. Nothing a lane computes waits for a transfer still in
flight, so XLA's scheduler can overlap a transfer with another lane's GEMMs (with one lane the
next iteration waits for the transfer); each lane's first layer runs outside the layers' loop,
where the scheduler places GEMMs under a transfer (it does not overlap one with a nested loop).
The rows a lane computes are 1/lanes of a micro-batch's.

The loop is a ``scan`` over iterations (compile time does not grow with m). Each layer keeps what
``remat_policy`` (the model's) keeps for its backward pass, and its input; an iteration keeps
nothing more (not the repeat's slice of the weights: the backward slices the stack again), so the
forward runs once, as without the pipeline. The weights' gradient is summed in one buffer, in
place, over the iterations and the layers: the weights enter the loops without a derivative, and
a *gradient sink* (zeros with the weights' derivative, ``gradient_sink``) travels in the loops'
carry, where each layer's slice of the weights takes its gradient (``gradient_through``). A
forward-only program (evaluation) carries the sink too: a float32 copy of the stage's weights.
Inside a stage, FSDP gathers each layer's weights where it runs, in every iteration. Every stage
also holds the m micro-batches' input, the buffer of items between repeats and the output (SPMD:
one program), and the output is summed over the stages once at the end (an all-reduce of the
stack's output). Parameters are kept stage-major:
each leaf ``[repeats, stages, per_stage, ...]`` (``to_stages``), whose row-major flattening is the
layer order, with the ``stages`` dim split over the mesh axis, so each stage holds its own layers.

Shape legend: R repeats, P stages, J layers per stage, M micro-batches, B rows of a micro-batch,
N lanes, b = B / N rows of a lane.
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


# What a layer without a remat policy recomputes in the backward pass rather than keep: slices,
# reshapes and casts, which is what its weights go through (a layer's slice of the stack, cast to
# the compute dtype); kept, every iteration would hold a copy of its layers' weights.
RECOMPUTED_COPIES = frozenset({"dynamic_slice", "slice", "squeeze", "reshape", "convert_element_type", "transpose"})


def keep_all_but_copies(prim, *_, **__) -> bool:
    """A remat policy: keep every value but those ``RECOMPUTED_COPIES`` makes."""
    return prim.name not in RECOMPUTED_COPIES


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


def has_gradient(w: jax.Array) -> bool:
    """Whether autodiff takes a gradient for ``w`` (floating point; not integers)."""
    return jnp.issubdtype(w.dtype, jnp.inexact)


@jax.custom_jvp
def gradient_through(value: jax.Array, sink: jax.Array) -> jax.Array:
    """``value``, differentiated as ``value + sink`` (``sink`` is zero): the gradient for ``value``
    also goes to ``sink``, whose value is never read (so no loop keeps it for its backward pass)."""
    return value


@gradient_through.defjvp
def _gradient_through_jvp(primals, tangents):
    return primals[0], tangents[0] + tangents[1]


def gradient_sink(w: jax.Array) -> jax.Array:
    """Zeros laid out like ``w`` whose derivative with respect to ``w`` is the identity. Passed
    through a loop's carry (and read with ``gradient_through``), it collects the loop's gradient
    for ``w`` in the carry's cotangent, one buffer updated in place however deep the loops nest,
    where a loop-invariant ``w`` takes a buffer per loop level (the inner one's added to the outer
    one's after each inner loop). A leaf without a gradient is its own sink, never read."""
    return w - jax.lax.stop_gradient(w) if has_gradient(w) else w


def _layer(leaf: jax.Array, r: jax.Array, j: jax.Array) -> jax.Array:
    """Layer ``j`` of repeat ``r`` of a stage's leaf [R, 1, J, ...]: one dynamic slice, whose
    transpose is one update in place (two nested ones made XLA copy the gradient with lanes)."""
    return jax.lax.dynamic_slice(leaf, (r, 0, j) + (0,) * (leaf.ndim - 3), (1, 1, 1, *leaf.shape[3:]))[0, 0, 0]


def _pick(a: jax.Array, i: jax.Array) -> jax.Array:
    """Entry ``i`` of ``a``'s leading dim (a traced index)."""
    return jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False)


def to_lanes(x_MB: jax.Array, lanes: int) -> list[jax.Array]:
    """[M, B, ...] -> ``lanes`` arrays [M, B / lanes, ...], lane l taking rows l, l + lanes, ... (a
    device's rows stay its own when each holds a multiple of ``lanes``)."""
    if lanes == 1:
        return [x_MB]
    M, B = x_MB.shape[:2]
    split = x_MB.reshape(M, B // lanes, lanes, *x_MB.shape[2:])
    return [split[:, :, lane] for lane in range(lanes)]


def from_lanes(lanes_MB: list[jax.Array]) -> jax.Array:
    """The inverse of ``to_lanes``."""
    joined = jnp.stack(lanes_MB, axis=2)
    return joined.reshape(joined.shape[0], -1, *joined.shape[3:])


def circular_pipeline(
    layer_fn: LayerFn,
    staged: Params,
    x_MB: jax.Array,
    side_MB: Any = None,
    axis: str = STAGE_AXIS,
    fill: float = 0.0,
    lanes: int = 1,
    remat_policy: Callable[..., Any] | None = None,
) -> tuple[jax.Array, Any]:
    """Every micro-batch of ``x_MB`` [M, B, ...] through all the layers of ``staged`` (leaves
    [R, P, J, ...], ``to_stages``), in order; the outputs [M, B, ...] and each layer's statistics
    summed over the micro-batches and lanes, leaves [R, P, J, ...] (bubbles excluded).

    ``layer_fn(params, x, side) -> (x, stats)`` is one layer on one lane of a micro-batch;
    ``side`` is that lane's slice of ``side_MB`` (leaves [M, B, ...]: what every layer reads and
    none changes, such as positions), looked up by each stage rather than passed along.
    ``remat_policy`` (a ``jax.checkpoint_policies`` policy) is what each layer keeps for its
    backward pass besides its input, which it recomputes the rest from; None keeps everything but
    copies (``keep_all_but_copies``). The schedule runs inside a ``shard_map`` that is manual over
    ``axis`` only: the other mesh axes (FSDP, experts, the batch split) stay XLA's, as outside the
    pipeline."""
    R, stages = jax.tree.leaves(staged)[0].shape[:2]
    M, B = x_MB.shape[:2]
    if jax.sharding.get_abstract_mesh().shape.get(axis, 1) != stages:
        raise ValueError(f"the parameters have {stages} stages, the mesh axis '{axis}' is not {stages} ways")
    if M < stages:
        raise ValueError(f"{M} micro-batches cannot fill {stages} stages: the pipeline needs at least one per stage")
    if lanes < 1 or B % lanes:
        raise ValueError(f"{B} rows of a micro-batch do not deal into {lanes} lanes")
    iterations = M * R + stages - 1
    ring = [(j, (j + 1) % stages) for j in range(stages)]

    def send(y):  # to the next stage (the last stage's output goes back to stage 0)
        with jax.named_scope(TRANSFER_SCOPE):
            return jax.lax.ppermute(y, axis, ring)

    def layer_at(params, sink, r, j, x, side):  # layer j of this stage's repeat r (params [R, 1, J, ...])
        def weights(leaf, sink_leaf):
            w = _layer(leaf, r, j)
            return gradient_through(w, _layer(sink_leaf, r, j)) if has_gradient(leaf) else w

        return layer_fn(jax.tree.map(weights, params, sink), x, side)

    # Each layer keeps what the remat policy keeps; its inputs are the loop-invariant stack, the
    # sink (whose value no backward pass reads) and indices, so no iteration keeps a copy of its
    # layers' weights, and nothing is recomputed beyond the policy's own rerun.
    checkpointed_layer = jax.checkpoint(layer_at, policy=remat_policy or keep_all_but_copies, prevent_cse=False)

    def stage(params, sink, r, x, side):  # this stage's J layers of repeat r on one lane of a micro-batch
        def one_layer(carry, j):
            x, sink = carry
            y, stats = checkpointed_layer(params, sink, r, j, x, side)
            # JAX's scan moves a carry its body returns unchanged into the loop's constants, whose
            # gradient each loop level sums in a buffer of its own; the barrier keeps it a carry.
            return (y, jax.lax.optimization_barrier(sink)), stats

        layers = jnp.arange(jax.tree.leaves(params)[0].shape[2])
        if lanes == 1:
            (x, sink), stats = jax.lax.scan(one_layer, (x, sink), layers)
            return x, sink, stats
        # With lanes, the first layer runs outside the layers' loop: XLA's scheduler puts a
        # transfer under GEMMs of the iteration's own body, never under a nested loop, so these
        # are what another lane's transfer can run under.
        carry, first = one_layer((x, sink), 0)
        (x, sink), rest = jax.lax.scan(one_layer, carry, layers[1:])
        return x, sink, jax.tree.map(lambda a, b: jnp.concatenate([a[None], b]), first, rest)

    def local(params, sink, x_MB, side_MB):  # one stage's view: params [R, 1, J, ...], every micro-batch
        s = jax.lax.axis_index(axis)
        x_lanes = to_lanes(x_MB, lanes)
        side_lanes = [jax.tree.map(lambda a, lane=lane: to_lanes(a, lanes)[lane], side_MB) for lane in range(lanes)]

        def receive(arrived, t, waiting, x_M):
            """What this stage computes on in iteration ``t`` from what ``arrived`` from the previous
            stage for it, and stage 0's buffer of items back from the last stage: there ``arrived``
            is item t - P's pass through the last stage, kept by micro-batch, and the input is a new
            micro-batch in the first repeat, else one back."""
            last = t - stages
            slot = jnp.mod(last, M)
            kept = (s == 0) & (last >= 0) & (last < M * R)
            waiting = jax.lax.dynamic_update_index_in_dim(
                waiting, jnp.where(kept, arrived, _pick(waiting, slot)), slot, 0
            )
            first = jnp.where(t < M, _pick(x_M, jnp.mod(t, M)), _pick(waiting, jnp.mod(t, M)))
            return jnp.where(s == 0, first, arrived), waiting

        stats_shape = jax.eval_shape(
            stage, params, sink, 0, x_lanes[0][0], jax.tree.map(lambda a: a[0], side_lanes[0])
        )[2]
        stats = jax.tree.map(lambda a: jnp.zeros((R, *a.shape), a.dtype), stats_shape)
        blank = jnp.full_like(x_lanes[0][0], fill)  # what a buffer holds before real data reaches it
        waiting = [jnp.full_like(x, fill) for x in x_lanes]  # stage 0: items back from the last stage, by micro-batch
        ready = []  # lanes 0 .. N-2: their input for iteration 0 (the last lane's arrives in the iteration)
        for lane in range(lanes - 1):
            x, waiting[lane] = receive(blank, 0, waiting[lane], x_lanes[lane])
            ready.append(x)

        def iteration(carry, t):
            ready, pending, waiting, stats, sink = carry
            k = t - s
            busy = (k >= 0) & (k < M * R)
            r = jnp.clip(k // M, 0, R - 1)
            i = jnp.mod(k, M)
            # The last lane's output of the previous iteration goes first, under the other lanes' work.
            x_last, waiting[-1] = receive(send(pending), t, waiting[-1], x_lanes[-1])
            inputs, ready = [*ready, x_last], []
            for lane, x in enumerate(inputs):
                # A bubble computes on a real micro-batch (finite: no 0 x inf in its backward pass).
                x = jnp.where(busy, x, _pick(x_lanes[lane], i))
                y, sink, layer_stats = stage(
                    params, sink, r, x, jax.tree.map(lambda a, lane=lane: _pick(a, i), side_lanes[lane])
                )
                stats = jax.tree.map(
                    lambda total, new: total.at[r].add(jnp.where(busy, new, jnp.zeros_like(new))), stats, layer_stats
                )
                if lane < lanes - 1:  # sent now, under the next lane's work; computed on next iteration
                    x, waiting[lane] = receive(send(y), t + 1, waiting[lane], x_lanes[lane])
                    ready.append(x)
                else:
                    pending = y
            return (ready, pending, waiting, stats, sink), None

        carry = (ready, blank, waiting, stats, sink)
        (_, pending, waiting, stats, _), _ = jax.lax.scan(iteration, carry, jnp.arange(iterations))
        _, waiting[-1] = receive(send(pending), iterations, waiting[-1], x_lanes[-1])  # the last item's last lane
        # Stage 0 holds the outputs (every item's last pass came back to it); the others give zeros.
        out = from_lanes(waiting)
        out = jax.lax.psum(jnp.where(s == 0, out, jnp.zeros_like(out)), axis)
        return out, jax.tree.map(lambda a: a[:, None], stats)

    by_stage = P(None, axis)  # every leaf [R, P, ...]: parameters in, statistics out
    return jax.shard_map(
        local,
        in_specs=(by_stage, by_stage, P(), P()),
        out_specs=(P(), by_stage),
        axis_names={axis},
        check_vma=False,
    )(jax.lax.stop_gradient(staged), jax.tree.map(gradient_sink, staged), x_MB, side_MB)
