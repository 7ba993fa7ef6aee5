"""The token embedding and the output head split over the vocabulary, while the batch is split
over the same devices.

Under FSDP the [V, D] table and the [D, V] head are gathered whole on every device, and their
gradients produced whole on every device before being reduced: at the 671B that is 1.85 GB per
gathered bfloat16 copy and 3.7 GB per float32 gradient, several times per step. Split over the
``vocab_parallel_axes`` (the "vocabulary group" of n devices, batch axes whose product divides V),
each device keeps V / n rows of each, and the group's tokens travel instead, a slice of the
sequence at a time:

- lookup: a slice's token ids are gathered over the group; each device reads the rows it holds
  (zero for the others) and a reduce-scatter returns each device its own tokens' rows.
- head: a slice's normalised hidden states are gathered; each device computes the logits of its
  rows of the vocabulary for all of them, and the softmax's max and sum and each target's logit
  are combined over the group.

A device holds V / n rows of the weights and their gradients; it receives the n devices' tokens
where FSDP sends it every row. Per use, a device moves about n x T x D elements of tokens (T its
tokens) plus V / n x D of weights from the other axes, against V x D under FSDP: a small group
(n near sqrt(V / T)) moves less than FSDP, a large one far more. Without a group (no axes given,
outside a mesh, or none of them divides V) both run the plain FSDP computation.

Shape legend: B batch, S sequence, D model dim, V vocabulary; lower case = one device's part
(b = B / batch shards, v = V / n, s = S / chunks).
"""

import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from MaxText.layers.common import float32_or_wider
from MaxText.parallel.sharding import batch_mesh_axes, constrain, vocabulary_group

VOCAB_SCOPE = "vocab_split"  # the named scope of the split's shard_maps (op names carry it: aot/overlap.py)


def split_batch_axes() -> tuple[str, ...]:
    """The batch mesh axes that split the tokens (size > 1), () outside a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    return tuple(a for a in batch_mesh_axes() if mesh.shape[a] > 1)


def vocab_group(vocab_size: int, axes: Sequence[str]) -> tuple[str, ...]:
    """The group the current mesh splits the vocabulary over (``sharding.vocabulary_group``)."""
    mesh = jax.sharding.get_abstract_mesh()
    return vocabulary_group(vocab_size, axes, batch_mesh_axes(), dict(mesh.shape)) if not mesh.empty else ()


def _split(batch_size: int, vocab_size: int, axes: Sequence[str]) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """(batch axes, vocabulary group), or None where the plain computation applies."""
    batch_axes = split_batch_axes()
    if not batch_axes:
        return None
    shards = math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in batch_axes)
    group = vocab_group(vocab_size, axes)
    if not group or batch_size % shards:
        return None
    return batch_axes, group


def _slices(a: jax.Array, chunks: int) -> jax.Array:
    """[b, S, ...] -> [chunks, b, S / chunks, ...]"""
    return a.reshape(a.shape[0], chunks, a.shape[1] // chunks, *a.shape[2:]).swapaxes(0, 1)


def _unslice(a: jax.Array) -> jax.Array:
    """[chunks, b, s, ...] -> [b, chunks * s, ...]"""
    a = a.swapaxes(0, 1)
    return a.reshape(a.shape[0], a.shape[1] * a.shape[2], *a.shape[3:])


def _local_rows(ids: jax.Array, group: tuple[str, ...], rows: int) -> jax.Array:
    """Vocabulary ids as rows of this device's shard (inside ``shard_map``); ids held by another
    device map past the end (``rows``), where a ``mode="fill"`` read gives 0."""
    local = ids - jax.lax.axis_index(group) * rows
    return jnp.where((local >= 0) & (local < rows), local, rows)


def _varying_over_others(weight: jax.Array, batch_axes: tuple[str, ...], group: tuple[str, ...]) -> jax.Array:
    """Mark the weight as varying over the batch axes outside the group (they hold other tokens
    and the same rows), before the slices: its gradient is then summed over those axes once, in
    the weight's float32, instead of once per slice in the compute dtype."""
    others = tuple(a for a in batch_axes if a not in group)
    return jax.lax.pcast(weight, others, to="varying") if others else weight


def _gather_tokens(x_bsD: jax.Array, group: tuple[str, ...]) -> jax.Array:
    """The group's tokens, [n x b, s, D]. The backward pass sums the group's n partial gradients
    in float32 before rounding to ``x``'s dtype (a bfloat16 reduce-scatter would round n times)."""

    @jax.custom_vjp
    def gather(x):
        return jax.lax.all_gather(x, group, axis=0, tiled=True)

    def gather_bwd(_, g):
        wide = g.astype(float32_or_wider(g.dtype))
        return (jax.lax.psum_scatter(wide, group, scatter_dimension=0, tiled=True).astype(g.dtype),)

    gather.defvjp(lambda x: (gather(x), None), gather_bwd)
    return gather(x_bsD)


def embed_lookup(
    table_VD: jax.Array, ids_BS: jax.Array, dtype: jnp.dtype, chunks: int, axes: Sequence[str]
) -> jax.Array:
    """``table[ids]`` in ``dtype``, [B, S, D]. Split over a group, the rows are read from the
    float32 (weight dtype) table, so its gradient is summed in float32; only the rows are cast."""
    split = _split(ids_BS.shape[0], table_VD.shape[0], axes)
    if split is None:  # whole rows on every device, so that each batch shard looks its tokens up locally
        return constrain(jnp.asarray(table_VD, dtype), ("vocab", None))[ids_BS]
    batch_axes, group = split

    def lookup(table_vD: jax.Array, ids_bS: jax.Array) -> jax.Array:
        table_vD = _varying_over_others(table_vD, batch_axes, group)

        def lookup_slice(ids_bs: jax.Array) -> jax.Array:
            local_ns = _local_rows(jax.lax.all_gather(ids_bs, group, axis=0, tiled=True), group, table_vD.shape[0])
            rows_nsD = jnp.take(table_vD, local_ns, axis=0, mode="fill", fill_value=0).astype(dtype)
            return jax.lax.psum_scatter(rows_nsD, group, scatter_dimension=0, tiled=True)

        if chunks == 1:
            return lookup_slice(ids_bS)
        return _unslice(jax.lax.map(lookup_slice, _slices(ids_bS, chunks)))

    with jax.named_scope(VOCAB_SCOPE):
        return jax.shard_map(lookup, in_specs=(P(group, None), P(batch_axes)), out_specs=P(batch_axes))(
            table_VD, ids_BS
        )


def head_logits(x_bsD: jax.Array, head_Dv: jax.Array) -> jax.Array:
    """[.., D] x [D, v] -> [.., v] logits in float32 (or wider)."""
    return jnp.einsum("bsd,dv->bsv", x_bsD, head_Dv, preferred_element_type=float32_or_wider(head_Dv.dtype))


def head_nll_sum(
    normed_BSD: jax.Array,
    head_DV: jax.Array,
    targets_BS: jax.Array,
    weights_BS: jax.Array,
    chunks: int,
    axes: Sequence[str],
) -> jax.Array:
    """Summed cross-entropy of the head's logits over positions with weight 1 (float32 or wider),
    over ``chunks`` slices of the sequence in turn; each slice's logits are recomputed in the
    backward pass. Split over a group, a float32 ``head_DV`` is cast to the hidden states' dtype
    per slice, so its gradient is summed over slices in float32."""
    split = _split(targets_BS.shape[0], head_DV.shape[1], axes)
    if split is None:  # the head gathered once for all slices, not once per slice
        head_DV = constrain(jnp.asarray(head_DV, normed_BSD.dtype), (None, "vocab"))
        return _map_slices(_whole_head_nll, (normed_BSD, targets_BS, weights_BS), chunks, head_DV)
    batch_axes, group = split

    def nll(x_bSD: jax.Array, w_Dv: jax.Array, t_bS: jax.Array, wt_bS: jax.Array) -> jax.Array:
        def slice_nll(args: tuple[jax.Array, ...], w_Dv: jax.Array) -> jax.Array:
            x_bsD, t_bs, wt_bs = args
            x_nsD = _gather_tokens(x_bsD, group)
            t_ns = jax.lax.all_gather(t_bs, group, axis=0, tiled=True)
            logits_nsv = head_logits(x_nsD, w_Dv.astype(x_nsD.dtype))
            top_ns = jax.lax.pmax(jax.lax.stop_gradient(logits_nsv.max(axis=-1)), group)
            sum_ns = jax.lax.psum(jnp.exp(logits_nsv - top_ns[..., None]).sum(axis=-1), group)
            local_ns = _local_rows(t_ns, group, logits_nsv.shape[-1])
            picked_ns = jnp.take_along_axis(logits_nsv, local_ns[..., None], axis=-1, mode="fill", fill_value=0)
            target_ns = jax.lax.psum(picked_ns[..., 0], group)
            nll_ns = top_ns + jnp.log(sum_ns) - target_ns  # every device of the group has all
            own_bs = nll_ns.reshape(-1, *t_bs.shape)[jax.lax.axis_index(group)]
            return (own_bs * wt_bs).sum()  # each token counted once, on the device that holds it

        w_Dv = _varying_over_others(w_Dv, batch_axes, group)
        return jax.lax.psum(_map_slices(slice_nll, (x_bSD, t_bS, wt_bS), chunks, w_Dv), batch_axes)

    specs = (P(batch_axes), P(None, group), P(batch_axes), P(batch_axes))
    with jax.named_scope(VOCAB_SCOPE):
        return jax.shard_map(nll, in_specs=specs, out_specs=P())(normed_BSD, head_DV, targets_BS, weights_BS)


def _whole_head_nll(args: tuple[jax.Array, ...], head_DV: jax.Array) -> jax.Array:
    """The same sum with the head whole on this device."""
    x_bsD, t_bs, wt_bs = args
    logprobs = jax.nn.log_softmax(head_logits(x_bsD, head_DV), axis=-1)
    return (-jnp.take_along_axis(logprobs, t_bs[..., None], axis=-1)[..., 0] * wt_bs).sum()


def _map_slices(fn: Callable, arrays: tuple[jax.Array, ...], chunks: int, weight: jax.Array) -> jax.Array:
    """``fn(arrays, weight)`` summed over ``chunks`` slices of the sequence, one after another,
    each rematerialised in the backward pass (one slice's logits are alive at a time)."""
    if chunks == 1:
        return fn(arrays, weight)
    per_slice = jax.checkpoint(lambda sliced: fn(sliced, weight))
    return jax.lax.map(per_slice, tuple(_slices(a, chunks) for a in arrays)).sum()
