"""Expert parallelism: routed experts split over the ``expert`` mesh axis, inside ``shard_map``.

Each device holds ``E / ep`` experts and its shard of the tokens. ``moe_ep_comm`` chooses how
tokens reach their experts and come back; every exchange is dropless, whatever the routing:

- ``allgather``: gather every device's tokens (and routing) on the expert axis, compute the copies
  routed to the local experts, reduce-scatter the partial outputs back. Traffic: the whole
  group's tokens per device. Simple; the CPU choice.
- ``all_to_all``: each device sends each token once to every device holding one of its experts,
  in fixed slots of ``C + 1`` rows per destination (the last always zero); the receiver computes
  its copies, weights and sums them per token, and the partial outputs travel back the same way.
  Runs everywhere; moves whole slots.
- ``ragged_all_to_all``: sends from a packed layout (each destination's rows back to back, found
  by offsets) into the same slots on the receiver, and takes the outputs back into it; only the
  rows in use move (sizes are exchanged first). GPU/TPU only: XLA:CPU does not implement it.
- ``hierarchical``: two hops for nodes joined by a network (``_two_hop_experts``): a token crosses
  the network once per remote node holding one of its experts, and is forwarded inside the node;
  each hop is the slot exchange above over its group of devices (``Hop``), with its own rounds;
  on GPU only the rows in use move on either hop.
- ``te``: Transformer Engine's NCCL expert-parallel dispatch/combine (GPU; ``te_exchange.py``).

Buffer sizing. A token reaches at most ``min(K, ep)`` devices, so a device sends at most
``N = T * min(K, ep)`` rows: the packed send layout holds exactly that (plus a zero row), and
needs no more whatever the routing. Per destination that is ``N / ep`` rows when routing is
balanced; that share times ``moe_ep_buffer_factor`` is ``C``, the rows one (sender, receiver)
pair moves per round, capped at ``T`` (the most one pair can carry). The receiving side is the
hard one: one device may receive ``ep * T`` rows (all-to-one routing), and XLA allocates
statically, so a receive buffer sized for that would be held whatever the routing. Instead each
device receives into ``ep`` slots of ``C`` rows, and rows past the first ``C`` of a pair go in
further rounds through the same buffers: the group agrees on its fullest pair (one ``pmax``), and
only when that overflows does a ``lax.cond`` run the extra rounds (each rematerialised in the
backward pass, so they keep no residuals). Nothing is dropped; an overflow costs time, not
memory. The price in the common case is that predicate, once per layer and pass (on GPU a
conditional reads it on the host); ``moe_ep_buffer_factor >= ep / min(K, ep)`` gives slots of
``T``, one round and no predicate. ``exchange_buffer_bytes`` counts the buffers: tokens out and
in, partial outputs out and back, and the gradient of each. DeepSeek-V3 671B on 64-way expert
parallelism with 4,096 tokens per device (top-8, D 7,168, bf16), per MoE layer and device:
5.64 GB with ``ragged_all_to_all`` at factor 2 (one round unless a pair carries more than twice
its share), 7.52 GB with ``all_to_all`` (slots on both sides), 30.07 GB for slots of ``T`` on
both sides (what this module used before).

The rows a device receives name their experts local to it: at most ``J = min(K, E / ep)`` of a
token's ``K`` experts live on one device, so each row carries ``J`` (expert, weight) slots, not
``K``, and the expert layout built from them is ``K / J`` times smaller.

Which mesh axes hold tokens and experts comes from ``logical_axis_rules`` (``activation_batch``
and ``exp``); without an expert axis larger than 1 the caller computes experts directly. Inside
the exchange the tokens are also split over every other mesh axis the rules leave them
replicated on (``tensor``): otherwise each tensor rank would send, compute and receive the same
copies; the experts' weights are gathered whole on each device, as under FSDP (the gather over
their embed dim's FSDP axes inside the ``shard_map``, so that their gradients are reduce-scattered:
``weight_embed_axes``). When the tokens
are not split over the expert axis, every device of the group already holds them: each computes
its own experts' copies and the partial outputs are summed.

Shape legend: T tokens (local), K experts per token, J copies per row on a receiving device,
E experts (local), D model dim, ep devices on the expert axis, C rows per pair and round,
S = C + 1 rows per slot (the last always zero), R = ep * S slot rows, N packed send rows.
"""

import math
from collections.abc import Callable, Generator
from functools import partial
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from MaxText.config import Config
from MaxText.moe.dispatch import gather_rows, in_rounds, sum_copies
from MaxText.parallel.axes import MESH_AXES
from MaxText.parallel.platform import trace_platform
from MaxText.parallel.sharding import batch_mesh_axes, spec_axes, stored_spec
from MaxText.quantization import recipe_of
from MaxText.quantization.dispatch import fp8_moved


def dispatch_quantized(x_TD: jax.Array, config: Config) -> jax.Array:
    """The experts' input as it arrives without moving: FP8-quantized and dequantized when the
    dispatch is FP8 (``quantization``), so that every path computes the same numbers."""
    fp8 = recipe_of(config)
    return x_TD if fp8 is None else fp8_moved(None, fp8, x_TD, ())


# An exchange as a generator: it yields twice (the rows it received, then its experts' partial
# outputs), is sent back what should be used in their place, and returns its output.
Exchange = Generator[jax.Array, jax.Array, jax.Array]


# The routed experts' weights' logical axes (block.py).
WI_AXES, WO_AXES = ("exp", "embed", "mlp"), ("exp", "mlp", "embed")
# The weights' FSDP gather inside the exchange's shard_map runs under this name (JAX's op names
# carry it): the ahead-of-time compile counts it, and its gradients' reduce-scatter, as FSDP traffic.
WEIGHTS_SCOPE = "expert_weights"


def expert_axis() -> str | None:
    """The mesh axis experts are exchanged over in the current mesh and rules, if more than 1
    way: the first the rules map ``exp`` onto (the others split the experts for FSDP)."""
    mesh = jax.sharding.get_abstract_mesh()
    axes = nn.logical_to_mesh_axes(("exp",))[0]
    if mesh.empty or axes is None:
        return None
    axis = axes if isinstance(axes, str) else axes[0]
    return axis if mesh.shape[axis] > 1 else None


# ---- slot exchanges: slot d of every device's [ep * S] rows goes to device d ----
# all_to_all moves whole slots (a plain all_to_all, its own transpose); ragged_all_to_all moves
# only the rows in use, sent from the packed layout or from the slots themselves.


class Hop(NamedTuple):
    """The devices of the expert ``axis`` that exchange tokens with each other: the whole axis
    (``size`` ep), or one hop of the two-hop exchange: a node's devices, or the devices with the
    same place in every node (``groups``, JAX's ``axis_index_groups``). A device's place in its
    group is ``axis_index // stride % size``. ``slots_in_use``: slots sent from the slot layout
    move only their rows in use (ragged_all_to_all), not whole (all_to_all)."""

    axis: str
    size: int
    stride: int = 1
    groups: tuple[tuple[int, ...], ...] | None = None
    slots_in_use: bool = False

    def index(self) -> jax.Array:
        if self.groups is None:  # the whole axis
            return jax.lax.axis_index(self.axis)
        return jax.lax.axis_index(self.axis) // self.stride % self.size

    def _index_groups(self) -> list[list[int]] | None:
        return None if self.groups is None else [list(g) for g in self.groups]

    def all_to_all(self, a: jax.Array) -> jax.Array:
        return jax.lax.all_to_all(a, self.axis, 0, 0, tiled=True, axis_index_groups=self._index_groups())

    def ragged_all_to_all(self, *args: jax.Array) -> jax.Array:
        return jax.lax.ragged_all_to_all(*args, axis_name=self.axis, axis_index_groups=self._index_groups())


def whole_axis(axis: str) -> Hop:
    return Hop(axis, jax.sharding.get_abstract_mesh().shape[axis])


@partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def packed_exchange(
    x_ND: jax.Array,
    in_offsets: jax.Array,
    send_sizes: jax.Array,
    out_offsets: jax.Array,
    recv_sizes: jax.Array,
    out_rows: int,
    hop: Hop,
) -> jax.Array:
    """``ragged_all_to_all`` into zeros of ``out_rows`` rows: rows ``[in_offsets[d], +send_sizes[d])``
    go to device d, landing at ``out_offsets[d]`` there; ``recv_sizes[s]`` arrive from s. Its
    transpose moves the rows back: each device learns where its rows landed and where they came
    from with two small ``all_to_all``s of the offsets."""
    placement = (in_offsets, send_sizes, out_offsets, recv_sizes)
    out_RD = _zeros_of_this_exchange((out_rows, *x_ND.shape[1:]), x_ND.dtype, placement)
    return hop.ragged_all_to_all(x_ND, out_RD, *placement)


def _zeros_of_this_exchange(shape: tuple[int, ...], dtype: jnp.dtype, placement: tuple[jax.Array, ...]) -> jax.Array:
    """Zeros computed from the exchange's offsets and sizes (never negative, so the value is 0),
    so that each exchange writes its own buffer once, in the layer that uses it. Constant zeros
    are hoisted out of the layers' scan by JAX (a value computed from no input of the loop), and
    zeros computed alike for two exchanges are merged into one buffer by XLA; either way XLA
    copies the buffer before each in-place ``ragged_all_to_all`` into it, a read and a write
    where a broadcast only writes, and the hoisted buffers are held through the loop (25 buffers
    of 0.94 GB each in XLA:GPU's compile of the GB200 recipe)."""
    zero = jnp.minimum(jnp.min(jnp.stack([a.min() for a in placement])), 0)
    return jnp.broadcast_to(zero.astype(dtype), shape)


def _packed_exchange_fwd(x_ND, in_offsets, send_sizes, out_offsets, recv_sizes, out_rows, hop):
    y = packed_exchange(x_ND, in_offsets, send_sizes, out_offsets, recv_sizes, out_rows, hop)
    return y, (x_ND.shape[0], in_offsets, send_sizes, out_offsets, recv_sizes)


def _packed_exchange_bwd(out_rows, hop, residuals, dy_RD):
    in_rows, in_offsets, send_sizes, out_offsets, recv_sizes = residuals
    landed, came_from = (hop.all_to_all(a) for a in (out_offsets, in_offsets))
    dx_ND = packed_exchange(dy_RD, landed, recv_sizes, came_from, send_sizes, in_rows, hop)
    return dx_ND, None, None, None, None


packed_exchange.defvjp(_packed_exchange_fwd, _packed_exchange_bwd)


class ExchangePlan(NamedTuple):
    rows_per_pair: int  # C: the rows one device sends one destination per round
    rounds: int  # rounds the worst routing needs; the first always runs, the others on overflow only


def exchange_plan(tokens: int, top_k: int, ep: int, factor: float) -> ExchangePlan:
    """``C`` = ``factor`` x the balanced share ``T * min(K, ep) / ep`` (at least 1, at most ``T``),
    and the rounds that move a pair's ``T`` rows (the most any routing sends it) ``C`` at a time."""
    C = max(1, min(tokens, math.ceil(factor * tokens * min(top_k, ep) / ep)))
    return ExchangePlan(C, -(-tokens // C))


def exchange_buffer_bytes(
    config: Config, tokens_per_device: int, ep: int, exchange: str, per_node: int | None = None
) -> dict[str, int]:
    """The activation buffers one MoE layer's exchange holds per device, forward and backward,
    for ``tokens_per_device`` tokens on each of ``ep`` expert-parallel devices (what the planner
    and ahead-of-time tools budget): ``buffer_bytes`` as configured, ``worst_case_bytes`` for
    buffers that take any routing in one round. ``exchange`` is a resolved ``moe_ep_comm``;
    ``te`` sizes its own buffers (``te_exchange.recv_capacity``) and is not covered.
    ``hierarchical`` is counted as on a GPU (packed rows across nodes), with ``per_node`` of the
    ``ep`` devices in each node (default: ``devices_per_node``); ``rows_per_pair`` and ``rounds``
    are then the hop across nodes', ``inside_rows_per_pair`` and ``inside_rounds`` the hop inside."""
    T, K, D = tokens_per_device, config.num_experts_per_tok, config.emb_dim
    L = per_node or devices_per_node(config, ep)
    if exchange == "hierarchical" and L in (1, ep):  # one hop
        exchange = "ragged_all_to_all"
    hop_inside = {}  # the two hops: the figures of the hop inside a node
    if exchange == "hierarchical":
        across, inside = two_hop_sizes(config, T, ep, L)
        C1, C2, M = across.plan.rows_per_pair, inside.plan.rows_per_pair, ep // L
        packed, slots = T * across.destinations + 1, M * (C1 + 1)
        # Across nodes as the ragged exchange (packed out, slots in, and back); inside a node,
        # slots on both sides, sized for the rows received across.
        plan = across.plan
        hop_inside = {"inside_rows_per_pair": inside.plan.rows_per_pair, "inside_rounds": inside.plan.rounds}
        rows = 4 * packed + 4 * slots + 8 * L * (C2 + 1)
        # Slots of T across nodes, and slots inside a node for every row that can hold a token.
        worst_rows = 4 * packed + 4 * M * (T + 1) + 8 * L * (M * T + 1)
    elif exchange == "allgather":  # the group's tokens and partial outputs, and their gradients
        plan = ExchangePlan(T, 1)
        rows = worst_rows = 4 * ep * T
    elif exchange in ("all_to_all", "ragged_all_to_all"):
        # Tokens out and in, partial outputs out and back, and the gradient of each.
        plan = exchange_plan(T, K, ep, config.moe_ep_buffer_factor)
        slots, worst_slots = ep * (plan.rows_per_pair + 1), ep * (T + 1)
        if exchange == "ragged_all_to_all":  # sent from, and taken back into, the packed layout
            packed = T * min(K, ep) + 1
            rows, worst_rows = 4 * packed + 4 * slots, 4 * packed + 4 * worst_slots
        else:
            rows, worst_rows = 8 * slots, 8 * worst_slots
    else:
        raise ValueError(f"moe_ep_comm {exchange!r}: no exchange buffers of this module to report")
    row_bytes = D * jnp.dtype(config.dtype).itemsize
    return {
        "rows_per_pair": plan.rows_per_pair,
        "rounds": plan.rounds,
        **hop_inside,
        "buffer_rows": rows,
        "buffer_bytes": rows * row_bytes,
        "worst_case_bytes": worst_rows * row_bytes,
    }


def moe_working_bytes(
    config: Config, tokens_per_device: int, ep: int, exchange: str, per_node: int | None = None
) -> int:
    """One MoE layer's working set per device, held through its backward pass: the exchange's
    buffers (``exchange_buffer_bytes``) and the expert layout of a pass (``layout_capacity`` rows
    of D: the rows in and out and the gradient of each). What the planner budgets; XLA:GPU's
    compile of the GB200 recipe held 11.8 GB of such buffers at its peak, this counts 9.4 GB."""
    rows = layout_capacity(config, ep * tokens_per_device, ep)
    layout = 4 * rows * config.emb_dim * jnp.dtype(config.dtype).itemsize
    return exchange_buffer_bytes(config, tokens_per_device, ep, exchange, per_node)["buffer_bytes"] + layout


def layout_capacity(config: Config, group_tokens: int, ep: int) -> int:
    """The copies one device's expert layout holds per pass: ``moe_ep_buffer_factor`` x its
    balanced share of the group's copies (``group_tokens * K / ep``). More take further passes."""
    return max(1, math.ceil(config.moe_ep_buffer_factor * group_tokens * config.num_experts_per_tok / ep))


class Routes(NamedTuple):
    send_Td: jax.Array  # token t goes to device d (it chose at least one of d's experts)
    rank_Td: jax.Array  # its rank among the tokens going to d
    token_dN: jax.Array  # d's tokens in order, padded with zeros (or cut) to rounds * C
    sizes_d: jax.Array  # rows for each destination, all rounds together
    experts_per_device: int  # destination d holds experts [d * this, (d + 1) * this)


def _routes(experts_TK: jax.Array, experts_per_device: int, ep: int, plan: ExchangePlan) -> Routes:
    T = experts_TK.shape[0]
    send_Td = (experts_TK[:, :, None] // experts_per_device == jnp.arange(ep)).any(axis=1)
    rank_Td = jnp.cumsum(send_Td, axis=0, dtype=jnp.int32) - 1
    token_dT = jnp.argsort(~send_Td, axis=0, stable=True).T.astype(jnp.int32)  # tokens sent to d first
    # Every round's rows: rows past them carry no token (the two-hop exchange's second hop sizes
    # its rounds for the received rows that can hold one, not the slots' always-zero rows).
    N = plan.rounds * plan.rows_per_pair
    token_dN = token_dT[:, :N] if N <= T else jnp.pad(token_dT, ((0, 0), (0, N - T)))
    return Routes(send_Td, rank_Td, token_dN, send_Td.sum(axis=0, dtype=jnp.int32), experts_per_device)


def _round_slots(routes: Routes, r: jax.Array | int, C: int):
    """Round r's send layout: slot d (rows ``[d*S, (d+1)*S)``) holds ranks ``[r*C, (r+1)*C)`` of
    d's tokens, then zeros; row ``d*S + C`` stays empty (where (token, d) pairs of other rounds
    point). Returns (token_R, destination_R, valid_R, row_Td, copy_R, sizes_d)."""
    ep = routes.sizes_d.shape[0]
    S, d_ = C + 1, jnp.arange(ep)
    in_round_Td = routes.send_Td & (routes.rank_Td // C == r)
    row_Td = d_ * S + jnp.where(in_round_Td, routes.rank_Td - r * C, C)
    token_dC = jax.lax.dynamic_slice_in_dim(routes.token_dN, r * C, C, axis=1)
    token_R = jnp.concatenate([token_dC, jnp.zeros((ep, 1), token_dC.dtype)], axis=1).reshape(ep * S)
    sizes_d = jnp.clip(routes.sizes_d - r * C, 0, C)
    valid_R = (jnp.arange(S) < sizes_d[:, None]).reshape(ep * S)
    destination_R = jnp.repeat(d_, S)
    copy_R = jnp.where(valid_R, token_R * ep + destination_R, 0)  # the (token, device) pair of each row
    return token_R, destination_R, valid_R, row_Td, copy_R, sizes_d


def _packed_rows(routes: Routes, num_rows: int):
    """The packed send layout: d's rows ``[start_d[d], + sizes_d[d])`` in token order, the rows of
    all destinations back to back, then zero rows to ``num_rows`` (the last always zero, where
    unsent (token, device) pairs point). Returns (token_N, valid_N, row_Td, copy_N, start_d)."""
    ep = routes.sizes_d.shape[0]
    end_d = jnp.cumsum(routes.sizes_d)
    start_d = end_d - routes.sizes_d
    n_ = jnp.arange(num_rows)
    d_N = jnp.minimum(jnp.searchsorted(end_d, n_, side="right"), ep - 1)
    valid_N = n_ < end_d[-1]
    token_N = jnp.where(valid_N, routes.token_dN[d_N, jnp.clip(n_ - start_d[d_N], 0, routes.token_dN.shape[1] - 1)], 0)
    row_Td = jnp.where(routes.send_Td, start_d + routes.rank_Td, num_rows - 1)
    copy_N = jnp.where(valid_N, token_N * ep + d_N, 0)
    return token_N, valid_N, row_Td, copy_N, start_d


def _local_copies(local_RK: jax.Array, valid_R: jax.Array, weights_RK: jax.Array, experts_per_device: int):
    """Each row's copies on its destination, first J = min(K, E) of K slots: (local_RJ, active_RJ, weights_RJ)."""
    active_RK = valid_R[:, None] & (local_RK >= 0) & (local_RK < experts_per_device)
    J = min(local_RK.shape[1], experts_per_device)
    order_RJ = jnp.argsort(~active_RK, axis=1, stable=True)[:, :J]  # the active slots first
    local_RJ, active_RJ, weights_RJ = (
        jnp.take_along_axis(a, order_RJ, axis=1) for a in (local_RK, active_RK, weights_RK)
    )
    return jnp.where(active_RJ, local_RJ, 0), active_RJ, jnp.where(active_RJ, weights_RJ, 0)


def _exchange_round(
    r, routes, recv_total, packed, x_TD, experts_TK, weights_TK, wi_0, wi_1, wo, config, compute, hop, C, capacity
) -> Exchange:
    """One round on one device: send round r's rows to their experts' devices in ``hop``, compute
    them there (``compute``: the backend, or the two-hop exchange's second hop), send the partial
    outputs back; returns this round's part of every token's output [T, D]. ``packed``
    (ragged_all_to_all) is the packed send layout; else the slots move (``_move_slots``).

    A generator (``Exchange``): it yields the rows it received before computing them, and the
    partial outputs before sending them back, and goes on with what it is sent, so that
    ``_pipelined_chunks`` can order one chunk's computation after another's (``_run_through``
    sends each back unchanged)."""
    experts_per_device = routes.experts_per_device
    token_R, destination_R, valid_R, row_Td, copy_R, send_sizes = _round_slots(routes, r, C)
    recv_sizes = jnp.clip(recv_total - r * C, 0, C)

    # Outbound: the tokens (FP8 with a recipe), their experts as ids local to the destination,
    # their weights.
    fp8 = recipe_of(config)
    if packed is None:
        slots = (token_R, valid_R, row_Td, send_sizes, recv_sizes)
        move = partial(_to_slots, hop=hop)
        x_RD = move(x_TD, *slots) if fp8 is None else fp8_moved(move, fp8, x_TD, slots)
    else:  # round r's window of each destination's packed rows, into this device's slot there
        in_d = jnp.where(send_sizes > 0, packed.start_d + r * C, 0)
        slot_starts, here = _slot_starts(hop, C + 1, recv_sizes.dtype)  # the same slots both ways
        sizes = (in_d, send_sizes, here, recv_sizes)
        if fp8 is None:
            x_RD = packed_exchange(packed.rows_ND, *sizes, token_R.shape[0], hop)
        else:  # the packed gather moves FP8 too, so it is part of the movement
            move = partial(_packed_to_slots, rows=token_R.shape[0], hop=hop)
            x_RD = fp8_moved(move, fp8, x_TD, (packed.token_N, packed.valid_N, packed.row_Td, *sizes))
    local_RJ, active_RJ, weights_RJ = _local_copies(
        experts_TK[token_R] - destination_R[:, None] * experts_per_device,
        valid_R,
        weights_TK[token_R],
        experts_per_device,
    )
    local_RJ, active_RJ, weights_RJ = (hop.all_to_all(a) for a in (local_RJ, active_RJ, weights_RJ))

    # Compute the received copies on the local experts; one weighted partial output per row.
    x_RD = yield x_RD
    y_RD = compute(x_RD, local_RJ, active_RJ, weights_RJ, wi_0, wi_1, wo, config, capacity=capacity)
    y_RD = yield y_RD

    # Inbound: partial outputs back to their tokens, summed over the devices that computed them.
    if packed is None:  # each slot back to its sender, the sizes the other way round
        return sum_copies(_move_slots(y_RD, recv_sizes, send_sizes, hop), copy_R, valid_R, row_Td)
    yp_ND = packed_exchange(
        y_RD, slot_starts, recv_sizes, hop.all_to_all(in_d), send_sizes, packed.copy_N.shape[0], hop
    )
    return sum_copies(yp_ND, packed.copy_N, packed.valid_N, packed.row_Td)


def _to_slots(x_TD, token_R, valid_R, row_Td, send_sizes, recv_sizes, hop):
    """Tokens into their destinations' slots, and the slots to their devices (``_move_slots``)."""
    return _move_slots(gather_rows(x_TD, token_R, valid_R, row_Td), send_sizes, recv_sizes, hop)


def _move_slots(x_RD: jax.Array, send_sizes: jax.Array, recv_sizes: jax.Array, hop: Hop) -> jax.Array:
    """Slot d of ``x_RD`` to device d of ``hop``, into this device's slot there: whole slots
    (all_to_all), or with ``hop.slots_in_use`` only each slot's first ``send_sizes[d]`` rows, the
    ones in use (ragged_all_to_all into zeros, so the slots arrive as all_to_all delivers them)."""
    if not hop.slots_in_use:
        return hop.all_to_all(x_RD)
    starts, here = _slot_starts(hop, x_RD.shape[0] // hop.size, send_sizes.dtype)
    return packed_exchange(x_RD, starts, send_sizes, here, recv_sizes, x_RD.shape[0], hop)


def _slot_starts(hop: Hop, S: int, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """Where each device's slot of ``S`` rows starts in a slot layout, and where this device's
    starts (the same for every destination): ``(starts_d, here_d)``."""
    starts = jnp.arange(hop.size, dtype=dtype) * S
    return starts, jnp.full_like(starts, hop.index() * S)


def _packed_to_slots(x_TD, token_N, valid_N, row_Td, in_d, send_sizes, here, recv_sizes, rows, hop):
    """Tokens into the packed send layout, and its rows into their slots (ragged_all_to_all)."""
    return packed_exchange(gather_rows(x_TD, token_N, valid_N, row_Td), in_d, send_sizes, here, recv_sizes, rows, hop)


class Packed(NamedTuple):
    """The packed send layout of one device (``_packed_rows``): its rows (None where the rows
    travel in FP8 and are gathered by the movement itself) and where they came from."""

    rows_ND: jax.Array | None
    start_d: jax.Array
    copy_N: jax.Array
    valid_N: jax.Array
    row_Td: jax.Array
    token_N: jax.Array


class HopSizes(NamedTuple):
    """How one hop's buffers are sized."""

    plan: ExchangePlan  # C rows per (sender, receiver) pair and round; the rounds the worst routing needs
    destinations: int  # the most devices of the hop one row reaches (the packed layout's rows per row)
    experts_per_device: int  # the experts behind one destination (a node's, on the hop across nodes)
    capacity: int  # the copies the experts' layout holds per pass (``layout_capacity``)


def _slot_experts(
    x_TD, experts_TK, weights_TK, wi_0, wi_1, wo, config, compute, hop: Hop, sizes: HopSizes, ragged
) -> Exchange:
    """Per device: the first round always; the rest only if some pair of the group overflows ``C``.
    A generator that pauses in the first round as ``_exchange_round`` does. ``ragged``: the rows
    in use are sent from the packed layout (``hop.slots_in_use``: from the slots)."""
    T, plan = experts_TK.shape[0], sizes.plan
    routes = _routes(experts_TK, sizes.experts_per_device, hop.size, plan)
    recv_total = hop.all_to_all(routes.sizes_d)
    packed = None
    if ragged:  # every row to send, packed once: T * destinations rows and a zero row
        token_N, valid_N, row_Td, copy_N, start_d = _packed_rows(routes, T * sizes.destinations + 1)
        rows_ND = gather_rows(x_TD, token_N, valid_N, row_Td) if recipe_of(config) is None else None
        packed = Packed(rows_ND, start_d, copy_N, valid_N, row_Td, token_N)
    args = (x_TD, experts_TK, weights_TK, wi_0, wi_1, wo, config, compute, hop, plan.rows_per_pair, sizes.capacity)
    # The fullest pair decides the rounds, the same on every device of the expert axis (C = T:
    # one round holds any routing, and no predicate is needed).
    fullest = jax.lax.pmax(routes.sizes_d.max(), hop.axis) if plan.rounds > 1 else 0
    first = yield from _exchange_round(0, routes, recv_total, packed, *args)

    def further(r):  # the overflow rounds run straight through: only the first one pauses
        return _run_through(_exchange_round(r, routes, recv_total, packed, *args))

    return in_rounds(further, fullest, plan.rows_per_pair, plan.rounds, first=first)


def _flat_experts(x_TD, experts_TK, weights_TK, wi_0, wi_1, wo, config, local_experts, axis, ragged) -> Exchange:
    """One hop: every device of the expert axis sends straight to every other (a generator:
    ``_slot_experts``)."""
    T, K = experts_TK.shape
    hop = whole_axis(axis)
    plan = exchange_plan(T, K, hop.size, config.moe_ep_buffer_factor)
    sizes = HopSizes(plan, min(K, hop.size), wi_0.shape[0], layout_capacity(config, hop.size * T, hop.size))
    return _slot_experts(x_TD, experts_TK, weights_TK, wi_0, wi_1, wo, config, local_experts, hop, sizes, ragged)


def devices_per_node(config: Config, ep: int, axis: str = "expert") -> int:
    """The devices of the expert axis inside one fast domain (an 8-GPU node, an NVL72 rack): its
    ``ici`` part (``ep`` over its ``dcn`` part where the ``ici`` part is the one filled in). The
    mesh puts the ``dcn`` part outermost, so node m holds the axis's devices ``[m * L, (m + 1) * L)``."""
    index = MESH_AXES.index(axis)
    ici, dcn = config.ici_parallelism()[index], config.dcn_parallelism()[index]
    if ici > 0:
        return min(ici, ep)
    return ep // dcn if dcn > 0 else ep


def node_hops(axis: str, ep: int, per_node: int) -> tuple[Hop, Hop]:
    """The two-hop exchange's groups: (across nodes: the devices with the same place in every
    node, one per node; inside a node: its devices)."""
    L, M = per_node, ep // per_node
    grid = np.arange(ep).reshape(M, L)  # node m's p-th device is device m * L + p of the axis
    across = Hop(axis, M, stride=L, groups=tuple(map(tuple, grid.T.tolist())))
    inside = Hop(axis, L, stride=1, groups=tuple(map(tuple, grid.tolist())))
    return across, inside


def nodes_per_token(config: Config, nodes: int, experts_per_node: int) -> int:
    """The most nodes one token's experts live on: ``min(K, nodes)``, and no more than
    ``topk_routing_group`` where every routing group lies inside one node (node-limited routing:
    DeepSeek-V3's 256 experts in 8 groups over 8 nodes reach at most 4 of them). The bound is the
    router's (``router.route`` masks all but a token's best groups, bias or not): the exchange's
    packed layout holds that many rows per token and no more, so experts chosen any other way
    must keep to it."""
    bound = min(config.num_experts_per_tok, nodes)
    group_size = config.num_experts // config.n_routing_groups
    if config.n_routing_groups > 1 and experts_per_node % group_size == 0:
        bound = min(bound, config.topk_routing_group)
    return bound


def two_hop_sizes(config: Config, tokens: int, ep: int, per_node: int) -> tuple[HopSizes, HopSizes]:
    """The buffers of the hop across nodes and of the hop inside one, for ``tokens`` per device.

    Across: a token travels once to each node holding one of its experts (``nodes_per_token``),
    in pairs of ``C1`` = factor x the balanced share, as the one-hop exchange sizes its pairs.
    Inside: the rows a device received (``M`` slots of ``C1`` rows and a zero row) go on to the
    node's devices holding their experts. Balanced, a device computes ``T * K`` copies, so a pair
    carries at most ``T * K / L`` rows (a row holds one or more copies): ``C2`` is factor x that,
    capped at the ``M * C1`` rows that can hold a token, and further rounds take what a skewed
    routing sends beyond it."""
    T, K, factor = tokens, config.num_experts_per_tok, config.moe_ep_buffer_factor
    L, M = per_node, ep // per_node
    experts_per_device = config.num_experts // ep
    capacity = layout_capacity(config, ep * T, ep)
    destinations = nodes_per_token(config, M, L * experts_per_device)
    across = HopSizes(exchange_plan(T, destinations, M, factor), destinations, L * experts_per_device, capacity)
    received = M * across.plan.rows_per_pair
    C2 = max(1, min(received, math.ceil(factor * T * K / L)))
    J = min(K, L * experts_per_device)  # a row's copies on one node
    # (the hop inside moves slots: its bound on destinations sizes no packed layout)
    inside = HopSizes(ExchangePlan(C2, -(-received // C2)), min(J, L), experts_per_device, capacity)
    return across, inside


def _two_hop_experts(x_TD, experts_TK, weights_TK, wi_0, wi_1, wo, config, local_experts, axis, ragged) -> Exchange:
    """Two hops, as DeepSeek-V3 trained: a token crosses the network once per node that holds
    one of its experts (to the device with the sender's place in that node), and that device
    forwards it to the node's devices holding them. The partial outputs come back the same way,
    summed per node before they cross the network. Each hop is the one-hop exchange over its
    group of devices (the hop inside nodes runs as the hop across nodes' computation), with its
    own slots and overflow rounds: dropless whatever the routing. ``ragged`` moves only the rows
    in use (``ragged_all_to_all``): across nodes from the packed layout, inside a node from the
    slots, whose rows in use come first (a packed layout there would have to hold every received
    row once per device of the node). Whole slots inside a node moved twice the rows in use at
    DeepSeek-V3's routing (XLA:GPU's compile of the 256-H100 recipe).
    With FP8 dispatch the hop inside re-quantizes the rows the hop across delivered dequantized:
    the same values (a quantize-dequantize round trip is idempotent), one more quantize per round.
    The experts must be the router's (``nodes_per_token``)."""
    ep = jax.sharding.get_abstract_mesh().shape[axis]
    per_node = devices_per_node(config, ep, axis)
    if per_node in (1, ep):  # one node, or one device per node: a single hop is the same thing
        return _flat_experts(x_TD, experts_TK, weights_TK, wi_0, wi_1, wo, config, local_experts, axis, ragged)
    across, inside = node_hops(axis, ep, per_node)
    inside = inside._replace(slots_in_use=ragged)  # no packed layout inside a node (above)
    across_sizes, inside_sizes = two_hop_sizes(config, x_TD.shape[0], ep, per_node)
    experts_per_node = across_sizes.experts_per_device

    def inside_node(x_RD, local_RJ, active_RJ, weights_RJ, wi_0, wi_1, wo, config, capacity):
        del capacity  # the sizes carry it
        experts_RJ = jnp.where(active_RJ, local_RJ, experts_per_node)  # inactive: no device of the node
        args = (x_RD, experts_RJ, weights_RJ, wi_0, wi_1, wo, config, local_experts, inside, inside_sizes)
        return _run_through(_slot_experts(*args, ragged=False))

    args = (x_TD, experts_TK, weights_TK, wi_0, wi_1, wo, config, inside_node, across, across_sizes)
    return _slot_experts(*args, ragged=ragged)


def _allgather_experts(x_TD, experts_TK, weights_TK, wi_0, wi_1, wo, config, local_experts, axis):
    gather = partial(jax.lax.all_gather, axis_name=axis, tiled=True)
    fp8 = recipe_of(config)
    x_TD = gather(x_TD) if fp8 is None else fp8_moved(gather, fp8, x_TD, ())
    experts_TK, weights_TK = gather(experts_TK), gather(weights_TK)
    y_TD = _own_experts(x_TD, experts_TK, weights_TK, wi_0, wi_1, wo, config, local_experts, axis)
    return jax.lax.psum_scatter(y_TD, axis, tiled=True)


def _own_experts(x_TD, experts_TK, weights_TK, wi_0, wi_1, wo, config, local_experts, axis):
    """The part of every token's output that this device's experts compute."""
    E_local = wi_0.shape[0]
    local_TK = experts_TK - jax.lax.axis_index(axis) * E_local
    active_TK = (local_TK >= 0) & (local_TK < E_local)
    capacity = layout_capacity(config, x_TD.shape[0], jax.sharding.get_abstract_mesh().shape[axis])
    local_TK = jnp.where(active_TK, local_TK, 0)
    return local_experts(x_TD, local_TK, active_TK, weights_TK, wi_0, wi_1, wo, config, capacity=capacity)


def _finish(steps: Exchange, y_RD: jax.Array) -> jax.Array:
    """An exchange paused at its partial outputs, sent ``y_RD`` in their place and run to its end:
    its output."""
    try:
        steps.send(y_RD)
    except StopIteration as done:
        return done.value
    raise RuntimeError("an exchange paused more than twice")


def _run_through(steps: Exchange) -> jax.Array:
    """An exchange's generator (``_exchange_round``, ``_slot_experts``) run through, what it
    yields sent back unchanged: its output."""
    return _finish(steps, steps.send(next(steps)))


def _pipelined_chunks(chunks: list[Exchange]) -> list[jax.Array]:
    """The chunks' exchanges, each chunk's experts waiting for the previous chunk's to finish,
    through an ``optimization_barrier`` that also holds the previous chunk's partial outputs until
    this chunk's rows have arrived. Chunk c's dispatch then depends on nothing of chunk c - 1 and
    can run under its experts, and chunk c - 1's combine under chunk c's experts. (Independent,
    the chunks' layout gathers were fused into one kernel in XLA:GPU's compile of the GB200
    recipe, which waited for every chunk's dispatch.) The barrier's transpose chains the backward
    pass the other way round; under remat the recomputed forward is chained too. Only the first
    round of each chunk is chained (the overflow rounds run straight through), and in the two-hop
    exchange the chained computation is the whole hop inside a node. The barrier is an identity:
    the outputs are those of the chunks run one by one."""
    received = [next(steps) for steps in chunks]  # every chunk's dispatch
    computed = []
    for c, steps in enumerate(chunks):
        if c:  # chunk c computes after chunk c - 1, whose outputs go back once c's rows are in
            received[c], computed[c - 1] = jax.lax.optimization_barrier((received[c], computed[c - 1]))
        computed.append(steps.send(received[c]))
    return [_finish(steps, y_RD) for steps, y_RD in zip(chunks, computed, strict=True)]


def _chunked(
    exchange_fn: Callable[..., Exchange], chunks: int, pipelined: bool, x_TD, experts_TK, weights_TK, *rest, **kw
):
    """``exchange_fn`` on ``chunks`` slices of a device's tokens, outputs concatenated. Each chunk
    sizes its buffers for its own tokens (and agrees on its own rounds), so the buffers shrink by
    ``chunks``. ``pipelined`` chains the chunks' first rounds (``_pipelined_chunks``), so that one
    chunk's dispatch and another's combine can run while a third's experts compute: the overlap
    DeepSeek's DualPipe and Megatron's overlapped all-to-all get by hand."""
    T = x_TD.shape[0]
    if chunks == 1:
        return _run_through(exchange_fn(x_TD, experts_TK, weights_TK, *rest, **kw))
    if T % chunks:
        raise ValueError(f"moe_exchange_chunks={chunks} does not divide the {T} tokens each device exchanges")
    size = T // chunks
    steps = [
        exchange_fn(*(a[c * size : (c + 1) * size] for a in (x_TD, experts_TK, weights_TK)), *rest, **kw)
        for c in range(chunks)
    ]
    return jnp.concatenate(_pipelined_chunks(steps) if pipelined else [_run_through(s) for s in steps])


def exchange_token_axes(num_tokens: int, axis: str) -> tuple[str, ...]:
    """The mesh axes tokens are split over inside the exchange: the rules' ``activation_batch``
    axes, then every other axis (but ``axis``) that leaves them replicated, such as ``tensor``,
    so that no two devices send or compute the same copies (the rules' axes alone where
    ``num_tokens`` does not divide). Axes already manual (a pipeline's ``stage``, inside its
    shard_map) are not the exchange's to split."""
    mesh = jax.sharding.get_abstract_mesh()
    rule_axes = batch_mesh_axes()
    manual = set(mesh.manual_axes)
    extra = tuple(
        a for a in mesh.axis_names if a not in rule_axes and a != axis and a not in manual and mesh.shape[a] > 1
    )
    split = math.prod(mesh.shape[a] for a in rule_axes + extra)
    return rule_axes + extra if num_tokens % split == 0 else rule_axes


def expert_parallel_experts(
    x_TD: jax.Array,
    experts_TK: jax.Array,
    weights_TK: jax.Array,
    wi_0: jax.Array,
    wi_1: jax.Array,
    wo: jax.Array,
    config: Config,
    local_experts: Callable[..., jax.Array],
    axis: str,
    exchange: str,
) -> jax.Array:
    """``routed_experts`` with experts split over ``axis``; ``local_experts`` is the backend."""
    token_axes = exchange_token_axes(x_TD.shape[0], axis)
    token_spec = P(token_axes or None, None)
    tokens_split_over_axis = axis in token_axes
    # Only the rows in use move where the platform has ragged_all_to_all (XLA:CPU has not).
    ragged = exchange == "ragged_all_to_all" or (exchange == "hierarchical" and trace_platform() != "cpu")
    wi_spec, wo_spec = stored_spec(wi_0.shape, WI_AXES), stored_spec(wo.shape, WO_AXES)

    def per_device(x_TD, experts_TK, weights_TK, wi_0, wi_1, wo):
        with jax.named_scope(WEIGHTS_SCOPE):  # the local experts whole: their FSDP gather, here
            wi_0, wi_1 = (gather_weight(w, wi_spec, axis) for w in (wi_0, wi_1))
            wo = gather_weight(wo, wo_spec, axis)
        args = (x_TD, experts_TK, weights_TK, wi_0, wi_1, wo, config, local_experts, axis)
        if not tokens_split_over_axis:  # every device of the group holds the same tokens
            args = (dispatch_quantized(x_TD, config), *args[1:])  # as if they had travelled
            return jax.lax.psum(_own_experts(*args), axis)
        if exchange == "allgather":
            return _allgather_experts(*args)
        exchange_fn = _two_hop_experts if exchange == "hierarchical" else _flat_experts
        chunks, pipelined = config.moe_exchange_chunks, config.moe_exchange_pipeline
        return _chunked(exchange_fn, chunks, pipelined, *args, ragged=ragged)

    return jax.shard_map(
        per_device,
        in_specs=(token_spec, token_spec, token_spec, wi_spec, wi_spec, wo_spec),
        out_specs=token_spec,
        check_vma=False,
    )(x_TD, experts_TK, weights_TK, wi_0, wi_1, wo)


def gather_weight(w: jax.Array, spec: P, axis: str) -> jax.Array:
    """A device's experts whole, from its stored shard: gathered over every mesh axis of ``spec``
    but the expert ``axis``, inside the exchange's shard_map, so that the gradients leave it
    reduce-scattered over those axes (the gather's transpose) and only then summed over the other
    token axes. Gathered before it, XLA summed the whole gradients over every token axis in one
    all-reduce (1.5x the network bytes with data 2 x fsdp 2 across racks). The rules store the
    experts split over ``[expert, fsdp]`` along their expert dim, so the FSDP gather runs along the
    weights' leading dim: split along the embed dim, XLA gave the whole stacks of weights and
    float32 gradients the embed-major layout a gather or scatter along it needs, and transposed
    them back and forth outside the layers' loop (two more copies of every routed expert, 41 GB
    on the GB200 recipe's XLA:GPU compile)."""
    for dim, axes in enumerate(map(spec_axes, spec)):
        others = tuple(a for a in axes if a != axis)
        if others:
            w = jax.lax.all_gather(w, others, axis=dim, tiled=True)
    return w
