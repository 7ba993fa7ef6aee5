"""Where the AOT report's modelled computation time goes (``MaxText/aot/compute_time.py``): a
hand-written scheduled program whose every instruction's roofline time is worked out here from
the GPU's published figures."""

import numpy as np
import pytest

from MaxText.aot.compute_time import XLA_REMAT, scope_of
from MaxText.aot.overlap import CostInputs, overlap
from MaxText.planner.constants import GEMM_EFFICIENCY
from MaxText.planner.systems import SYSTEMS

N = 4096
BACKWARD_DOT = "jit(train_step)/transpose(jvp(DeepSeekV3))/moe_layers/while/body/closed_call/checkpoint/layers/attention/dot_general"
FORWARD_COPY = (
    "jit(train_step)/jvp(DeepSeekV3)/moe_layers/while/body/closed_call/layers/moe/routed_experts/shard_map/copy"
)
PROGRAM = f"""HloModule m, is_scheduled=true

%mm (a: bf16[{N},{N}], b: bf16[{N},{N}]) -> bf16[{N},{N}] {{
  %a = bf16[{N},{N}]{{1,0}} parameter(0)
  %b = bf16[{N},{N}]{{1,0}} parameter(1)
  ROOT %d = bf16[{N},{N}]{{1,0}} dot(%a, %b), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}

%body (p: (s32[], bf16[{N},{N}])) -> (s32[], bf16[{N},{N}]) {{
  %p = (s32[], bf16[{N},{N}]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %w = bf16[{N},{N}]{{1,0}} get-tuple-element(%p), index=1
  %f = bf16[{N},{N}]{{1,0}} fusion(%w, %w), kind=kCustom, calls=%mm, metadata={{op_name="{BACKWARD_DOT}"}}
  %c = bf16[{N},{N}]{{0,1}} copy(%f), metadata={{op_name="{FORWARD_COPY}"}}
  ROOT %t = (s32[], bf16[{N},{N}]{{1,0}}) tuple(%i, %c)
}}

%cond (q: (s32[], bf16[{N},{N}])) -> pred[] {{
  %q = (s32[], bf16[{N},{N}]{{1,0}}) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%j, %n), direction=LT
}}

ENTRY %main (w0: bf16[{N},{N}]) -> bf16[{N},{N}] {{
  %w0 = bf16[{N},{N}]{{1,0}} parameter(0)
  %z = s32[] constant(0)
  %init = (s32[], bf16[{N},{N}]{{1,0}}) tuple(%z, %w0)
  %loop = (s32[], bf16[{N},{N}]{{1,0}}) while(%init), condition=%cond, body=%body
  %x = bf16[{N},{N}]{{1,0}} get-tuple-element(%loop), index=1
  ROOT %e = bf16[{N},{N}]{{1,0}} exponential(%x), metadata={{op_name="jit(train_step)/exp"}}
}}
"""


def test_computation_time_by_scope_pass_and_kind():
    """3 loop iterations of a FLOP-bound matmul (backward attention) and a copy (forward routed
    experts), then one elementwise op outside the model: each in its scope, pass and kind, and
    the parts add up to the modelled computation time."""
    system = SYSTEMS["gb200-nvl72"]
    report = overlap(PROGRAM, CostInputs(system, np.zeros(1, int)))
    b = report.compute
    matrix = 2 * N * N  # bytes of one bf16 [N, N]
    dot = 2 * N**3 / (system.peak_flops("bf16") * GEMM_EFFICIENCY["dense"]["bf16"])
    assert dot > 3 * matrix / system.hbm_bw  # FLOP-bound: reads two matrices, writes one
    copy = 2 * matrix / system.hbm_bw
    attention, experts, step = (
        b["by_scope"]["moe_layers: attention"],
        b["by_scope"]["moe_layers: moe/routed_experts"],
        b["by_scope"]["step"],
    )
    assert attention["GEMM"] == pytest.approx(3 * dot) and attention["bytes"] == 0
    assert attention["backward"] == pytest.approx(3 * dot)
    assert experts["bytes"] == pytest.approx(3 * copy) and experts["forward"] == pytest.approx(3 * copy)
    assert step["bytes"] == pytest.approx(copy)  # exponential: reads and writes one matrix
    assert b["by_kind"] == pytest.approx({"GEMM": 3 * dot, "copy/transpose": 3 * copy, "elementwise": copy})
    assert b["seconds"] == pytest.approx(report.compute_seconds) and b["gemm_seconds"] == pytest.approx(3 * dot)
    assert (b["kernels"], b["data_dependent_iterations"], b["kernels_in_data_dependent_loops"]) == (7, 0, 0)
    largest = b["largest_bytes_bound"]
    assert [(i["instruction"], i["runs"], i["kind"]) for i in largest] == [
        ("c", 3, "copy/transpose"),
        ("e", 1, "elementwise"),
    ]


@pytest.mark.parametrize(
    "name, expected",
    [
        (BACKWARD_DOT, ("moe_layers: attention", "backward")),
        (FORWARD_COPY, ("moe_layers: moe/routed_experts", "forward")),
        (
            "jit(train_step)/transpose(jvp(DeepSeekV3))/moe_layers/while/body/closed_call/checkpoint/"
            "rematted_computation/layers/moe/bsd,de->bse",
            ("moe_layers: moe/router", "recompute"),
        ),
        ("jit(train_step)/jvp(DeepSeekV3)/mtp_1/layer/moe/shared_experts/mul", ("mtp: moe/shared_experts", "forward")),
        ("jit(train_step)/transpose(jvp(vocab_split))/shard_map/while/body/dot_general", ("vocab_split", "backward")),
        ("jit(train_step)/mul", ("step", "forward")),
        ("", ("unnamed", "forward")),
    ],
)
def test_scope_of_names_the_layer_module_and_pass(name, expected):
    assert scope_of(name) == expected


def test_loops_the_data_decides_are_counted_with_their_kernels():
    """The same loop, its bound read from an operand instead of a constant: one iteration counted
    (the trip count a compile cannot know, as XLA counts it), its two kernels inside."""
    decided_by_data = PROGRAM.replace("%n = s32[] constant(3)", "%n = s32[] get-tuple-element(%q), index=0")
    b = overlap(decided_by_data, CostInputs(SYSTEMS["gb200-nvl72"], np.zeros(1, int))).compute
    assert (b["kernels"], b["data_dependent_iterations"], b["kernels_in_data_dependent_loops"]) == (3, 1, 2)


def test_xla_rematerialisation_is_its_own_pass():
    """A copy XLA's rematerialisation pass cloned (named ``<name>.remat2``, the op name of what it
    cloned kept) is counted as XLA's recomputation, not as the forward pass its op name says."""
    cloned = PROGRAM.replace("%c = ", "%c.remat2 = ").replace("tuple(%i, %c)", "tuple(%i, %c.remat2)")
    b = overlap(cloned, CostInputs(SYSTEMS["gb200-nvl72"], np.zeros(1, int))).compute
    experts = b["by_scope"]["moe_layers: moe/routed_experts"]
    assert experts["bytes"] > 0 and experts["forward"] == 0
    assert experts["xla remat"] == pytest.approx(experts["bytes"])
    assert b["by_scope"]["moe_layers: attention"]["xla remat"] == 0


@pytest.mark.parametrize(
    "name, cloned",
    [
        ("gemm_fusion_dot.42.remat", True),
        ("gemm_fusion_dot.42.remat2", True),
        ("copy.7.remat.1", True),
        ("rematted_computation.3", False),  # JAX's remat, named in op names, not XLA's clones
        ("fusion.remat_move_to_host", False),
        ("loop_add_fusion.423", False),
    ],
)
def test_xla_clone_names(name, cloned):
    assert bool(XLA_REMAT.search(name)) == cloned
