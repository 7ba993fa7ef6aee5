"""Where the modelled computation time of a step goes: by named scope, by pass and by kind.

The overlap model (``overlap.py``) times each instruction as a roofline: its matmul FLOPs at the
dense GEMM rate or its bytes at the HBM bandwidth, whichever is longer. This module keeps the
two apart, so that the time spent streaming bytes (fusions, copies, transposes, gathers) can be
told from the GEMMs' and traced to the model code that asked for it:

- scope: the layer stack and module from JAX's op name (``moe_layers: moe/routed_experts``,
  ``dense_layers: attention``, ``vocab_split``; ``step`` for the optimizer and the loss outside
  the model);
- pass: ``forward``, ``recompute`` (forward work JAX's remat policy reruns inside the backward
  pass), ``xla remat`` (work XLA's own rematerialisation pass cloned to bring the program under
  the device's memory: instructions named ``<name>.remat``, ``<name>.remat2``, ..., which keep
  the op name of what they clone) or ``backward``;
- kind: ``GEMM`` (FLOP-bound matmuls and kernel calls), ``GEMM, bytes-bound`` (matmuls that
  move more than they compute), and for the rest what the fusion does: ``copy/transpose``,
  ``gather/scatter``, ``reduction``, ``elementwise``.
"""

from __future__ import annotations

import re
from collections import defaultdict

from MaxText.aot.hlo_stats import CALLEE, Instr, op_name

PASSES = ("forward", "recompute", "xla remat", "backward")
XLA_REMAT = re.compile(r"\.remat\d*(\.|$)")  # HloRematerialization's clones: "fusion.42.remat2"
STACKS = ("moe_layers", "dense_layers", "mtp", "vocab_split")
LARGEST = 15  # the biggest bytes-bound instructions listed
_MOVES_ONLY = {"parameter", "copy", "transpose", "bitcast", "reshape", "tuple", "get-tuple-element", "constant"}
_GATHERS = {"gather", "scatter", "dynamic-slice", "dynamic-update-slice", "sort", "select-and-scatter"}


def scope_of(name: str) -> tuple[str, str]:
    """(scope, pass) of a JAX op name."""
    if not name:
        return "unnamed", "forward"
    step = "recompute" if "rematted_computation" in name else "backward" if "transpose(" in name else "forward"
    stack = next((s for s in STACKS if f"/{s}" in name or f"({s}" in name), "step")
    if stack == "vocab_split":
        return stack, step
    m = re.search(r"/layers?/(\w+)(?:/(\w+))?", name)
    if not m:
        return stack, step
    module = m.group(1)
    if module == "moe":
        module += "/" + (m.group(2) if m.group(2) in ("routed_experts", "shared_experts") else "router")
    return f"{stack}: {module}", step


def kind_of(instr: Instr, comps: dict[str, list[Instr]], flop_bound: bool, has_flops: bool) -> str:
    """What an instruction's time is spent on (see the module docstring)."""
    if has_flops:
        return "GEMM" if flop_bound else "GEMM, bytes-bound"
    called = [c for key, c in CALLEE.findall(instr.rest) if key == "calls"]
    ops = {i.opcode for i in comps.get(called[0], [])} if instr.opcode == "fusion" and called else {instr.opcode}
    if ops & _GATHERS:
        return "gather/scatter"
    if ops <= _MOVES_ONLY:
        return "copy/transpose"
    if ops & {"reduce", "reduce-window"}:
        return "reduction"
    return "elementwise"


def compute_breakdown(model, comp: str = "ENTRY") -> dict:
    """The modelled computation time of ``comp`` (a ``overlap._CostModel``), split as the module
    docstring says; all figures are seconds per step."""
    leaves, iterations = model.leaves(comp)
    by_scope: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    by_kind: dict[str, float] = defaultdict(float)
    items = []
    for instr, runs, _ in leaves.values():
        flops = model.instr_flops(instr)
        seconds = runs * model.seconds(instr)
        if seconds <= 0:
            continue
        gemm_seconds = runs * flops / model.flops_per_s
        flop_bound = flops > 0 and gemm_seconds >= seconds * (1 - 1e-9)
        kind = kind_of(instr, model.comps, flop_bound, flops > 0)
        scope, step = scope_of(op_name(instr))
        if XLA_REMAT.search(instr.name):
            step = "xla remat"
        row = by_scope[scope]
        row["GEMM" if flop_bound else "bytes"] += seconds
        row[step] += seconds
        by_kind[kind] += seconds
        if not flop_bound:
            items.append((seconds, runs, kind, instr.name, instr.result.split("{")[0][:60], scope, step))
    total = sum(by_kind.values())
    items.sort(reverse=True)
    order = sorted(by_scope, key=lambda s: -(by_scope[s]["GEMM"] + by_scope[s]["bytes"]))
    return {
        # Kernels launched per step, and the iterations of loops the data decides with the kernels
        # inside them: such a loop outside a command buffer reads its predicate on the host every
        # iteration and launches its body's kernels one by one, which the roofline leaves out.
        "kernels": sum(runs for _, runs, _ in leaves.values()),
        "data_dependent_iterations": iterations,
        "kernels_in_data_dependent_loops": sum(in_loops for _, _, in_loops in leaves.values()),
        "seconds": total,
        "gemm_seconds": by_kind.get("GEMM", 0.0),
        "by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        "by_scope": {s: {k: by_scope[s][k] for k in ("GEMM", "bytes", *PASSES)} for s in order},
        "largest_bytes_bound": [
            {"seconds": t, "runs": n, "kind": k, "instruction": i, "shape": sh, "scope": sc, "pass": p}
            for t, n, k, i, sh, sc, p in items[:LARGEST]
        ],
    }


def format_breakdown(b: dict) -> list[str]:
    """Text lines for the AOT report."""
    lines = [
        f"computation time by scope (modelled; {b['seconds']:.3f} s, of which GEMMs at their FLOP rate"
        f" {b['gemm_seconds']:.3f} s)",
        "  scope                                   GEMM s  bytes s  forward  recompute  xla remat  backward",
    ]
    for scope, r in b["by_scope"].items():
        if r["GEMM"] + r["bytes"] < 1e-4:
            continue
        lines.append(
            f"  {scope:<38} {r['GEMM']:7.3f} {r['bytes']:8.3f} {r['forward']:8.3f} {r['recompute']:10.3f}"
            f" {r['xla remat']:10.3f} {r['backward']:9.3f}"
        )
    lines.append("  by kind: " + ", ".join(f"{k} {v:.3f} s" for k, v in b["by_kind"].items()))
    lines.append(
        f"  kernels per step {b['kernels']:.0f}; iterations of loops the data decides {b['data_dependent_iterations']:.0f},"
        f" holding {b['kernels_in_data_dependent_loops']:.0f} kernels (launch and host costs are not in the roofline)"
    )
    lines.append("  largest bytes-bound instructions (s per step, runs, kind, result, scope, pass):")
    for item in b["largest_bytes_bound"][:8]:
        lines.append(
            f"    {item['seconds']:.4f} x{item['runs']:<5.0f} {item['kind']:<18} {item['shape']:<40}"
            f" {item['scope']} ({item['pass']})"
        )
    return lines
