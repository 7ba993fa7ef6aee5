"""``moe_matmul: tokamax``: the grouped matmul on tokamax's kernels.

On CPU the backend's wiring runs with tokamax's XLA reference (``jax.lax.ragged_dot``) in place of
the GPU kernels, against a per-row reference: padding of rows and feature dims, empty groups, rows
past the last group, the gradients. The GPU kernels are compiled for H100 and GB200 targets by the
interpreter that has JAX's CUDA plugin (which kernel runs each GEMM, and that no loop or
conditional is left), and Hopper's Mosaic kernels run in Mosaic GPU's interpret mode on this CPU.
The MoE block and expert parallelism with this backend are in test_moe_block.py and
test_expert_parallel.py. Each device query a GPU-target compile answers (``aot/targets.py``) has a
test here that fails when the library moves the function the answer replaces."""

import inspect
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.config import ConfigError
from MaxText.moe import tokamax_matmul as tm
from MaxText.moe.experts import check_backend, resolve_backend
from tests.conftest import make_config
from tests.test_aot_gpu import compiled_script


def per_row(x, w, sizes):
    """``x[p] @ w[e(p)]`` row by row for the rows inside the groups, zero past them."""
    expert_of_row = np.repeat(np.arange(len(sizes)), sizes)
    y = np.zeros((x.shape[0], w.shape[2]), np.float64)
    for p, e in enumerate(expert_of_row):
        y[p] = np.asarray(x[p], np.float64) @ np.asarray(w[e], np.float64)
    return y


@pytest.mark.parametrize(("rows", "dims"), [(300, (72, 40)), (512, (128, 192))])
def test_grouped_matmul_matches_a_per_row_reference(rows, dims):
    """Unaligned rows and dims (padded inside), an empty group, rows past the last group."""
    d_in, d_out = dims
    sizes = np.array([50, 0, 131, 7, 60])  # 248 rows in groups
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((rows, d_in)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((len(sizes), d_in, d_out)), jnp.float32)
    cot = jnp.asarray(rng.standard_normal((rows, d_out)), jnp.float32)
    sizes_E = jnp.asarray(sizes, jnp.int32)

    y, vjp = jax.vjp(lambda x, w: tm.grouped_matmul(x, w, sizes_E), x, w)
    np.testing.assert_allclose(np.asarray(y), per_row(x, w, sizes), rtol=1e-5, atol=1e-4)
    assert y.shape == (rows, d_out) and not np.any(np.asarray(y[sizes.sum() :]))

    # Gradients: of x through each row's own expert; of w_e from its group's rows only.
    dx, dw = vjp(cot)
    expert_of_row = np.repeat(np.arange(len(sizes)), sizes)
    n = sizes.sum()
    dx_ref = np.zeros((rows, d_in))
    dx_ref[:n] = np.einsum("po,pio->pi", np.asarray(cot[:n], np.float64), np.asarray(w, np.float64)[expert_of_row])
    np.testing.assert_allclose(np.asarray(dx), dx_ref, rtol=1e-5, atol=1e-4)
    for e in range(len(sizes)):
        group = expert_of_row == e
        dw_ref = np.asarray(x[:n][group], np.float64).T @ np.asarray(cot[:n][group], np.float64)
        np.testing.assert_allclose(np.asarray(dw[e]), dw_ref, rtol=1e-5, atol=1e-4)
    assert not np.any(np.asarray(dw[1]))  # the empty group


def test_dims_are_aligned_to_what_the_kernels_take():
    assert [tm.aligned_dim(n) for n in (32, 64, 128, 130, 704, 2048, 7168)] == [128, 128, 128, 192, 704, 2048, 7168]


def test_kernels_off_a_gpu_are_the_xla_reference():
    assert tm.kernels_for(jax.devices()[0]) == tm.REFERENCE
    assert tm.KERNELS[9].weight_grad == "mosaic" and tm.KERNELS[10].weight_grad == "triton"


def test_auto_picks_tokamax_on_gpu_with_bfloat16_only():
    assert resolve_backend("auto", "gpu") == "tokamax"
    assert resolve_backend("auto", "gpu", te=True) == "tokamax"  # Transformer Engine by name only
    assert resolve_backend("auto", "gpu", dtype="float32") == "blocked"
    assert resolve_backend("auto", "gpu", fp8=True) == "blocked"
    assert resolve_backend("auto", "cpu") == "blocked"
    assert resolve_backend("auto", "tpu") == "ragged_dot"
    assert resolve_backend("te", "gpu") == "te"


def test_tokamax_is_refused_off_a_gpu_and_with_float32():
    with pytest.raises(ConfigError, match="'moe_matmul': tokamax runs GPU kernels .* choose blocked"):
        check_backend(make_config("moe_matmul=tokamax"), "cpu")
    with pytest.raises(ConfigError, match="'moe_matmul': tokamax's kernels take bfloat16 .* dtype is float32"):
        check_backend(make_config("moe_matmul=tokamax", "dtype=float32"), "gpu")
    check_backend(make_config("moe_matmul=tokamax", "dtype=bfloat16"), "gpu")


def test_tokamax_on_cpu_exits_2_with_one_line(tmp_path):
    import subprocess
    import sys

    args = [sys.executable, "-m", "MaxText.train", "moe_matmul=tokamax", "steps=1", f"base_output_directory={tmp_path}"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=300, env={"JAX_PLATFORMS": "cpu", **_env()})
    assert out.returncode == 2, out.stderr[-2000:]
    assert "tokamax runs GPU kernels" in out.stderr and "Traceback" not in out.stderr


def _env():
    import os

    return {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


# ---- what a GPU-target compile answers in the libraries' place (aot/targets.py) ----


def test_the_default_device_query_tokamax_makes_is_jaxs_public_one():
    """``answering_device_queries`` replaces ``jax.extend.backend.get_default_device``: tokamax must
    still reach it through that module, at call time, where it picks and sizes its kernels."""
    from jax.extend import backend
    from tokamax._src import gpu_utils
    from tokamax._src.ops import op
    from tokamax._src.ops.ragged_dot import api, pallas_mosaic_gpu_common

    assert callable(backend.get_default_device)
    for module in (gpu_utils, op, api, pallas_mosaic_gpu_common):
        assert module.backend is backend, module.__name__
        assert "backend.get_default_device()" in inspect.getsource(module), module.__name__


def test_the_cudnn_capability_checks_are_where_the_patch_replaces_them():
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

    source = inspect.getsource(cudnn_attention)
    for name in ("check_compute_capability", "is_cuda_compute_capability_equal"):
        assert callable(getattr(cudnn_attention, name))
        assert source.count(f"{name}(") >= 2, name  # defined there, and called there by its module name


def test_the_tokamax_pieces_the_backend_builds_on_are_where_it_expects():
    """The kernels' op classes and the VJP whose two gradient GEMMs ``KERNELS`` chooses."""
    from tokamax._src.ops.ragged_dot import base

    params = inspect.signature(base.vjp).parameters
    assert {"dlhs_ragged_dot", "drhs_ragged_dot"} <= set(params)
    assert "vjp" in {f.name for f in __import__("dataclasses").fields(base.RaggedDot)}
    assert tm._ragged_dot_op(tm.REFERENCE).vjp.keywords.keys() == {"dlhs_ragged_dot", "drhs_ragged_dot"}


# ---- the GPU kernels, compiled for GPU targets and run in interpret mode ----

COMPILE = """
import json, sys
import jax, jax.numpy as jnp
from MaxText.aot.hlo_stats import hlo_stats
from MaxText.aot.targets import TARGETS, answering_device_queries, compile_devices
from MaxText.moe import tokamax_matmul as tm

M, I, O, E = 1024, 256, 128, 4
target = TARGETS[sys.argv[1]]
device = compile_devices(target, 1)[0]
spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.SingleDeviceSharding(device))

def loss(x, w, sizes):
    return jnp.sum(tm.grouped_matmul(x, w, sizes).astype(jnp.float32) ** 2)

with answering_device_queries(target, device):
    kernels = tm.kernels_for(tm.traced_device())
    args = (spec((M, I), jnp.bfloat16), spec((E, I, O), jnp.bfloat16), spec((E,), jnp.int32))
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile().as_text()
stats = hlo_stats(text, {})
print(json.dumps({
    "kernels": [kernels.forward, kernels.data_grad, kernels.weight_grad],
    "mosaic": text.count('custom_call_target="mosaic_gpu_v2"'),
    "triton": text.count('custom_call_target="__gpu$xla.gpu.triton"'),
    "while": text.count(" while("), "conditional": text.count(" conditional("),
    "flops": stats.dot_flops, "expected": 3 * 2 * M * I * O,
}))
"""


@pytest.mark.parametrize(
    ("target", "mosaic", "triton"),
    [("h100", 3, 0), ("gb200", 2, 1)],  # sm_100: the weight gradient on Triton (KERNELS)
)
@pytest.mark.slow
def test_kernels_compile_for_gpu_targets_with_no_control_flow(target, mosaic, triton):
    r = json.loads(compiled_script(COMPILE, target)[-1])
    generation = 9 if target == "h100" else 10
    k = tm.KERNELS[generation]
    assert r["kernels"] == [k.forward, k.data_grad, k.weight_grad]
    assert (r["mosaic"], r["triton"]) == (mosaic, triton)
    assert r["while"] == 0 and r["conditional"] == 0
    assert r["flops"] == pytest.approx(r["expected"])  # counted from the custom calls' shapes


INTERPRET = """
import json
import numpy as np
import jax, jax.numpy as jnp
import tokamax, tokamax.config
from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams, force_gpu_interpret_mode
from tokamax._src.ops.ragged_dot import base
from tokamax._src.ops.ragged_dot.pallas_mosaic_gpu import PallasMosaicGpuRaggedDot
from MaxText.aot.targets import TARGETS, answering_device_queries

M, K, N = 256, 128, 128
sizes = np.array([100, 0, 60, 40])  # one empty group, 56 rows past the last one
rng = np.random.default_rng(0)
x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
dy = jnp.asarray(rng.standard_normal((M, N)), jnp.bfloat16)
w = jnp.asarray(rng.standard_normal((len(sizes), K, N)) / 8, jnp.bfloat16)
gemms = {  # the three GEMMs of the VJP, as tokamax's base.vjp calls them
    "forward": (x, w, base.DEFAULT_RAGGED_DOT_DIM_NUMS),
    "data_grad": (dy, w, base.TRANS_RHS_RAGGED_DOT_DIM_NUMS),
    "weight_grad": (x, dy, base.RAGGED_CONTRACTING_DOT_DIM_NUMS),
}
n = int(sizes.sum())
out = {}
for name, (a, b, dims) in gemms.items():
    def run(op, a, b, s):
        return tokamax.ragged_dot_general(a, b, s, dims, implementation=[op]).astype(jnp.float32)
    ref = np.asarray(jax.jit(lambda *args: run(base.RaggedDot(), *args))(a, b, jnp.asarray(sizes, jnp.int32)))
    try:
        with answering_device_queries(TARGETS["h100"]), force_gpu_interpret_mode(InterpretGPUParams()), \\
                tokamax.config.cross_compile(True):
            got = np.asarray(jax.jit(lambda *args: run(PallasMosaicGpuRaggedDot(), *args))(a, b, jnp.asarray(sizes, jnp.int32)))
    except NotImplementedError as err:
        out[name] = str(err).splitlines()[0]
        continue
    got, ref = (got[:n], ref[:n]) if name != "weight_grad" else (got, ref)  # rows past the groups: unwritten
    out[name] = float(np.abs(got - ref).max() / np.abs(ref).max())
print(json.dumps(out))
"""


@pytest.mark.slow
def test_hopper_mosaic_kernels_run_in_interpret_mode():
    """The forward and input-gradient GEMMs of Hopper's Mosaic kernel, run by Mosaic GPU's
    interpreter on this CPU, equal the XLA reference within bfloat16 rounding. Its weight-gradient
    kernel does not run there: the interpreter has no CPU rule for ``layout_cast`` (the Blackwell
    kernels stop at ``cluster_barrier``; Triton's are not interpreted by it)."""
    r = json.loads(compiled_script(INTERPRET)[-1])
    assert r["forward"] < 1 / 128 and r["data_grad"] < 1 / 128, r
    assert "layout_cast" in r["weight_grad"], r


# ---- overflow rounds inside conditionals: decided on the device (aot/thunks.py) ----

SEQUENCE = """\
000: kCommandBuffer [source | sink]
    001: kCopy         [source       | next=004 (3)] kCopy
    004: kWhile        [prev=003 (1) | next=011 (1)]
condition:
        005: kCustomKernel [source | sink] wrapped_compare grid: [1, 1, 1]
      body:
        006: kCustomKernel [source       | sink        ] loop_add_fusion grid: [1, 1, 1]
    011: kConditional  [prev=004 (1) | sink        ]
012: kConditional    [prev=000 (1) | sink        ]
  false_branch:
    013: kWhile         [source | sink]
condition:
        014: kCustomKernel [source | sink] compare
"""
METADATA = "".join(
    f'thunk_metadata {{\n  thunk_info {{\n    profile_annotation: "{name}"\n    thunk_id: {i}\n  }}\n'
    f'  thunk_kind: "{kind}"\n}}\n'
    for name, i, kind in [
        ("while.7", 4, "kWhile"),
        ("cond.3", 11, "kConditional"),
        ("conditional.9", 12, "kConditional"),
        ("while.2", 13, "kWhile"),
    ]
)


def test_thunk_reader_finds_the_control_flow_outside_command_buffers():
    """In XLA:GPU's printed form: section labels start at column 0, nesting is indentation."""
    from MaxText.aot.thunks import host_decided

    assert host_decided(SEQUENCE, METADATA) == {"conditional.9", "while.2"}


CONDITIONAL = """
import sys, tempfile
from pathlib import Path
import jax, jax.numpy as jnp
from MaxText.aot.targets import TARGETS, answering_device_queries, compile_devices
from MaxText.aot.thunks import read_dump
from MaxText.moe import tokamax_matmul as tm

target = TARGETS[sys.argv[1]]
device = compile_devices(target, 1)[0]
spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.SingleDeviceSharding(device))

def overflow_round(x, w, sizes):  # the shape of an overflow round: run only when needed
    return jax.lax.cond(sizes.sum() > 256, lambda: tm.grouped_matmul(x, w, sizes), lambda: jnp.zeros_like(x))

args = (spec((512, 256), jnp.bfloat16), spec((4, 256, 256), jnp.bfloat16), spec((4,), jnp.int32))
for commands in ("FUSION,CUSTOM_CALL,CONDITIONAL,WHILE", "FUSION,CUSTOM_CALL"):
    options = {"xla_gpu_enable_command_buffer": commands, "xla_gpu_graph_min_graph_size": 1}
    with answering_device_queries(target, device), tempfile.TemporaryDirectory() as folder:
        jax.jit(overflow_round).lower(*args).compile(compiler_options=options | {"xla_dump_to": folder})
        print(len(read_dump(Path(folder))))
"""


@pytest.mark.slow
@pytest.mark.parametrize("target", ["h100", "gb200"])
def test_a_conditional_around_the_kernels_runs_in_a_command_buffer(target):
    """With the recipes' command buffers (``CONDITIONAL``, ``WHILE``) XLA:GPU puts a conditional
    around tokamax's kernels (Mosaic GPU custom calls, Triton) in a CUDA graph, which decides it on
    the device; without ``CONDITIONAL`` it is a thunk of its own, decided on the host."""
    assert compiled_script(CONDITIONAL, target)[-2:] == ["0", "1"]
