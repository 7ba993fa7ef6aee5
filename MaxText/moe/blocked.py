"""Block-padded grouped matmul: the portable dropless backend (the CPU default).

Each expert's rows are padded to a multiple of ``moe_block_rows`` (B) by the dispatch layout, so
the routed batch is ``NB`` blocks of B rows, each belonging to one expert. A loop does one
dense [B, I] @ [I, O] matmul per block with that block's expert weight, which XLA:CPU runs at
plain-matmul speed for B in 128-512, unlike ``ragged_dot``, which it expands over every expert
(docs/LOG.md). Padded rows are zero and stay zero through the SwiGLU.

The VJP is written out: the data gradient is the same block matmul with transposed weights, and
the weight gradient accumulates ``x_b^T dy_b`` into its expert's slot, in one scan.

Shape legend: E experts, NB blocks of B rows, P = NB*B padded rows, I/O in/out feature dims.
"""

import jax
import jax.numpy as jnp


@jax.custom_vjp
def block_matmul(xp_PI: jax.Array, w_EIO: jax.Array, expert_NB: jax.Array, used_blocks: jax.Array) -> jax.Array:
    """Block b of rows times ``w[expert_NB[b]]``: [P, I] -> [P, O].

    Only the first ``used_blocks`` blocks hold rows (a traced count: the loop's trip count is
    dynamic), so the up-to-E spare blocks that static shapes require cost nothing; their outputs
    are zero.
    """
    NB = expert_NB.shape[0]
    xb = xp_PI.reshape(NB, -1, xp_PI.shape[-1])

    def one_block(b, y):
        return jax.lax.dynamic_update_index_in_dim(y, xb[b] @ w_EIO[expert_NB[b]], b, 0)

    y = jax.lax.fori_loop(0, used_blocks, one_block, jnp.zeros((*xb.shape[:2], w_EIO.shape[-1]), xp_PI.dtype))
    return y.reshape(xp_PI.shape[0], w_EIO.shape[-1])


def _block_matmul_fwd(xp_PI, w_EIO, expert_NB, used_blocks):
    return block_matmul(xp_PI, w_EIO, expert_NB, used_blocks), (xp_PI, w_EIO, expert_NB, used_blocks)


def _block_matmul_bwd(residuals, dy_PO):
    xp_PI, w_EIO, expert_NB, used_blocks = residuals
    NB = expert_NB.shape[0]
    xb = xp_PI.reshape(NB, -1, xp_PI.shape[-1])
    dyb = dy_PO.reshape(NB, -1, dy_PO.shape[-1])

    def one_block(b, carry):
        dw_EIO, dx = carry
        e = expert_NB[b]
        dw_EIO = dw_EIO.at[e].add(xb[b].T @ dyb[b])  # weight gradient: in place into expert e
        dx = jax.lax.dynamic_update_index_in_dim(dx, dyb[b] @ w_EIO[e].T, b, 0)  # data gradient
        return dw_EIO, dx

    dw_EIO, dx = jax.lax.fori_loop(0, used_blocks, one_block, (jnp.zeros_like(w_EIO), jnp.zeros_like(xb)))
    return dx.reshape(xp_PI.shape), dw_EIO, None, None


block_matmul.defvjp(_block_matmul_fwd, _block_matmul_bwd)
