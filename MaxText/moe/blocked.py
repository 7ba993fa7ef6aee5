"""Block-padded grouped matmul: the portable dropless backend (the CPU default).

Each expert's rows are padded to a multiple of ``moe_block_rows`` (B) by the dispatch layout, so
the routed batch is ``NB`` blocks of B rows, each belonging to one expert. A ``lax.scan`` does one
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
def block_matmul(xp_PI: jax.Array, w_EIO: jax.Array, expert_NB: jax.Array) -> jax.Array:
    """Block b of rows times ``w[expert_NB[b]]``: [P, I] -> [P, O]."""
    NB = expert_NB.shape[0]
    xb = xp_PI.reshape(NB, -1, xp_PI.shape[-1])

    def one_block(_, block):
        x_BI, e = block
        return None, x_BI @ w_EIO[e]

    _, y = jax.lax.scan(one_block, None, (xb, expert_NB))
    return y.reshape(xp_PI.shape[0], w_EIO.shape[-1])


def _block_matmul_fwd(xp_PI, w_EIO, expert_NB):
    return block_matmul(xp_PI, w_EIO, expert_NB), (xp_PI, w_EIO, expert_NB)


def _block_matmul_bwd(residuals, dy_PO):
    xp_PI, w_EIO, expert_NB = residuals
    NB = expert_NB.shape[0]
    xb = xp_PI.reshape(NB, -1, xp_PI.shape[-1])
    dyb = dy_PO.reshape(NB, -1, dy_PO.shape[-1])

    def one_block(dw_EIO, block):
        x_BI, dy_BO, e = block
        dw_EIO = dw_EIO.at[e].add(x_BI.T @ dy_BO)  # weight gradient: in place into expert e
        return dw_EIO, dy_BO @ w_EIO[e].T  # data gradient: the transposed product

    dw_EIO, dx = jax.lax.scan(one_block, jnp.zeros_like(w_EIO), (xb, dyb, expert_NB))
    return dx.reshape(xp_PI.shape), dw_EIO, None


block_matmul.defvjp(_block_matmul_fwd, _block_matmul_bwd)
