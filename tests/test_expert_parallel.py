"""Expert parallelism on 8 simulated devices (fsdp 2 x expert 4) equals one device, dropless.

Every routed copy must be computed wherever its expert lives, including when every token of the
global batch picks the same expert (all of its copies land on one device), for every backend and
every exchange that runs on CPU. ``ragged_all_to_all`` is not implemented by XLA:CPU, so its test
runs the exchange's own code against an emulation of the collective built from ``all_gather``
(``emulated_ragged_all_to_all``, written from the collective's documented semantics).

``all_to_all`` runs with the default buffers (one round holds any routing here) and with buffers
a quarter of the balanced share (a pair's slot holds 2 of the 8 rows all-to-one routing sends it:
4 rounds); ``ragged_all_to_all`` with half of it (4 of the 8: 2 rounds), so that only the overflow
rounds make them dropless; and ``all_to_all`` on expert 2 x tensor 2 x fsdp 2, where the tokens are
split over tensor inside the exchange. ``ragged_all_to_all`` also runs with each device's tokens in
two chunks (``moe_exchange_chunks``), each chunk exchanged, computed and given its overflow rounds
on its own, the second chunk's experts chained after the first's (``moe_exchange_pipeline``).

The overflow rounds run unrolled here (``dispatch.UNROLL_ROUNDS``): the same rounds, conditions
and rematerialisation, each round its own collectives. In a loop, XLA:CPU's in-process collectives
race when the simulated devices fall out of step (two busy cores): a device enters the next
iteration's rendezvous before another has left the last one, and the process aborts ("Unexpected
number of participants"; one run in four of these cases alone on an idle machine, most runs under
load, and a crashed test worker in CI). Unrolled, each round's conditionals cost XLA:CPU compile
time in proportion to the whole program (its thunk emitter walks every computation once per
conditional): the blocked backend's ``ragged_all_to_all`` in two chunks compiled in 100 s with 4
rounds, in 25 s with 2, so 4 rounds run in the cheapest case only (``ragged_dot``, ``all_to_all``).
The two-hop exchange keeps to 2 rounds on each hop: with 4 rounds across nodes, each carrying
the hop inside a node and its own rounds, one full run of the suite lost its worker to an abort of
XLA:CPU's runtime (not reproduced in ten runs of the case alone, four of them beside two busy
loops)."""

import functools
from functools import partial

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from MaxText.config import ConfigError
from MaxText.moe import dispatch
from MaxText.moe import expert_parallel as exchange_module
from MaxText.moe.block import MoEBlock
from MaxText.moe.expert_parallel import (
    ExchangePlan,
    HopSizes,
    exchange_buffer_bytes,
    exchange_plan,
    exchange_token_axes,
    two_hop_sizes,
)
from MaxText.moe.experts import check_backend
from MaxText.moe.te_exchange import rank_tokens
from MaxText.parallel.mesh import make_mesh
from MaxText.parallel.sharding import axis_rules
from tests.conftest import make_config, scan_bodies
from tests.test_moe_block import random_params

B, S = 4, 16
MESH = ("ici_fsdp_parallelism=2", "ici_expert_parallelism=4")


def block_and_grads(config, params, bias, x):
    def loss(p, x_):
        variables = {"params": p, "moe_bias": {"router": bias}}
        y, state = MoEBlock(config).apply(variables, x_, mutable=["moe_load", "moe_loss"])
        return jnp.sum(y * jnp.cos(x_)), (y, state["moe_load"]["router"])

    return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)


def routing_bias(kind: str, num_experts: int) -> np.ndarray:
    if kind == "all_to_one":
        return np.eye(num_experts)[0] * 10.0  # every token's top-1 is expert 0
    if kind == "zipf":
        return 0.8 / (np.arange(num_experts) + 1.0) ** 1.2
    return np.random.default_rng(3).standard_normal(num_experts) * 0.05


def emulated_ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name, axis_index_groups=None
):
    """On device ``me``: from every source s of its group, rows ``[input_offsets_s[i], +
    send_sizes_s[i])`` of s's operand land at ``output_offsets_s[i]`` of ``me``'s output, ``i``
    being ``me``'s place in the group; ``me`` expects ``recv_sizes[j]`` of them from the group's
    j-th device; where the two sizes disagree (which NCCL would not survive either) the whole
    output is spoiled (NaN, or the largest integer), so inconsistent sizes fail the test."""
    me = jax.lax.axis_index(axis_name)
    n = jax.lax.axis_size(axis_name)
    groups = np.asarray(axis_index_groups if axis_index_groups is not None else [list(range(n))])
    group_of, place_of = np.zeros(n, np.int32), np.zeros(n, np.int32)
    for g, members in enumerate(groups):
        group_of[members], place_of[members] = g, np.arange(len(members))
    members = jnp.asarray(groups)[jnp.asarray(group_of)[me]]  # my group's devices, in order
    place = jnp.asarray(place_of)[me]
    operands = jax.lax.all_gather(operand, axis_name)  # [n, N, ...]
    starts, sizes, targets = (
        jax.lax.all_gather(a, axis_name)[:, place] for a in (input_offsets, send_sizes, output_offsets)
    )
    rows = jnp.arange(output.shape[0])
    for j in range(groups.shape[1]):
        s = members[j]
        k = rows - targets[s]
        arrives = (k >= 0) & (k < jnp.minimum(sizes[s], recv_sizes[j]))
        source_rows = operands[s][jnp.clip(starts[s] + k, 0, operand.shape[0] - 1)]
        output = jnp.where(arrives.reshape(-1, *([1] * (output.ndim - 1))), source_rows, output)
        spoiled = jnp.nan if jnp.issubdtype(output.dtype, jnp.floating) else jnp.iinfo(output.dtype).max
        output = jnp.where(sizes[s] != recv_sizes[j], jnp.asarray(spoiled, output.dtype), output)
    return output


def backend_config(backend: str, *overrides: str):
    return make_config(f"moe_matmul={backend}", "moe_block_rows=8", "moe_min_block_rows=2", *overrides)


@functools.cache
def one_device(backend: str):
    """(params, one-device step), compiled once per backend: without a mesh the exchange keys
    and the mesh shape play no part."""
    config = backend_config(backend)
    return random_params(config), jax.jit(partial(block_and_grads, config))


@functools.cache
def compiled(backend: str, exchange: str, *overrides: str):
    """(config, params, one-device step, expert-parallel step), compiled once per case."""
    keys = [o for o in overrides if o != AS_ON_GPU]
    config = backend_config(backend, f"moe_ep_comm={exchange}", *(keys or MESH))
    fn = partial(block_and_grads, config)
    mesh = make_mesh(config, jax.devices())
    params, reference = one_device(backend)
    jitted = jax.jit(fn)
    checked = False

    def expert_parallel(*args):
        nonlocal checked
        with jax.set_mesh(mesh), nn.logical_axis_rules(axis_rules(config)):
            if not checked:  # one program for every routing: its trace checked once, and reused by the call
                jaxpr = str(jitted.trace(*args).jaxpr)
                assert "shard_map" in jaxpr  # the expert-parallel path is taken
                # The group agrees on its fullest pair (a pmax) only where C < T makes overflow rounds possible.
                overflows = config.moe_ep_buffer_factor < 1
                if exchange == "hierarchical":  # either hop (8 tokens per device)
                    M, L = config.dcn_expert_parallelism, config.ici_expert_parallelism
                    overflows = any(h.plan.rounds > 1 for h in two_hop_sizes(config, 8, M * L, L))
                assert ("pmax" in jaxpr) == overflows
                # Chunks are pipelined: each chunk's experts wait for the previous chunk's (one
                # barrier per pair of chunks), and the barrier's transpose chains the backward.
                chained = config.moe_exchange_chunks - 1 if config.moe_exchange_pipeline else 0
                assert jaxpr.count("optimization_barrier") == 2 * chained
                if exchange == "hierarchical":  # across nodes (one device of each), then inside each
                    M, L = config.dcn_expert_parallelism, config.ici_expert_parallelism
                    across = tuple(tuple(range(p, M * L, L)) for p in range(L))
                    inside = tuple(tuple(range(m * L, (m + 1) * L)) for m in range(M))
                    assert f"axis_index_groups={across}" in jaxpr and f"axis_index_groups={inside}" in jaxpr
                checked = True
            return jitted(*args)

    return config, params, reference, expert_parallel


# A pair's slot holds C = ceil(factor * T * min(K, ep) / ep) rows: T = 64 tokens / 8 devices,
# K = 4, ep = 4 gives a balanced share of 8 rows, so factor 0.5 makes C = 4 and 2 rounds, and
# factor 0.25 C = 2 and 4 rounds.
SMALL_BUFFERS = (*MESH, "moe_ep_buffer_factor=0.5")
SMALLER_BUFFERS = (*MESH, "moe_ep_buffer_factor=0.25")
TENSOR_MESH = ("ici_fsdp_parallelism=2", "ici_expert_parallelism=2", "ici_tensor_parallelism=2")
NODE_MESH = ("ici_fsdp_parallelism=2", "dcn_expert_parallelism=2", "ici_expert_parallelism=2")
NODES_OF_4 = ("ici_fsdp_parallelism=1", "dcn_expert_parallelism=2", "ici_expert_parallelism=4")
FOUR_NODES_OF_2 = ("ici_fsdp_parallelism=1", "dcn_expert_parallelism=4", "ici_expert_parallelism=2")
# Not a config key: the case traces the two-hop exchange as for a GPU, where only the rows in use
# move (ragged_all_to_all, emulated here): packed rows across nodes, slots' first rows inside.
AS_ON_GPU = "as-on-gpu"
CASES = [
    ("blocked", "allgather"),
    ("ragged_dot", "allgather"),
    ("blocked", "all_to_all"),  # the default factor: C = T, any routing in one round
    ("ragged_dot", "all_to_all", *SMALLER_BUFFERS),
    ("blocked", "ragged_all_to_all", *SMALL_BUFFERS),
    ("tokamax", "ragged_all_to_all", *SMALL_BUFFERS),  # tokamax's XLA reference kernels here
    ("blocked", "all_to_all", *TENSOR_MESH, "moe_ep_buffer_factor=0.5"),  # C = 4 of 8: overflows too
    # Two chunks of 4 tokens per device, each exchanged on its own (and the second's experts
    # chained after the first's): C = 2, 2 rounds per chunk.
    ("ragged_dot", "ragged_all_to_all", *SMALL_BUFFERS, "moe_exchange_chunks=2", "moe_exchange_pipeline=true"),
    # Two hops: over 2 nodes of 2 devices (and fsdp 2), one round each with the default buffers,
    # whole slots moving; over 2 nodes of 4, factor 1/2 gives 2 rounds across nodes and 2 inside
    # them, the rows moving as a GPU moves them; over 4 nodes of 2, where node-limited routing
    # bounds a token to 2 of the 4 nodes (a node's 4 experts are one of the 4 groups, a token
    # takes 2 groups), the packed layout holds 2 rows per token, in 2 rounds at factor 1.
    ("blocked", "hierarchical", *NODE_MESH),
    ("ragged_dot", "hierarchical", *NODES_OF_4, "moe_ep_buffer_factor=0.5", AS_ON_GPU),
    ("ragged_dot", "hierarchical", *FOUR_NODES_OF_2, "moe_ep_buffer_factor=1.0", AS_ON_GPU),
]
SUFFIXES = (
    (AS_ON_GPU, "-as_on_gpu"),
    (TENSOR_MESH[-1], "-tensor"),
    (SMALL_BUFFERS[-1], "-small_buffers"),
    (SMALLER_BUFFERS[-1], "-smaller_buffers"),
)
IDS = [
    "-".join(c[:2])
    + "".join(suffix for key, suffix in SUFFIXES if key in c)
    + ("-chunks" if "moe_exchange_chunks=2" in c else "")
    + ("-pipelined" if "moe_exchange_pipeline=true" in c else "")
    for c in CASES
]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("kind", ["balanced", "zipf", "all_to_one"])
def test_expert_parallel_matches_one_device(kind, case, monkeypatch):
    backend, exchange, *overrides = case
    monkeypatch.setattr(dispatch, "UNROLL_ROUNDS", True)
    if exchange == "ragged_all_to_all" or AS_ON_GPU in overrides:
        monkeypatch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)
    if AS_ON_GPU in overrides:
        monkeypatch.setattr(exchange_module, "trace_platform", lambda: "gpu")
    config, params, one_device, expert_parallel = compiled(backend, exchange, *overrides)
    x = jnp.asarray(np.random.default_rng(7).standard_normal((B, S, config.emb_dim)), jnp.float32)
    bias = jnp.asarray(routing_bias(kind, config.num_experts), jnp.float32)

    (_, (y_one, load_one)), grads_one = one_device(params, bias, x)
    (_, (y_ep, load_ep)), grads_ep = expert_parallel(params, bias, x)

    if kind == "all_to_one":
        assert int(load_one[0]) == B * S  # every token of the global batch chose expert 0
    np.testing.assert_array_equal(np.asarray(load_ep), np.asarray(load_one))
    np.testing.assert_allclose(np.asarray(y_ep), np.asarray(y_one), rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(grads_ep), jax.tree.leaves(grads_one), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("exchange", ["ragged_all_to_all", "te"])
def test_gpu_only_exchanges_are_refused_on_cpu_with_a_reason(exchange):
    config = make_config(f"moe_ep_comm={exchange}", *MESH)
    with pytest.raises(ConfigError, match=f"'moe_ep_comm': '?{exchange}'? .*(GPU|Transformer Engine)"):
        check_backend(config, "cpu")


def test_small_buffers_overflow_by_hand():
    """The premise of the small-buffer cases: 8 tokens per device, top-4 over 4 devices, factor 1/2
    gives pairs of C = 4 rows and 2 rounds, factor 1/4 C = 2 and 4 rounds, while all-to-one routing
    sends 8 rows over one pair (so only the overflow rounds can make the exchange dropless); in two
    chunks of 4 tokens, factor 1/2 gives C = 2, 2 rounds per chunk; on expert 2 x tensor 2 x fsdp 2
    a device holds 64 / 8 tokens, top-4 over 2 devices, factor 1/2: C = 4, 2 rounds."""
    assert exchange_plan(tokens=8, top_k=4, ep=4, factor=0.5) == (4, 2)
    assert exchange_plan(tokens=8, top_k=4, ep=4, factor=0.25) == (2, 4)
    assert exchange_plan(tokens=4, top_k=4, ep=4, factor=0.5) == (2, 2)
    assert exchange_plan(tokens=8, top_k=4, ep=2, factor=0.5) == (4, 2)
    assert exchange_plan(tokens=8, top_k=4, ep=4, factor=2.0) == (8, 1)  # the default: one round


def test_exchange_buffer_bytes_by_hand():
    """DeepSeek-V3 671B on ep 64 with 4,096 tokens per device, top-8, D 7,168, bf16."""
    config = make_config("dtype=bfloat16", model="deepseek3-671b")
    T, ep, D, bf16 = 4096, 64, 7168, 2
    # Balanced share T * min(K, ep) / ep = 512 rows per pair; factor 2: C = 1,024; 4 rounds hold T.
    # Slots: ep of C + 1 rows. Packed send layout: T * min(K, ep) rows and a zero row.
    slots, worst_slots, packed = 64 * 1025, 64 * 4097, 4096 * 8 + 1
    # Tokens out and in, outputs out and back, and the gradient of each: 8 buffers.
    assert exchange_buffer_bytes(config, T, ep, "ragged_all_to_all") == {
        "rows_per_pair": 1024,
        "rounds": 4,
        "buffer_rows": 4 * packed + 4 * slots,
        "buffer_bytes": (4 * packed + 4 * slots) * D * bf16,  # 5.64 GB
        "worst_case_bytes": (4 * packed + 4 * worst_slots) * D * bf16,  # 16.92 GB: slots of T
    }
    all_to_all = exchange_buffer_bytes(config, T, ep, "all_to_all")  # slots on the send side too
    assert (all_to_all["buffer_bytes"], all_to_all["worst_case_bytes"]) == (
        8 * slots * D * bf16,  # 7.52 GB
        8 * worst_slots * D * bf16,  # 30.07 GB: what slots of T on both sides cost
    )
    worst = make_config("dtype=bfloat16", "moe_ep_buffer_factor=8", model="deepseek3-671b")  # 8 = ep / min(K, ep)
    one_round = exchange_buffer_bytes(worst, T, ep, "all_to_all")
    assert (one_round["rows_per_pair"], one_round["rounds"]) == (T, 1)
    assert one_round["buffer_bytes"] == one_round["worst_case_bytes"]
    gathered = exchange_buffer_bytes(config, T, ep, "allgather")  # the group's tokens and outputs, and gradients
    assert gathered["buffer_bytes"] == gathered["worst_case_bytes"] == 4 * 64 * 4096 * D * bf16
    with pytest.raises(ValueError, match="te"):
        exchange_buffer_bytes(config, T, ep, "te")


def test_two_hop_sizes_by_hand():
    """DeepSeek-V3 671B on ep 64 as 8 nodes of 8 GPUs, 4,096 tokens per device, factor 2. A node's
    32 experts are one routing group and a token takes its 8 experts from 4 of the 8 groups, so it
    reaches at most 4 nodes: the hop across nodes packs 4 rows per token, and its pairs carry
    C1 = 2 x 4,096 x 4 / 8 = 4,096 = T rows (one round). Inside a node a device computes 4,096 x 8
    copies when balanced, so a pair carries C2 = 2 x 32,768 / 8 = 8,192 rows a round: 4 rounds
    for the 8 x 4,096 received rows that can hold a token."""
    config = make_config("dtype=bfloat16", model="deepseek3-671b")
    across, inside = two_hop_sizes(config, 4096, 64, 8)
    assert across == HopSizes(ExchangePlan(4096, 1), destinations=4, experts_per_device=32, capacity=65536)
    assert inside == HopSizes(ExchangePlan(8192, 4), destinations=8, experts_per_device=4, capacity=65536)
    # Groups that straddle nodes (4 groups of 64 experts, 2 nodes each) bound nothing: min(K, nodes).
    straddling = make_config("dtype=bfloat16", "n_routing_groups=4", "topk_routing_group=1", model="deepseek3-671b")
    assert two_hop_sizes(straddling, 4096, 64, 8)[0].destinations == 8
    # Packed rows out and slots in across nodes (and back, and the gradients); slots inside.
    D, bf16 = 7168, 2
    rows = 4 * (4096 * 4 + 1) + 4 * 8 * 4097 + 8 * 8 * 8193
    assert exchange_buffer_bytes(config, 4096, 64, "hierarchical", 8)["buffer_bytes"] == rows * D * bf16  # 10.34 GB
    # One node, or one device per node: the one-hop ragged exchange.
    for per_node in (1, 64):
        assert exchange_buffer_bytes(config, 4096, 64, "hierarchical", per_node) == exchange_buffer_bytes(
            config, 4096, 64, "ragged_all_to_all"
        )
    # The CPU cases above: 8 tokens per device, top-4 of 16 experts in 4 groups, a token in 2 groups.
    # 2 nodes of 4 devices, factor 1/2: at most 2 nodes per token; C1 = 1/2 x 8 x 2 / 2 = 4 (2 rounds),
    # C2 = 1/2 x 8 x 4 / 4 = 4 for the 2 x 4 received rows (2 rounds).
    across, inside = two_hop_sizes(make_config(*NODES_OF_4, "moe_ep_buffer_factor=0.5"), 8, 8, 4)
    assert (across.destinations, across.plan, inside.plan) == (2, (4, 2), (4, 2))
    # 4 nodes of 2, factor 1: a node's 4 experts are one group, so 2 of the 4 nodes per token;
    # C1 = 8 x 2 / 4 = 4 (2 rounds), C2 = the 4 x 4 received rows (1 round).
    across, inside = two_hop_sizes(make_config(*FOUR_NODES_OF_2, "moe_ep_buffer_factor=1.0"), 8, 8, 2)
    assert (across.destinations, across.plan, inside.plan) == (2, (4, 2), (16, 1))


def test_two_hop_sends_a_token_once_per_remote_node_as_the_planner_counts():
    """DeepSeek-V3's routing (256 experts, top-8 from the best 4 of 8 groups) of the repository's
    router on balanced random scores, EP64 as 8 nodes of 8, each token starting on any device:
    the hop across nodes sends a token once to each other node its experts reach, 3.47 rows per
    token, the planner's count (``routing.remote_domains``, from its own sample) within 5%. The
    one-hop exchange sends a row per remote device, up to 7 of the 8 copies."""
    from MaxText.moe.expert_parallel import _routes
    from MaxText.moe.router import route
    from MaxText.planner.routing import remote_domains

    config = make_config(model="deepseek3-671b")
    E, K, T = config.num_experts, config.num_experts_per_tok, 8192
    logits = jax.random.normal(jax.random.key(11), (T, E))
    experts_TK = route(logits, jnp.zeros(E), config).experts_TK
    origin_T = np.arange(T) % 64  # the device each token starts on

    def rows_to_other_nodes(destinations: int, experts_per_destination: int, node_of) -> float:
        send_Td = np.asarray(_routes(experts_TK, experts_per_destination, destinations, ExchangePlan(T, 1)).send_Td)
        remote_d = node_of(np.arange(destinations))[None, :] != (origin_T // 8)[:, None]
        return float((send_Td & remote_d).sum() / T)

    across = rows_to_other_nodes(8, 32, lambda node: node)
    planned = remote_domains(E, K, config.n_routing_groups, config.topk_routing_group, 8, config.routed_score_func)
    assert planned == pytest.approx(3.47, abs=0.01)
    assert across == pytest.approx(planned, rel=0.05)
    one_hop = rows_to_other_nodes(64, 4, lambda device: device // 8)
    assert 6.5 < one_hop <= 7.0 and across / one_hop < 0.55


def test_tokens_are_split_over_tensor_inside_the_exchange():
    config = make_config(*TENSOR_MESH)
    with jax.set_mesh(make_mesh(config, jax.devices())), nn.logical_axis_rules(axis_rules(config)):
        assert exchange_token_axes(64, "expert") == ("data", "fsdp", "expert", "stage", "tensor")
        assert exchange_token_axes(12, "expert") == ("data", "fsdp", "expert", "stage")  # 12 tokens do not split 8 ways
    # Transformer Engine keeps the rules' split: a rank holds tensor x the tokens per device.
    assert rank_tokens(64, {"data": 1, "fsdp": 2, "expert": 2, "tensor": 2}, ("data", "fsdp", "expert")) == 16


def test_buffer_factor_must_be_positive():
    with pytest.raises(ConfigError, match="moe_ep_buffer_factor"):
        make_config("moe_ep_buffer_factor=0")


def test_exchange_chunks_are_refused_where_the_exchange_is_not_chunked():
    """Transformer Engine's exchange takes a device's tokens whole: chunks would be ignored."""
    config = make_config("moe_ep_comm=te", "moe_exchange_chunks=2", *MESH)
    with pytest.raises(ConfigError, match="'moe_exchange_chunks': 2, but moe_ep_comm resolves to te"):
        check_backend(config, "gpu")


@pytest.mark.parametrize("pipeline", [True, False])
def test_chunks_are_chained_only_when_pipelined(pipeline):
    """``moe_exchange_pipeline`` chains chunk c's experts after chunk c - 1's, forward and
    backward: one barrier per pair of chunks in each pass; without it the chunks are independent."""
    keys = ("moe_ep_comm=all_to_all", *MESH, "moe_exchange_chunks=4", f"moe_exchange_pipeline={str(pipeline).lower()}")
    config = backend_config("ragged_dot", *keys)
    params = random_params(config)
    bias, x = jnp.zeros((config.num_experts,)), jnp.ones((B, S, config.emb_dim))
    with jax.set_mesh(make_mesh(config, jax.devices())), nn.logical_axis_rules(axis_rules(config)):
        jaxpr = str(jax.make_jaxpr(partial(block_and_grads, config))(params, bias, x))
    assert jaxpr.count("optimization_barrier") == (2 * 3 if pipeline else 0)


def test_pipelined_chunks_chain_each_chunks_experts_after_the_last():
    """On stand-in exchanges (sin: the dispatch, cos: the experts, exp: the combine), each barrier
    pairs chunk c's received rows with chunk c - 1's partial outputs; its first output feeds chunk
    c's experts and its second chunk c - 1's combine; the outputs are the chunks' own."""

    def chunk(a):
        x = yield jnp.sin(a)
        y = yield jnp.cos(x)
        return jnp.exp(y)

    def three_chunks(*inputs):
        return exchange_module._pipelined_chunks([chunk(a) for a in inputs])

    inputs = [jnp.full((2,), float(c)) for c in range(3)]
    for c, out in enumerate(three_chunks(*inputs)):
        np.testing.assert_allclose(out, np.exp(np.cos(np.sin(float(c)))), rtol=1e-6)
    jaxpr = jax.make_jaxpr(three_chunks)(*inputs).jaxpr
    made_by = {v: e for e in jaxpr.eqns for v in e.outvars}
    used_by = {}
    for e in jaxpr.eqns:
        for v in e.invars:
            used_by.setdefault(v, []).append(e)

    def source(v):  # the input a stand-in op was applied to, through earlier barriers
        e = made_by.get(v)
        if e is None:
            return jaxpr.invars.index(v)
        if e.primitive.name == "optimization_barrier":
            return source(e.invars[e.outvars.index(v)])
        return (e.primitive.name, source(e.invars[0]))

    barriers = [e for e in jaxpr.eqns if e.primitive.name == "optimization_barrier"]
    assert len(barriers) == 2
    for c, barrier in enumerate(barriers, start=1):
        assert source(barrier.invars[0]) == ("sin", c)  # chunk c's received rows
        assert source(barrier.invars[1]) == ("cos", ("sin", c - 1))  # chunk c - 1's partial outputs
        assert [e.primitive.name for e in used_by[barrier.outvars[0]]] == ["cos"]  # chunk c's experts
        assert [e.primitive.name for e in used_by[barrier.outvars[1]]] == ["exp"]  # chunk c - 1's combine


def test_pipeline_needs_chunks():
    with pytest.raises(ConfigError, match="moe_exchange_pipeline"):
        make_config("moe_exchange_pipeline=true")


def test_exchange_chunks_must_divide_a_devices_tokens():
    with pytest.raises(ConfigError, match="'moe_exchange_chunks': 3 chunks do not divide .* \\(32\\) tokens"):
        make_config("per_device_batch_size=2", "max_target_length=16", "moe_exchange_chunks=3")


def test_model_stats_shows_the_exchange_buffers(capsys):
    from tools.model_stats import main

    main(["model_name=deepseek3-671b", "ici_expert_parallelism=64", "moe_ep_comm=ragged_all_to_all"])
    table = capsys.readouterr().out
    assert "(ragged_all_to_all, ep 64, 4,096 tokens per device, bfloat16)" in table
    assert "5.64" in table and "16.92" in table  # the by-hand figures above, in GB
    main(
        [
            "model_name=deepseek3-671b",
            "ici_expert_parallelism=8",
            "dcn_expert_parallelism=8",
            "moe_ep_comm=hierarchical",
        ]
    )
    table = capsys.readouterr().out
    assert "10.34" in table and "8,192  rows per pair, up to 4 rounds" in table  # test_two_hop_sizes_by_hand


def test_layout_passes_hold_every_active_copy_once():
    """A layout of ``capacity`` copies per pass: the passes together hold each active copy exactly
    once, in the rows of its own expert, and every pass has the same static size."""
    from MaxText.moe.dispatch import block_layout, num_padded_rows

    T, K, E, m, capacity = 40, 3, 5, 4, 17
    rng = np.random.default_rng(0)
    experts_TK = jnp.asarray(np.argsort(rng.random((T, E)), axis=1)[:, :K], jnp.int32)
    active_TK = jnp.asarray(rng.random((T, K)) < 0.7)
    layout_of = jax.jit(block_layout, static_argnums=(1, 2, 4))  # one compile for every pass (eager took seconds)
    held = []
    for q in range(-(-T * K // capacity)):
        layout = layout_of(experts_TK, E, m, active_TK, capacity, q * capacity)
        assert layout.valid_P.shape == (num_padded_rows(capacity, E, m),)
        copies = np.asarray(layout.copy_P)[np.asarray(layout.valid_P)]
        rows = np.flatnonzero(np.asarray(layout.valid_P))
        expert_of_row = np.searchsorted(np.cumsum(layout.padded_E), rows, side="right")
        np.testing.assert_array_equal(np.asarray(experts_TK).reshape(-1)[copies], expert_of_row)
        assert len(copies) <= capacity
        held.extend(copies.tolist())
    assert sorted(held) == np.flatnonzero(np.asarray(active_TK).reshape(-1)).tolist()


def _collective_dtypes(jaxpr, names=("all_to_all", "all_gather", "ragged_all_to_all")) -> set[str]:
    """The operand dtypes of the collectives in a jaxpr, sub-jaxprs included."""
    found = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in names:
            found |= {str(v.aval.dtype) for v in eqn.invars if hasattr(v.aval, "dtype")}
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found |= _collective_dtypes(sub, names)
    return found


FP8_CASES = [
    ("allgather", *MESH),
    ("all_to_all", *SMALL_BUFFERS),
    ("ragged_all_to_all", *SMALL_BUFFERS),
    # The hop inside a node quantizes the delivered rows again; both hops move as on a GPU.
    ("hierarchical", *NODE_MESH, AS_ON_GPU),
]
# Every exchange with blockwise, and MX's scales on the cheapest exchange: the movement does not
# depend on the recipe (the quantizers are tested in test_quantization.py), and MX on each of the
# slot exchanges took 150 s (its unrolled rounds compile slowly).
FP8_RUNS = [("fp8_blockwise", case) for case in FP8_CASES] + [("mxfp8", FP8_CASES[0])]
# One block size: the unquantized cases take the blocked backend's levels through every exchange,
# and each level's loops are more computations for every conditional of the rounds to walk (the
# slot exchanges compiled in twice the time with three levels).
FP8_BLOCKS = "moe_min_block_rows=8"


@functools.cache
def fp8_one_device(recipe: str):
    """(params, bias, x, one device's outputs and gradients with ``recipe``, the unquantized
    outputs): the same for every exchange, computed once per recipe."""
    one = backend_config("blocked", f"quantization={recipe}", FP8_BLOCKS)
    params = random_params(one)
    x = jnp.asarray(np.random.default_rng(7).standard_normal((B, S, one.emb_dim)), jnp.float32)
    bias = jnp.asarray(routing_bias("zipf", one.num_experts), jnp.float32)
    (_, (y_one, _)), grads_one = jax.jit(partial(block_and_grads, one))(params, bias, x)
    (_, (y_plain, _)), _ = one_device("blocked")[1](params, bias, x)
    return params, bias, x, y_one, grads_one, y_plain


@pytest.mark.slow
@pytest.mark.parametrize(("recipe", "case"), FP8_RUNS, ids=[f"{r}-{c[0]}" for r, c in FP8_RUNS])
def test_fp8_dispatch_sends_bytes_and_changes_no_number(recipe, case, monkeypatch):
    """With ``quantization`` on, the tokens cross the exchange as FP8 bytes and scales, and expert
    parallelism gives the numbers of one device (where the same quantization runs without moving)."""
    exchange, *mesh = case
    monkeypatch.setattr(dispatch, "UNROLL_ROUNDS", True)
    if exchange == "ragged_all_to_all" or AS_ON_GPU in mesh:
        monkeypatch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)
    if AS_ON_GPU in mesh:
        monkeypatch.setattr(exchange_module, "trace_platform", lambda: "gpu")
        mesh.remove(AS_ON_GPU)
    params, bias, x, y_one, grads_one, y_plain = fp8_one_device(recipe)
    config = backend_config("blocked", f"quantization={recipe}", FP8_BLOCKS, f"moe_ep_comm={exchange}", *mesh)
    with jax.set_mesh(make_mesh(config, jax.devices())), nn.logical_axis_rules(axis_rules(config)):
        step = jax.jit(partial(block_and_grads, config))
        dtypes = _collective_dtypes(step.trace(params, bias, x).jaxpr.jaxpr)
        # Run by the jitted function: a compiled trace would ask for the emulated collective's
        # constants as inputs too.
        (_, (y_ep, _)), grads_ep = step(params, bias, x)
    assert "uint8" in dtypes  # the FP8 values travel as their bytes
    np.testing.assert_allclose(np.asarray(y_ep), np.asarray(y_one), rtol=1e-5, atol=1e-5)
    (params_ep, x_ep), (params_one, x_one) = grads_ep, grads_one
    np.testing.assert_allclose(np.asarray(x_ep), np.asarray(x_one), rtol=1e-4, atol=1e-5)
    for path, a in jax.tree_util.tree_leaves_with_path(params_ep):
        b = np.asarray(functools.reduce(lambda t, k: t[k.key], path, params_one))
        if path[0].key in ("wi_0", "wi_1", "wo"):
            # The routed experts' weight gradients contract each device's received tokens in its
            # own GEMMs, so their b x 1 tiles group other tokens than one device's: equal to
            # FP8's rounding, not to float32's.
            assert float(np.linalg.norm(np.asarray(a) - b) / np.linalg.norm(b)) < 2 * 2.0**-4
        else:
            np.testing.assert_allclose(np.asarray(a), b, rtol=1e-4, atol=1e-5)
    # ... and the FP8 path differs from the unquantized one by FP8's rounding, no more.
    error = float(jnp.linalg.norm(y_one - y_plain) / jnp.linalg.norm(y_plain))
    assert 1e-4 < error < 2 * 2.0**-4


def _eqns_outside_loops(jaxpr):
    """Every equation of ``jaxpr`` and the jaxprs it calls, but those inside a scan or while."""
    for e in jaxpr.eqns:
        if e.primitive.name in ("scan", "while"):
            continue
        yield e
        for sub in jax.extend.core.jaxprs_in_params(e.params):
            yield from _eqns_outside_loops(sub)


def test_exchange_buffers_are_made_inside_the_layers_loop():
    """The zeros a ``ragged_all_to_all`` lands in (the exchange's buffer, and its transpose's in the
    backward) stay inside the scanned layers: hoisted out of the loop as a constant, every
    in-place exchange into one would copy it first, and the loop would hold each hoisted buffer
    throughout. The sizes depend on the layer's input, as the routing's do."""
    ep, sent, rows, D = 4, 8, 12, 5  # a device sends 2 of its 8 rows to each, into slots of 3
    hop = exchange_module.Hop("expert", ep)
    mesh = jax.make_mesh((ep,), ("expert",), (jax.sharding.AxisType.Auto,), devices=jax.devices()[:ep])

    def per_device(x_ND, w_DD):
        sizes = jnp.full((ep,), 2, jnp.int32) + (x_ND[:ep, 0] > jnp.inf).astype(jnp.int32)  # 2, from the data
        starts, here = jnp.arange(ep, dtype=jnp.int32) * 2, jnp.full((ep,), hop.index() * 3, jnp.int32)
        landed = exchange_module.packed_exchange(x_ND @ w_DD, starts, sizes, here, sizes, rows, hop)
        return jnp.tanh(landed[: x_ND.shape[0]])

    layer = jax.shard_map(per_device, mesh=mesh, in_specs=(P("expert"), P()), out_specs=P("expert"), check_vma=False)

    def loss(ws, x):
        body = jax.checkpoint(lambda x, w: (layer(x, w), None), policy=jax.checkpoint_policies.nothing_saveable)
        return jax.lax.scan(body, x, ws)[0].sum()

    ws, x = jnp.ones((3, D, D)) / D, jnp.ones((ep * sent, D))
    jaxpr = jax.make_jaxpr(jax.grad(loss))(ws, x).jaxpr
    buffers = {(rows, D), (sent, D)}  # the exchange's output, its transpose's
    inside = [e for body in scan_bodies(jaxpr) for e in _eqns_outside_loops(body)]
    assert buffers <= {v.aval.shape for e in inside if e.primitive.name == "broadcast_in_dim" for v in e.outvars}
    hoisted = [e for e in _eqns_outside_loops(jaxpr) if any(v.aval.shape in buffers for v in e.outvars)]
    assert not hoisted, hoisted
