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
  are combined over the group. The slices run in a loop that gathers the next slice's tokens
  while one computes; the backward pass recomputes each slice's logits and softmax from the
  forward pass's log-sum-exp (no softmax collective) and reduce-scatters its token gradients while the head's gradient
  is computed (``_group_nll``).

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
from functools import partial

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
    per slice, and its gradient is summed over slices in float32; the logits' gradient enters
    the two backward GEMMs in the hidden states' dtype."""
    split = _split(targets_BS.shape[0], head_DV.shape[1], axes)
    if split is None:  # the head gathered once for all slices, not once per slice
        head_DV = constrain(jnp.asarray(head_DV, normed_BSD.dtype), (None, "vocab"))
        return _map_slices(_whole_head_nll, (normed_BSD, targets_BS, weights_BS), chunks, head_DV)
    batch_axes, group = split

    def nll(x_bSD: jax.Array, w_Dv: jax.Array, t_bS: jax.Array, wt_bS: jax.Array) -> jax.Array:
        w_Dv = _varying_over_others(w_Dv, batch_axes, group)
        slices = tuple(_slices(a, chunks) for a in (x_bSD, t_bS, wt_bS))
        return jax.lax.psum(_group_nll(*slices, w_Dv, group), batch_axes)

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


# ---- the split head's loss, its slices pipelined ----
# Each slice's GEMMs need the group's tokens, gathered, and (backward) return their gradients
# reduce-scattered. The loops below gather slice c + 1 while slice c computes, and the backward
# reduce-scatters slice c's token gradients while its head gradient is computed. Nothing else
# in the loops is a collective (XLA:GPU runs one at a time by default, so a small one between
# a slice's GEMM and the next slice's gather would hold the gather back): the softmax's max,
# sum and target logit are combined over the group for every slice at once after the forward
# loop, and the backward reuses each token's log-sum-exp (a float per token).


def _over_slices(step: Callable, x_cbsD: jax.Array, group: tuple[str, ...]):
    """``step(x_nsD, c)`` for every slice c of ``x_cbsD``, its outputs stacked; ``x_nsD`` is slice
    c gathered over the group, [n x b, s, D], gathered while step c - 1 runs (the loop's carry;
    the last slice runs after the loop)."""
    chunks = x_cbsD.shape[0]

    def gathered(c):
        return jax.lax.all_gather(x_cbsD[c], group, axis=0, tiled=True)

    def body(x_nsD, c):
        return gathered(c + 1), step(x_nsD, c)

    last, outs = jax.lax.scan(body, gathered(0), jnp.arange(chunks - 1))
    return jax.tree.map(lambda a, b: jnp.concatenate([a, b[None]]), outs, step(last, chunks - 1))


def _group_rows(a_cbs: jax.Array, group: tuple[str, ...]) -> jax.Array:
    """Every slice's [b, s] of the group's devices: [chunks, n x b, s]."""
    return jax.lax.all_gather(a_cbs, group, axis=1, tiled=True)


def _group_nll_fwd(x_cbsD, t_cbs, wt_cbs, w_Dv, group):
    """The weighted NLL summed over this device's tokens, and each slice's log-sum-exp of the
    group's tokens [chunks, n x b, s] (float32 or wider)."""
    local_cns = _local_rows(_group_rows(t_cbs, group), group, w_Dv.shape[1])

    def step(x_nsD, c):  # this device's rows of the vocabulary: their max, sum of exp, target
        logits_nsv = head_logits(x_nsD, w_Dv.astype(x_nsD.dtype))
        top_ns = logits_nsv.max(axis=-1)
        picked_ns = jnp.take_along_axis(logits_nsv, local_cns[c][..., None], axis=-1, mode="fill", fill_value=0)
        return top_ns, jnp.exp(logits_nsv - top_ns[..., None]).sum(axis=-1), picked_ns[..., 0]

    top_cns, sum_cns, picked_cns = _over_slices(step, x_cbsD, group)
    group_top_cns = jax.lax.pmax(top_cns, group)
    lse_cns = group_top_cns + jnp.log(jax.lax.psum(sum_cns * jnp.exp(top_cns - group_top_cns), group))
    nll_cns = lse_cns - jax.lax.psum(picked_cns, group)  # every device of the group has all
    C, n = x_cbsD.shape[0], jax.lax.axis_size(group)
    own_cbs = nll_cns.reshape(C, n, -1, *nll_cns.shape[2:])[:, jax.lax.axis_index(group)]
    return (own_cbs * wt_cbs).sum(), (x_cbsD, t_cbs, wt_cbs, w_Dv, lse_cns)  # each token once, by its owner


def _group_nll_bwd(group, residuals, g):
    """d/dlogits = (softmax - one-hot) x weight x the token owner's cotangent: the token
    gradients [n x b, s, D] reduce-scattered back to their devices (summed in float32 or wider),
    the head's gradient summed over the slices."""
    x_cbsD, t_cbs, wt_cbs, w_Dv, lse_cns = residuals
    local_cns = _local_rows(_group_rows(t_cbs, group), group, w_Dv.shape[1])
    g_n = jax.lax.all_gather(g, group)  # each token's loss is its owner's part of the sum
    scale_cns = _group_rows(wt_cbs, group) * jnp.repeat(g_n, x_cbsD.shape[1])[:, None]
    wide = float32_or_wider(w_Dv.dtype)

    def step(x_nsD, c):
        w_cast = w_Dv.astype(x_nsD.dtype)
        logits_nsv = head_logits(x_nsD, w_cast)
        p_nsv = jnp.exp(logits_nsv - lse_cns[c][..., None])
        target_nsv = jnp.arange(logits_nsv.shape[-1]) == local_cns[c][..., None]
        d_nsv = (jnp.where(target_nsv, p_nsv - 1, p_nsv) * scale_cns[c][..., None]).astype(x_nsD.dtype)
        dx_nsD = jnp.einsum("nsv,dv->nsd", d_nsv, w_cast, preferred_element_type=wide)
        dx_bsD = jax.lax.psum_scatter(dx_nsD, group, scatter_dimension=0, tiled=True).astype(x_nsD.dtype)
        return jnp.einsum("nsd,nsv->dv", x_nsD, d_nsv, preferred_element_type=wide), dx_bsD

    dw_cDv, dx_cbsD = _over_slices(step, x_cbsD, group)
    return dx_cbsD, None, None, dw_cDv.sum(axis=0).astype(w_Dv.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _group_nll(x_cbsD, t_cbs, wt_cbs, w_Dv, group):
    """The weighted NLL of this device's tokens (slices [chunks, b, s, ...]) under the group's
    split head ``w_Dv`` (inside ``shard_map``)."""
    return _group_nll_fwd(x_cbsD, t_cbs, wt_cbs, w_Dv, group)[0]


_group_nll.defvjp(_group_nll_fwd, _group_nll_bwd)
