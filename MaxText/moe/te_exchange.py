"""Transformer Engine's NCCL expert-parallel exchange (``moe_ep_comm: te``; GPU only).

TE's ``ep_dispatch`` sends each token to the devices of its experts and hands every device its
received rows already sorted by local expert, each expert's group padded with zero rows to a
multiple of ``ALIGN_ROWS``, plus each row's router weight and the group sizes; ``ep_combine``
sums the weighted expert outputs back onto the tokens. Both are collectives over the global
arrays (outside ``shard_map``); between them the expert MLPs run per device, inside ``shard_map``,
with whichever ``moe_matmul`` backend is chosen. The receive buffer is sized for the worst case
(TE's dropless capacity), so no token is dropped. The capacity counts the tokens of one rank of
the token split: where the rules leave tokens replicated over ``tensor``, that is ``tensor``
times the tokens per device, and every tensor rank dispatches and computes the same copies
(correct, not split; the ``shard_map`` exchanges of ``expert_parallel.py`` split them).

NCCL EP is set up once per process, eagerly, inside the mesh: ``ep_context`` does that and keeps
TE's mesh resource active around the training loop. Written against the transformer_engine 2.20.2
JAX API (``transformer_engine.jax.ep``); imported only when this exchange is chosen.

Shape legend: T tokens (global), K experts per token, D model dim, R received rows per device.
"""

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from MaxText.config import Config
from MaxText.moe.dispatch import BlockLayout
from MaxText.parallel.axes import STAGE_AXIS
from MaxText.parallel.sharding import batch_mesh_axes

ALIGN_ROWS = 128  # TE pads each expert's received group to this many rows (its grouped-GEMM tile)


def rank_tokens(num_tokens: int, axis_sizes: Mapping[str, int], token_axes: Sequence[str]) -> int:
    """Tokens on one rank of the token split over ``token_axes``: more than per device where the
    rules leave tokens replicated over an axis (``tensor``), and what the receive capacity must
    be sized by (sizing it by devices would undersize it that many times)."""
    return num_tokens // math.prod(axis_sizes[a] for a in token_axes)


def recv_capacity(config: Config, tokens_per_device: int, ep: int) -> int:
    """Rows each device must be able to receive so that no routing drops a token."""
    from transformer_engine.jax.moe import get_moe_recv_capacity_per_rank

    return get_moe_recv_capacity_per_rank(
        num_experts=config.num_experts,
        num_experts_per_tok=config.num_experts_per_tok,
        max_tokens_per_rank=tokens_per_device,
        ep_size=ep,
        recv_capacity_factor=None,  # the dropless worst case
    )


@contextlib.contextmanager
def ep_context(config: Config, mesh: jax.sharding.Mesh, tokens_per_device: int, axis: str) -> Iterator[None]:
    """Bootstrap NCCL EP for this mesh and keep TE's mesh resource active while training."""
    from transformer_engine.jax import ep
    from transformer_engine.jax.sharding import MeshResource, global_shard_guard

    outer = [a for a in batch_mesh_axes() if a not in (axis, STAGE_AXIS)]  # the pipeline's axis is not TE's FSDP
    resource = MeshResource(fsdp_resource=outer[-1] if outer else None, ep_resource=axis)
    tokens_per_rank = rank_tokens(tokens_per_device * mesh.size, mesh.shape, (*outer, axis))
    with jax.set_mesh(mesh), global_shard_guard(resource):
        ep.ep_bootstrap(
            world_size=None,
            rank=None,
            num_experts=config.num_experts,
            max_tokens_per_rank=tokens_per_rank,
            recv_capacity_per_rank=recv_capacity(config, tokens_per_rank, mesh.shape[axis]),
            hidden_dim=config.emb_dim,
        )
        try:
            yield
        finally:
            ep.ep_finalize()


def group_layout(group_sizes_E: jax.Array) -> BlockLayout:
    """The layout of rows that already sit sorted by expert in padded groups: only the group
    bounds are known (what the backends read); the token maps stay with TE."""
    start_E = jnp.cumsum(group_sizes_E) - group_sizes_E
    return BlockLayout(None, None, None, None, group_sizes_E, start_E, group_sizes_E)


def te_experts(
    x_TD: jax.Array,
    experts_TK: jax.Array,
    weights_TK: jax.Array,
    wi_0: jax.Array,
    wi_1: jax.Array,
    wo: jax.Array,
    config: Config,
    backend: Callable[..., jax.Array],
    axis: str,
) -> jax.Array:
    """``routed_experts`` through TE's NCCL EP dispatch and combine; ``backend`` computes the
    received rows ([R, D] with a ``BlockLayout``) on each device's experts."""
    from transformer_engine.jax import ep

    T, D = x_TD.shape
    K = experts_TK.shape[-1]
    cfg = ep.EpLayerConfig(top_k=K, dispatch_output_per_expert_alignment=ALIGN_ROWS)
    mesh = jax.sharding.get_abstract_mesh()
    # TE wants the token dim split over (outer axes..., ep) exactly, with ep innermost.
    rows_spec = P((*[a for a in batch_mesh_axes() if a != axis], axis))
    capacity = recv_capacity(config, rank_tokens(T, mesh.shape, rows_spec[0]), mesh.shape[axis])
    x_TD, experts_TK, weights_TK = (
        jax.lax.with_sharding_constraint(a, P(rows_spec[0], None)) for a in (x_TD, experts_TK, weights_TK)
    )
    recv_x, recv_w, handle, group_sizes, _ = ep.ep_dispatch(
        cfg, experts_TK.astype(jnp.int32), x_TD.astype(jnp.bfloat16), weights_TK.astype(jnp.float32), capacity
    )

    expert_spec = P(axis, None, None)

    def per_device(recv_x, recv_w, group_sizes, wi_0, wi_1, wo):
        x_RD = recv_x.reshape(-1, D)
        y_RD = backend(x_RD, wi_0, wi_1, wo, group_layout(group_sizes.reshape(-1).astype(jnp.int32)), config)
        weighted = y_RD * recv_w.reshape(-1, 1).astype(y_RD.dtype)
        return weighted.astype(jnp.bfloat16).reshape(recv_x.shape)  # NCCL EP moves bfloat16 tokens

    y = jax.shard_map(
        per_device,
        in_specs=(rows_spec, rows_spec, rows_spec, expert_spec, expert_spec, expert_spec),
        out_specs=rows_spec,
        check_vma=False,
    )(recv_x, recv_w, group_sizes, wi_0, wi_1, wo)
    return ep.ep_combine(cfg, handle, group_sizes, y, T, (rows_spec[0],)).astype(x_TD.dtype)
