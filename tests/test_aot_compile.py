"""Ahead-of-time compilation of the real train step: the HLO statistics on small hand-built
programs (8 devices, this process), and the 671B architecture cut to 2 layers per stack on 64
simulated devices (a subprocess running tools/aot_compile.py --json: the device count is fixed
when JAX starts) checked against parameter arithmetic, the FLOPs accounting and the exchange's
dispatch volume, with no involuntary rematerialisation and a bounded temp."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from MaxText.aot.hlo_stats import group_axes, hlo_stats, replica_groups
from MaxText.moe.expert_parallel import exchange_plan
from tests.conftest import make_config

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9


def test_loop_flops_are_multiplied_by_the_trip_count():
    """XLA's cost analysis counts a scanned matmul once; the HLO walk counts it n times."""

    def f(w_NDD, x_BD):
        return jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x_BD, w_NDD)[0]

    n, B, D = 7, 16, 64
    compiled = jax.jit(f).lower(jnp.zeros((n, D, D)), jnp.zeros((B, D))).compile()
    stats = hlo_stats(compiled.as_text(), {"x": 1})
    assert stats.dot_flops == n * 2 * B * D * D
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    assert cost["flops"] < 2 * (2 * B * D * D)  # the reason for the walk: one iteration only


def test_collectives_are_counted_with_their_bytes_and_mesh_axes():
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("fsdp", "expert"))
    x = jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(mesh, P(("fsdp", "expert"))))

    def f(x_TD):
        gathered = jax.lax.with_sharding_constraint(x_TD, NamedSharding(mesh, P("fsdp")))  # gather over expert
        return (gathered * 2).sum(axis=0)  # reduced over every device

    stats = hlo_stats(jax.jit(f).lower(x).compile().as_text(), dict(mesh.shape))
    gathers = {k: v for k, v in stats.by_axes.items() if k.startswith("all-gather")}
    assert gathers == {"all-gather over expert": {"count": 1, "bytes": 32 * 32 * 4}}
    assert stats.collectives["all-reduce"]["count"] >= 1


def test_replica_groups_in_both_notations_name_the_mesh_axes():
    mesh_shape = {"data": 1, "fsdp": 4, "expert": 16, "tensor": 1}
    iota = replica_groups("replica_groups=[4,16]<=[64], dimensions={0}")
    assert iota == np.arange(64).reshape(4, 16).tolist()
    assert group_axes(iota, mesh_shape) == "expert"
    transposed = replica_groups("replica_groups=[16,4]<=[4,16]T(1,0)")
    assert group_axes(transposed, mesh_shape) == "fsdp"
    explicit = replica_groups("replica_groups={{0,16,32,48},{1,17,33,49}}, to_apply=%add")
    assert group_axes(explicit, mesh_shape) == "fsdp"
    assert group_axes(None, mesh_shape) == "fsdp+expert"


# ---- the 671B architecture, 2 dense + 2 MoE layers and the MTP module, expert 16 x fsdp 4 ----

ARCH_671B = [
    "model_name=deepseek3-671b",
    "base_num_decoder_layers=4",
    "first_num_dense_layers=2",
    "dtype=bfloat16",
    "per_device_batch_size=1",
    "max_target_length=4096",
    "ici_expert_parallelism=16",  # expert 16 x fsdp 4: 64 GPUs, one NVL72 rack
    "ici_fsdp_parallelism=4",
    "moe_ep_comm=all_to_all",
]
DEVICES = 64


@pytest.fixture(scope="module")
def report_671b() -> dict:
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "aot_compile.py"), *ARCH_671B, "--devices", str(DEVICES), "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _state_bytes_per_device(config) -> float:
    """The train state (float32 weights and two Adam moments; gradients are not state) from the
    model's parameter count, divided evenly over the 64 devices."""
    from MaxText.models.accounting import memory_estimate

    memory = memory_estimate(config)
    return (memory.weights + memory.optimizer) / DEVICES


@pytest.mark.slow
def test_671b_arguments_are_the_state_over_the_devices(report_671b):
    config = make_config(*ARCH_671B[1:], model="deepseek3-671b")
    batch_bytes = 5 * DEVICES * config.max_target_length * 4 / DEVICES  # five int32 [B, S] arrays
    expected = _state_bytes_per_device(config) + batch_bytes
    assert report_671b["memory"]["arguments"] == pytest.approx(expected, rel=0.02)


@pytest.mark.slow
def test_671b_compiles_without_involuntary_rematerialisation_and_bounded_temp(report_671b):
    """A step that loses the batch sharding replicates [B, ...] activations on all 64 devices (the
    SPMD partitioner then warns of an involuntary full rematerialisation, and temp grows 64-fold,
    to terabytes); the sharded step needs 38.8 GB of XLA:CPU temp here (94 GB while each device's
    expert layout held every copy it could receive, 52 GB while the embedding and the head were
    gathered whole and their gradients all-reduced at full size)."""
    assert report_671b["warnings"] == []
    assert report_671b["memory"]["temp"] < 40 * GB, report_671b["memory"]
    # Routing is per token: no collective may feed the router's top-k (XLA gathered its global
    # operand on the recipes' meshes until it ran per token shard).
    assert not [op for op in report_671b["collectives_by_op"] if op.endswith(" of top_k")]


@pytest.mark.slow
def test_671b_flops_match_the_accounting(report_671b):
    assert report_671b["dot_flops"] == pytest.approx(report_671b["expected_flops"], rel=0.10)
    assert report_671b["xla_flops"] < 0.8 * report_671b["dot_flops"]  # XLA's count misses the loops


@pytest.mark.slow
def test_671b_all_to_all_bytes_are_the_dispatch_volume(report_671b):
    """all_to_all moves fixed slots of C + 1 rows per destination, ep * (C + 1) rows of D per
    exchange. A scanned MoE layer exchanges 5 times per step: tokens out and outputs back
    (forward), their gradients back and out (backward), and the tokens out again in the remat
    recompute (the outputs' return is not needed there); the MTP module's layer, not
    rematerialised, 4 times. XLA:CPU runs bfloat16 collectives in float32 (4 bytes an element;
    a GPU moves half). The routing arrays beside them (ids, flags, weights: [R, K]) add < 1%."""
    config = make_config(*ARCH_671B[1:], model="deepseek3-671b")
    ep, T, K, D = 16, config.max_target_length, config.num_experts_per_tok, config.emb_dim
    C = exchange_plan(T, K, ep, config.moe_ep_buffer_factor).rows_per_pair
    exchanges = 5 * config.num_moe_layers + 4 * config.mtp_num_layers
    activations = exchanges * ep * (C + 1) * D * 4
    over_expert = report_671b["collectives_by_axes"]["all-to-all over expert"]["bytes"]
    assert activations <= over_expert <= 1.01 * activations


@pytest.fixture
def fresh_compiles(tmp_path):
    """XLA warns only while it compiles, so ``compile_train_step`` compiles the step past JAX's
    persistent cache: here a cache of the test's own, live (a jitted function lands in it), must
    stay without an entry of the train step's."""
    from jax.experimental.compilation_cache import compilation_cache

    suite_cache = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    compilation_cache.reset_cache()
    try:
        jax.jit(lambda x: x * 3 + 1)(jnp.arange(7.0))
        assert list(tmp_path.iterdir()), "the test's cache took no entry: the check below would prove nothing"
        yield
        steps = [path.name for path in tmp_path.iterdir() if path.name.startswith("jit_train_step")]
        assert steps == [], "the train step was compiled through the persistent cache"
    finally:
        jax.config.update("jax_compilation_cache_dir", suite_cache)
        compilation_cache.reset_cache()


def test_a_data_axis_keeps_the_embedding_lookup_sharded(capfd, fresh_compiles):
    """With data 2 x fsdp 2 x expert 2, a lookup into the table's sharded embed dim made XLA
    replicate the [B, S, D] result ("involuntary full rematerialization"); the lookup is split over
    the vocabulary instead, the tokens gathered to the rows."""
    from MaxText.aot.compile import compile_train_step

    config = make_config(
        *("dtype=bfloat16", "base_num_decoder_layers=1", "first_num_dense_layers=1", "mtp_num_layers=0"),
        *("ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_expert_parallelism=2"),
    ).with_platform("gpu")
    compile_train_step(config, jax.devices()[:8])
    assert "Involuntary full rematerialization" not in capfd.readouterr().err


def test_a_multi_rack_mesh_stores_the_vocabulary_split_as_it_is_read(capfd, fresh_compiles):
    """Racks split data and fsdp, the vocabulary is split over the expert axis inside a rack (the
    GB200 recipe's layout, scaled to 8 devices). Stored by the plain rules (embed dim over fsdp x
    expert), the embedding and the head had to be resharded to the split's layout every step, and
    XLA:SPMD replicated both whole on every device to do it ("involuntary full
    rematerialization"); they are now stored by their vocabulary rows over the group."""
    from MaxText.aot.compile import compile_train_step

    config = make_config(
        *("dtype=bfloat16", "base_num_decoder_layers=1", "first_num_dense_layers=1", "mtp_num_layers=0"),
        *("dcn_data_parallelism=2", "dcn_fsdp_parallelism=2", "ici_expert_parallelism=2", "ici_fsdp_parallelism=1"),
        "vocab_parallel_axes=[expert,tensor]",  # what auto resolves to on GPU for this mesh
    )
    report, _ = compile_train_step(config, jax.devices()[:8])
    assert report.mesh == {"stage": 1, "data": 2, "fsdp": 2, "expert": 2, "tensor": 1}
    assert "Involuntary full rematerialization" not in capfd.readouterr().err


def test_latency_profile_model_compiles_again_with_the_first_programs_costs(tmp_path):
    """``latency_profile: model`` (and ``model_contended``) compiles twice, the second time reading
    a profile that names the first program's kernels with their modelled times, at a path named by
    its contents (the compilation cache keys a program by its options: the same profile, the same
    key); a profile file compiles once, reading that file; ``""`` compiles once without one."""
    import re

    from MaxText.aot.compile import PROFILE_OPTION, profile_guided
    from MaxText.aot.overlap import CostInputs
    from MaxText.planner.systems import SYSTEMS

    x = jax.ShapeDtypeStruct((256, 512), jnp.float32)
    lowered = jax.jit(lambda a, w: jnp.tanh(a @ w) * 2.0).lower(x, jax.ShapeDtypeStruct((512, 512), jnp.float32))
    paths: list[str | None] = []

    def compile_once(options: dict):
        paths.append(options.get(PROFILE_OPTION))
        return (lowered.compile(compiler_options=options),)

    inputs = CostInputs(SYSTEMS["gb200-nvl72"], np.zeros(1, int))
    (_,), first = profile_guided(compile_once, {}, "model", inputs)
    assert paths[0] is None and first is not None and paths[1].endswith(".pbtxt")
    kernels = {i.name for i in first.model.comps["ENTRY"] if i.opcode == "fusion"}  # the matmul's and the rest's
    costs = {n: float(c) for n, c in re.findall(r'name: "([^"]+)" cost_us: ([\d.]+)', Path(paths[1]).read_text())}
    assert len(kernels) == 2 and set(costs) == kernels  # nothing inside them, no parameter
    assert all(c > 0 for c in costs.values())
    profile_guided(compile_once, {}, "model", inputs)
    assert paths[3] == paths[1]  # the same profile at the same path
    profile_guided(compile_once, {}, "model_contended", inputs)  # twice too; no collective to stretch
    assert paths[4] is None and paths[5] == paths[1]

    paths.clear()
    measured = tmp_path / "measured.pbtxt"
    measured.write_text('costs { name: "dot.1" cost_us: 3.5 }\n')
    assert profile_guided(compile_once, {}, str(measured), None)[1] is None
    assert len(paths) == 1 and Path(paths[0]).read_text() == measured.read_text()
    paths.clear()
    assert profile_guided(compile_once, {}, "", None)[1] is None and paths == [None]
