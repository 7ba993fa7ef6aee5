"""The grouped matmul: rows grouped by expert times each expert's weight, behind one function.

Every backend has the signature ``(x_MK, w_GKN, group_sizes_G) -> y_MN`` where rows
``[sum(sizes[:g]), sum(sizes[:g+1]))`` of x use ``w[g]``. ``moe_matmul`` picks the backend.

``ragged_dot`` is XLA's native grouped matmul: exact everywhere, fast on GPU/TPU; on XLA:CPU it
is expanded over every group (see docs/LOG.md for its cost).
"""

from collections.abc import Callable

import jax

GroupedMatmul = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def _ragged_dot(x_MK: jax.Array, w_GKN: jax.Array, group_sizes_G: jax.Array) -> jax.Array:
    return jax.lax.ragged_dot(x_MK, w_GKN, group_sizes_G)


BACKENDS: dict[str, GroupedMatmul] = {"ragged_dot": _ragged_dot}


def resolve_backend(name: str) -> str:
    """``auto`` becomes the best backend available here."""
    return "ragged_dot" if name == "auto" else name


def grouped_matmul(x_MK: jax.Array, w_GKN: jax.Array, group_sizes_G: jax.Array, backend: str) -> jax.Array:
    return BACKENDS[resolve_backend(backend)](x_MK, w_GKN, group_sizes_G)
