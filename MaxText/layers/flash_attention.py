"""Blockwise ("flash") causal attention in pure JAX, with a hand-written backward pass.

Plain attention materialises the [B, H, S, T] scores in float32, and autodiff keeps the
probabilities for the backward pass: at the 671B shape (H 128, S 4096) that is 8.6 GB per
sequence per layer, several times over. Here the queries are cut into blocks of ``block_q`` rows
and, for each, the keys and values into blocks of ``block_kv`` columns; an online softmax
(running max ``m`` and denominator ``l``, FlashAttention, arXiv 2205.14135) accumulates the
output block by block, so only [B, H, block_q, block_kv] scores exist at a time. The backward
pass (FlashAttention-2, arXiv 2307.08691) recomputes each block's probabilities from the saved
log-sum-exp instead of storing them: memory is O(S x block), not O(S^2), for about one extra
forward's worth of matmuls.

- Causal: query block i only visits key blocks that start before its last row, so the fully
  masked upper triangle of blocks is never computed (about half the work at long S).
- Documents: a key is visible when its segment id equals the query's (0 = padding, which only
  sees padding), exactly the mask of the ``dot`` backend.
- Head dims: queries/keys (K) and values (V) may differ (MLA: 192 and 128).
- Precision: scores, softmax statistics and accumulators in float32 (or wider); probabilities
  are cast to the value dtype before the value matmul, as ``dot`` does.
- Block sizes need not divide S: the sequence is zero-padded to a whole number of blocks; the
  padded keys lie after every real query, so the causal mask hides them.

The loops are sequential over query blocks (``lax.scan``) and key blocks (``lax.fori_loop`` with
a trip count that depends on the query block); each step is a batched matmul over B x H.

``tools/bench_attention.py`` times it against ``dot`` (its figures are in docs/LOG.md). On a GPU
the fused kernels (``cudnn``, ``te``) are the default.

Shape legend: B batch, S query positions, T key positions, H heads, K qk head dim, V value head
dim, Q a query block, C a key block.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

from MaxText.layers.common import float32_or_wider
from MaxText.layers.remat import saved


def flash_attention(
    q_BSHK: jax.Array,
    k_BTHK: jax.Array,
    v_BTHV: jax.Array,
    segment_ids_BS: jax.Array,
    scale: float,
    block_q: int,
    block_kv: int,
) -> jax.Array:
    """Causal, document-masked softmax attention [B, S, H, V], computed blockwise (self-attention: S == T)."""
    S, T = q_BSHK.shape[1], k_BTHK.shape[1]
    if S != T:
        raise ValueError(f"flash attention is causal self-attention: query length {S} != key length {T}")
    block_q, block_kv = min(block_q, S), min(block_kv, T)
    pad_q, pad_kv = -S % block_q, -T % block_kv

    def pad(x, n):
        return jnp.pad(x, [(0, 0), (0, n)] + [(0, 0)] * (x.ndim - 2)) if n else x

    out_BSHV = _flash(
        pad(q_BSHK, pad_q),
        pad(k_BTHK, pad_kv),
        pad(v_BTHV, pad_kv),
        pad(segment_ids_BS, max(pad_q, pad_kv)),
        float(scale),
        block_q,
        block_kv,
    )
    return out_BSHV[:, :S]


def _blocks_visible(i: jax.Array, block_q: int, block_kv: int, num_kv: int) -> jax.Array:
    """How many key blocks query block i sees under the causal mask: those starting before its last row ends."""
    return jnp.minimum(((i + 1) * block_q + block_kv - 1) // block_kv, num_kv)


def _mask_BQC(i, j, seg_q_BQ, seg_k_BC, block_q: int, block_kv: int) -> jax.Array:
    """Causal and same-document mask of block (i, j)."""
    q_Q = i * block_q + jnp.arange(block_q)
    k_C = j * block_kv + jnp.arange(block_kv)
    return (q_Q[:, None] >= k_C[None, :])[None] & (seg_q_BQ[:, :, None] == seg_k_BC[:, None, :])


def _rows(x, start, size):
    return lax.dynamic_slice_in_dim(x, start, size, axis=1)


def _forward(q_BSHK, k_BTHK, v_BTHV, seg_BS, scale, block_q, block_kv):
    """The output [B, S, H, V] and the softmax log-sum-exp [B, H, S]."""
    B, S, H, _ = q_BSHK.shape
    V = v_BTHV.shape[-1]
    acc = float32_or_wider(q_BSHK.dtype)
    lowest = jnp.finfo(acc).min
    num_kv = k_BTHK.shape[1] // block_kv

    def query_block(_, i):
        q_BQHK, seg_q_BQ = _rows(q_BSHK, i * block_q, block_q), _rows(seg_BS, i * block_q, block_q)

        def key_block(j, carry):
            m_BHQ, l_BHQ, o_BHQV = carry
            k_BCHK, v_BCHV = _rows(k_BTHK, j * block_kv, block_kv), _rows(v_BTHV, j * block_kv, block_kv)
            mask_B1QC = _mask_BQC(i, j, seg_q_BQ, _rows(seg_BS, j * block_kv, block_kv), block_q, block_kv)[:, None]
            s_BHQC = jnp.einsum("bqhk,bchk->bhqc", q_BQHK, k_BCHK, preferred_element_type=acc) * scale
            s_BHQC = jnp.where(mask_B1QC, s_BHQC, lowest)
            m_new = jnp.maximum(m_BHQ, s_BHQC.max(axis=-1))
            p_BHQC = jnp.where(mask_B1QC, jnp.exp(s_BHQC - m_new[..., None]), 0)
            alpha_BHQ = jnp.exp(m_BHQ - m_new)
            pv_BHQV = jnp.einsum("bhqc,bchv->bhqv", p_BHQC.astype(v_BCHV.dtype), v_BCHV, preferred_element_type=acc)
            return m_new, alpha_BHQ * l_BHQ + p_BHQC.sum(axis=-1), alpha_BHQ[..., None] * o_BHQV + pv_BHQV

        init = (
            jnp.full((B, H, block_q), lowest, acc),
            jnp.zeros((B, H, block_q), acc),
            jnp.zeros((B, H, block_q, V), acc),
        )
        m_BHQ, l_BHQ, o_BHQV = lax.fori_loop(0, _blocks_visible(i, block_q, block_kv, num_kv), key_block, init)
        # A real row sees at least itself; only padding rows past the last key block see nothing:
        # they get output 0 and a log-sum-exp that makes their backward terms 0, not NaN.
        l_BHQ = jnp.where(l_BHQ > 0, l_BHQ, 1)
        out_BQHV = (o_BHQV / l_BHQ[..., None]).transpose(0, 2, 1, 3).astype(v_BTHV.dtype)
        return None, (out_BQHV, m_BHQ + jnp.log(l_BHQ))

    _, (out_NBQHV, lse_NBHQ) = lax.scan(query_block, None, jnp.arange(S // block_q))
    out_BSHV = out_NBQHV.transpose(1, 0, 2, 3, 4).reshape(B, S, H, V)
    lse_BHS = lse_NBHQ.transpose(1, 2, 0, 3).reshape(B, H, S)
    return out_BSHV, lse_BHS


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _flash(q_BSHK, k_BTHK, v_BTHV, seg_BS, scale, block_q, block_kv):
    return _forward(q_BSHK, k_BTHK, v_BTHV, seg_BS, scale, block_q, block_kv)[0]


def _flash_fwd(q_BSHK, k_BTHK, v_BTHV, seg_BS, scale, block_q, block_kv):
    out_BSHV, lse_BHS = _forward(q_BSHK, k_BTHK, v_BTHV, seg_BS, scale, block_q, block_kv)
    # named, so that ``remat_policy: names`` with ``attention`` keeps what the backward reads
    out_BSHV, lse_BHS = saved(out_BSHV, "attention"), saved(lse_BHS, "attention")
    return out_BSHV, (q_BSHK, k_BTHK, v_BTHV, seg_BS, out_BSHV, lse_BHS)


def _flash_bwd(scale, block_q, block_kv, residuals, dout_BSHV):
    """One pass over query blocks; each recomputes its visible blocks' probabilities from the
    log-sum-exp, adds its dq, and scatters-adds dk and dv into full-length accumulators."""
    q_BSHK, k_BTHK, v_BTHV, seg_BS, out_BSHV, lse_BHS = residuals
    B, S, H, K = q_BSHK.shape
    acc = float32_or_wider(q_BSHK.dtype)
    num_kv = k_BTHK.shape[1] // block_kv
    # D = rowsum(dO * O): the softmax backward's correction term, one number per query and head.
    d_BHS = jnp.einsum("bshv,bshv->bhs", dout_BSHV.astype(acc), out_BSHV.astype(acc))

    def query_block(carry, i):
        start = i * block_q
        q_BQHK, do_BQHV, seg_q_BQ = (
            _rows(q_BSHK, start, block_q),
            _rows(dout_BSHV, start, block_q),
            _rows(seg_BS, start, block_q),
        )
        lse_BHQ = lax.dynamic_slice_in_dim(lse_BHS, start, block_q, axis=2)
        d_BHQ = lax.dynamic_slice_in_dim(d_BHS, start, block_q, axis=2)

        def key_block(j, c):
            dq_BQHK, dk_BTHK, dv_BTHV = c
            kv = j * block_kv
            k_BCHK, v_BCHV = _rows(k_BTHK, kv, block_kv), _rows(v_BTHV, kv, block_kv)
            mask_B1QC = _mask_BQC(i, j, seg_q_BQ, _rows(seg_BS, kv, block_kv), block_q, block_kv)[:, None]
            s_BHQC = jnp.einsum("bqhk,bchk->bhqc", q_BQHK, k_BCHK, preferred_element_type=acc) * scale
            p_BHQC = jnp.where(mask_B1QC, jnp.exp(s_BHQC - lse_BHQ[..., None]), 0)
            dp_BHQC = jnp.einsum("bqhv,bchv->bhqc", do_BQHV, v_BCHV, preferred_element_type=acc)
            ds_BHQC = p_BHQC * (dp_BHQC - d_BHQ[..., None]) * scale
            dq_BQHK += jnp.einsum("bhqc,bchk->bqhk", ds_BHQC.astype(k_BCHK.dtype), k_BCHK, preferred_element_type=acc)
            dk_BCHK = jnp.einsum("bhqc,bqhk->bchk", ds_BHQC.astype(q_BQHK.dtype), q_BQHK, preferred_element_type=acc)
            dv_BCHV = jnp.einsum("bhqc,bqhv->bchv", p_BHQC.astype(do_BQHV.dtype), do_BQHV, preferred_element_type=acc)
            dk_BTHK = lax.dynamic_update_slice_in_dim(dk_BTHK, _rows(dk_BTHK, kv, block_kv) + dk_BCHK, kv, axis=1)
            dv_BTHV = lax.dynamic_update_slice_in_dim(dv_BTHV, _rows(dv_BTHV, kv, block_kv) + dv_BCHV, kv, axis=1)
            return dq_BQHK, dk_BTHK, dv_BTHV

        dq_BQHK = jnp.zeros((B, block_q, H, K), acc)
        visible = _blocks_visible(i, block_q, block_kv, num_kv)
        dq_BQHK, dk_BTHK, dv_BTHV = lax.fori_loop(0, visible, key_block, (dq_BQHK, *carry))
        return (dk_BTHK, dv_BTHV), dq_BQHK.astype(q_BSHK.dtype)

    zeros = (jnp.zeros(k_BTHK.shape, acc), jnp.zeros(v_BTHV.shape, acc))
    (dk_BTHK, dv_BTHV), dq_NBQHK = lax.scan(query_block, zeros, jnp.arange(S // block_q))
    dq_BSHK = dq_NBQHK.transpose(1, 0, 2, 3, 4).reshape(B, S, H, K)
    return dq_BSHK, dk_BTHK.astype(k_BTHK.dtype), dv_BTHV.astype(v_BTHV.dtype), None


_flash.defvjp(_flash_fwd, _flash_bwd)
