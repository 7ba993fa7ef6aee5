"""Loop-aware FLOPs and a collectives inventory, read from a compiled program's optimized HLO text.

Why not just ``compiled.cost_analysis()``: XLA's cost analysis visits a ``while`` body once
(``HloCostAnalysis::HandleWhile`` does not multiply by the trip count), and the scanned layer
stacks, the gradient-accumulation scan and the blocked MoE backend's loop over blocks are all
``while`` loops, so its FLOPs come out as if each stack had one layer. Here every computation gets
a multiplicity, the product of the trip counts of the ``while`` loops around it (from XLA's
``known_trip_count`` annotation, else from the loop condition's ``compare(counter, constant)``),
and matmul FLOPs and collectives are summed with it. Matmul FLOPs are ``2 x output elements x
contracted elements`` per ``dot`` (or ``convolution``): elementwise work is left out, which at
the 671B is well under 1% of the step.

Two kinds of control flow depend on the data and are counted as balanced routing runs them: of a
``conditional`` only its cheapest branch (the expert-parallel overflow rounds run only when a
device pair overflows its slots), and a loop whose trip count is data-dependent (the blocked MoE
backend's loop over blocks) by a caller-supplied estimate (``dynamic_trips``).

Collective bytes are the full buffer of each op per device: the result of an all-gather,
all-reduce, all-to-all or collective-permute, the operand of a reduce-scatter. Replica groups
(explicit ``{{0,1},{2,3}}`` or iota ``[G,S]<=[dims]T(perm)``) list partition ids, i.e. positions in
the mesh's device order, so the mesh axes an op spans are those along which its group varies.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

COLLECTIVES = (
    "all-gather",
    "reduce-scatter",
    "all-reduce",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
)
DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
    "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1,
}  # fmt: skip

LARGEST = 12  # the biggest single collectives reported, with the JAX op each came from
DynamicTrips = Callable[[set[int]], float]  # dims shared by a data-dependent loop's matmuls -> trip count
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$")
_SHAPE = re.compile(r"\b(pred|[sufc]\d+|bf16|f8e\w+)\[([\d,]*)\]")
_CALLEE = re.compile(r"\b(to_apply|calls|body|condition)=%?([\w.\-]+)")
_TRUE_FALSE = re.compile(r"\b(?:true|false)_computation=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


def shape_bytes(text: str) -> int:
    """Bytes of every array shape in a type string (a tuple type sums its elements)."""
    return sum(
        DTYPE_BYTES.get(d, 4) * math.prod(int(x) for x in dims.split(",") if x) for d, dims in _SHAPE.findall(text)
    )


def _dims(text: str) -> list[int]:
    m = _SHAPE.search(text)
    return [int(x) for x in m.group(2).split(",") if x] if m else []


@dataclass
class Instr:
    name: str
    result: str  # the result type text
    opcode: str
    rest: str  # operands and attributes


@dataclass
class HloStats:
    dot_flops: float
    collectives: dict[str, dict[str, float]]  # kind -> {"count", "bytes"}
    by_axes: dict[str, dict[str, float]]  # "kind over axes" -> {"count", "bytes"}
    loops: list[tuple[str, int]] = field(default_factory=list)  # (while body, trip count)
    largest: list[tuple[str, float, str]] = field(default_factory=list)  # (kind, bytes, JAX op) of the biggest ops
    by_op: dict[str, float] = field(default_factory=dict)  # "kind of JAX primitive" ("all-gather of top_k") -> bytes


def parse_computations(text: str) -> dict[str, list[Instr]]:
    comps: dict[str, list[Instr]] = {}
    current = None
    for line in text.splitlines():
        if current is None:
            if m := _HEADER.match(line):
                current = "ENTRY" if m.group(1) else m.group(2)
                comps[current] = []
            continue
        if line.strip() == "}":
            current = None
            continue
        if m := _INSTR.match(line):
            comps[current].append(Instr(m.group(2), m.group(3), m.group(4), m.group(5)))
    return comps


def _trip_count(instr: Instr, comps: dict[str, list[Instr]]) -> int:
    if m := re.search(r'"known_trip_count":\{"n":"(\d+)"', instr.rest):
        return int(m.group(1))
    cond = re.search(r"condition=%?([\w.\-]+)", instr.rest).group(1)
    constants = {i.name: i.rest for i in comps.get(cond, []) if i.opcode == "constant"}
    for i in comps.get(cond, []):
        if i.opcode == "compare" and "direction=LT" in i.rest:
            for name, value in constants.items():
                if f"%{name}" in i.rest or re.search(rf"\b{re.escape(name)}\b", i.rest):
                    return int(re.match(r"\s*(-?\d+)", value).group(1))
    return 0  # data-dependent


def _dot_dims(name: str, comps: dict[str, list[Instr]], types: dict[str, str], seen=None) -> list[set[int]]:
    """The operand and result dims of every matmul in a computation and what it calls."""
    seen = seen if seen is not None else set()
    if name in seen:
        return []
    seen.add(name)
    found = []
    for instr in comps.get(name, []):
        if instr.opcode in ("dot", "convolution"):
            found.append({d for dims in _operand_shapes(instr, types) for d in dims} | set(_dims(instr.result)))
        for _, callee in _CALLEE.findall(instr.rest):
            found += _dot_dims(callee, comps, types, seen)
    return found


def _size(name: str, comps: dict[str, list[Instr]], seen=None) -> int:
    """Instructions in a computation and everything it calls."""
    seen = seen if seen is not None else set()
    if name in seen:
        return 0
    seen.add(name)
    instrs = comps.get(name, [])
    return len(instrs) + sum(_size(c, comps, seen) for i in instrs for _, c in _CALLEE.findall(i.rest))


def multiplicities(
    comps: dict[str, list[Instr]], types: dict[str, str], dynamic_trips: DynamicTrips | None = None
) -> tuple[dict[str, int], list[tuple[str, int]]]:
    """How many times each computation runs per step, and the (body, trip count) of every loop.
    A loop whose trip count is data-dependent gets ``dynamic_trips`` of the dims its matmuls
    share (1 without it, as XLA counts)."""
    mult: dict[str, int] = defaultdict(int)
    loops = []

    def trip_count(instr: Instr) -> int:
        if trips := _trip_count(instr, comps):
            return trips
        body = re.search(r"body=%?([\w.\-]+)", instr.rest).group(1)
        dims = _dot_dims(body, comps, types)
        common = set.intersection(*dims) if dims else set()
        return dynamic_trips(common) if dynamic_trips and dims else 1

    def visit(name: str, times: int) -> None:
        mult[name] += times
        for instr in comps.get(name, []):
            trips = trip_count(instr) if instr.opcode == "while" else 1
            for key, callee in _CALLEE.findall(instr.rest):
                visit(callee, times * (trips if key == "body" else 1))
                if key == "body":
                    loops.append((callee, trips))
            m = _BRANCHES.search(instr.rest)
            branches = re.findall(r"%?([\w.\-]+)", m.group(1)) if m else _TRUE_FALSE.findall(instr.rest)
            if branches:  # data-dependent: count the branch that does least
                visit(min(branches, key=lambda b: _size(b, comps)), times)

    visit("ENTRY", 1)
    return dict(mult), loops


def _operand_shapes(instr: Instr, types: dict[str, str]) -> list[list[int]]:
    """Operand dims, looked up by name (optimized HLO prints operands without their types)."""
    names = re.findall(r"%([\w.\-]+)", instr.rest.split(")")[0])
    return [_dims(types.get(n, "")) for n in names]


def _dot_flops(instr: Instr, types: dict[str, str]) -> float:
    operands = _operand_shapes(instr, types)
    if instr.opcode == "dot":
        lhs = operands[0] if operands else []
        m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instr.rest)
        contracted = math.prod(lhs[int(i)] for i in m.group(1).split(",") if i) if m else 1
        return 2.0 * math.prod(_dims(instr.result)) * contracted
    # convolution: 2 x output elements x (kernel elements / output features)
    if len(operands) < 2:
        return 0.0
    kernel = operands[1]
    out = _dims(instr.result)
    return 2.0 * math.prod(out) * math.prod(kernel) / max(out[-1] if out else 1, 1)


def replica_groups(rest: str) -> list[list[int]] | None:
    if m := re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", rest):
        groups, size = int(m.group(1)), int(m.group(2))
        dims = [int(x) for x in m.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(4):
            ids = ids.transpose([int(x) for x in m.group(4).split(",")])
        return ids.reshape(groups, size).tolist()
    if m := re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", rest):  # mesh['a'=4,'b'=2] {'b'}
        axes = re.findall(r"'(\w+)'=(\d+)", m.group(1))
        names, dims = [a for a, _ in axes], [int(n) for _, n in axes]
        grouped = [names.index(a) for a in re.findall(r"'(\w+)'", m.group(2))]
        ids = np.arange(math.prod(dims)).reshape(dims)
        ids = ids.transpose([i for i in range(len(dims)) if i not in grouped] + grouped)
        return ids.reshape(-1, math.prod(dims[i] for i in grouped)).tolist()
    if m := re.search(r"replica_groups=\{(\{[\d,{} ]*\})\}", rest):
        return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
    if m := re.search(r"source_target_pairs=\{([\d,{} ]*)\}", rest):
        return [[int(x) for x in g.split(",")] for g in re.findall(r"\{(\d+,\d+)\}", m.group(1))]
    return None


def group_axes(groups: list[list[int]] | None, mesh_shape: dict[str, int]) -> str:
    """The mesh axes along which the devices of a group differ ("fsdp+expert"), or "all"/"?"."""
    names, sizes = list(mesh_shape), list(mesh_shape.values())
    if not groups:
        return "+".join(n for n, size in mesh_shape.items() if size > 1)
    varying = set()
    for g in groups:
        coords = np.array(np.unravel_index(np.array(g), sizes)).T
        varying |= {names[a] for a in range(len(names)) if len(set(coords[:, a])) > 1}
    return "+".join(n for n in names if n in varying) or "none"


def hlo_stats(text: str, mesh_shape: dict[str, int], dynamic_trips: DynamicTrips | None = None) -> HloStats:
    comps = parse_computations(text)
    types = {i.name: i.result for instrs in comps.values() for i in instrs}
    mult, loops = multiplicities(comps, types, dynamic_trips)
    flops = 0.0
    kinds = {k: {"count": 0, "bytes": 0.0} for k in COLLECTIVES}
    by_axes: dict[str, dict[str, float]] = {}
    largest: list[tuple[str, float, str]] = []
    by_op: dict[str, float] = {}
    for name, instrs in comps.items():
        times = mult.get(name, 0)
        if not times:
            continue
        for instr in instrs:
            if instr.opcode in ("dot", "convolution"):
                flops += times * _dot_flops(instr, types)
                continue
            kind = instr.opcode.removesuffix("-start")
            if kind not in COLLECTIVES:
                continue
            if kind == "reduce-scatter":
                nbytes = sum(
                    shape_bytes(types.get(n, "")) for n in re.findall(r"%([\w.\-]+)", instr.rest.split(")")[0])
                )
            elif instr.opcode.endswith("-start") and instr.result.startswith("("):
                nbytes = shape_bytes(instr.result) / 2  # (operand, result) pair of an async start
            else:
                nbytes = shape_bytes(instr.result)
            kinds[kind]["count"] += times
            kinds[kind]["bytes"] += times * nbytes
            key = f"{kind} over {group_axes(replica_groups(instr.rest), mesh_shape)}"
            entry = by_axes.setdefault(key, {"count": 0, "bytes": 0.0})
            entry["count"] += times
            entry["bytes"] += times * nbytes
            op = re.search(r'op_name="([^"]*)"', instr.rest)
            largest.append((kind, nbytes, op.group(1) if op else ""))
            primitive = f"{kind} of {(op.group(1) if op else '?').rsplit('/', 1)[-1]}"
            by_op[primitive] = by_op.get(primitive, 0.0) + times * nbytes
    largest = sorted(largest, key=lambda x: -x[1])[:LARGEST]
    return HloStats(flops, kinds, by_axes, loops, largest, by_op)
