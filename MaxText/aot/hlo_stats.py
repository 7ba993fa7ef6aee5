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

Control flow that depends on the data costs a host round-trip on XLA:GPU (it reads a loop's
condition or a conditional's predicate on the host: a device-to-host copy and a stream
synchronisation) unless XLA can count the loop's trips or runs it inside a command buffer (a CUDA
graph decides it on the device: ``thunks.py``); ``host_syncs`` counts the rest per step, by named
scope. Two kinds of such control flow are counted as balanced routing runs them: of a
``conditional`` only its cheapest branch (the expert-parallel overflow rounds run only when a
device pair overflows its slots), and a loop whose trip count is data-dependent (the blocked MoE
backend's loop over blocks) by a caller-supplied estimate (``dynamic_trips``).

Collective bytes are the full buffer of each op per device: the result of an all-gather,
all-reduce, all-to-all or collective-permute, the operand of a reduce-scatter, read from the
synchronous form (XLA:CPU) or the asynchronous ``-start`` form (XLA:GPU, whose tuple pairs the
operands with the results). A ``ragged-all-to-all``'s result is its whole receive buffer, of which
a balanced routing fills a part. Replica groups (explicit ``{{0,1},{2,3}}``, iota
``[G,S]<=[dims]T(perm)``, or a mesh ``mesh['a'=4,'b'=2] {'b'}`` over ``device_ids``) list
partition ids, i.e. positions in the mesh's device order, so the mesh axes an op spans are those
along which its group varies.

Matmul FLOPs on GPU also sit in custom calls: cuDNN's fused attention (``__cudnn$fmha*``) counts
as the matmuls a flash kernel runs, forward ``QK^T`` and ``PV``, backward ``QK^T`` again, ``dV``,
``dP``, ``dQ``, ``dK``, over the causal half when its mask is causal (it skips the masked blocks).
So do the grouped GEMM kernels of ``moe_matmul: tokamax`` (Mosaic GPU ``mosaic_gpu_v2`` or
Triton custom calls, told apart by tokamax's ragged-dot op in their op name): ``2 x rows x K x N``
from their operand and result shapes, where ``rows`` is how many of the layout's rows fall in the
groups, a runtime value; a caller-supplied estimate (``expert_rows``, balanced routing) gives it,
all rows without one. Other custom calls that look like matmuls (cuBLAS, cuDNN, GEMM) are listed
by target (``uncounted``), not guessed.
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
# (dims every matmul of a data-dependent loop has, dims any of them has) -> the loop's trip count
DynamicTrips = Callable[[set[int], set[int]], float]
# a grouped GEMM's rows (the layout's, padding included) -> the rows its groups cover (at most those)
ExpertRows = Callable[[int], float]
RAGGED_DOT_OP = "RaggedDot"  # in the op name of tokamax's ragged-dot kernels
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$")
_SHAPE = re.compile(r"\b(pred|[sufc]\d+|bf16|f8e\w+)\[([\d,]*)\]")
CALLEE = re.compile(r"\b(to_apply|calls|body|condition)=%?([\w.\-]+)")
_TRUE_FALSE = re.compile(r"\b(?:true|false)_computation=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
MATMUL_LIKE = re.compile(r"gemm|matmul|cublas|cudnn|conv|dot|fmha", re.I)  # custom calls that would do matmuls


# Instructions that launch no kernel: they move no bytes and take no time.
FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id", "replica-id"}


def branches(instr: Instr) -> list[str]:
    """A conditional's branch computations."""
    m = _BRANCHES.search(instr.rest)
    return re.findall(r"%?([\w.\-]+)", m.group(1)) if m else _TRUE_FALSE.findall(instr.rest)


def shape_bytes(text: str) -> int:
    """Bytes of every array shape in a type string (a tuple type sums its elements)."""
    return sum(
        DTYPE_BYTES.get(d, 4) * math.prod(int(x) for x in dims.split(",") if x) for d, dims in _SHAPE.findall(text)
    )


def tuple_elements(text: str) -> list[str]:
    """The top-level elements of a tuple type ``(a, (b, c))`` -> ``["a", "(b, c)"]``; a non-tuple
    type is its own single element."""
    text = text.strip()
    if not text.startswith("("):
        return [text]
    parts, depth, start = [], 0, 1
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 1:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start : len(text) - 1].strip())
    return [re.sub(r"^/\*index=\d+\*/", "", p) for p in parts if p]


def dims_of(text: str) -> list[int]:
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
    uncounted: dict[str, int] = field(default_factory=dict)  # custom-call target -> calls whose FLOPs are not counted
    flops_by_scope: dict[str, float] = field(default_factory=dict)  # named scope -> its matmul FLOPs
    # "kind of dtype" ("ragged-all-to-all of u8") -> {"count", "bytes"}: FP8 moves as bytes (u8)
    by_dtype: dict[str, dict[str, float]] = field(default_factory=dict)
    # where (a named scope, else the JAX op) -> {"while": data-dependent loops, "conditional": ...}, per step
    host_syncs: dict[str, dict[str, int]] = field(default_factory=dict)


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


def trip_count(instr: Instr, comps: dict[str, list[Instr]]) -> int:
    """A while loop's static trip count, 0 where the data decides it."""
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
            found.append({d for dims in _operand_shapes(instr, types) for d in dims} | set(dims_of(instr.result)))
        for _, callee in CALLEE.findall(instr.rest):
            found += _dot_dims(callee, comps, types, seen)
    return found


def _size(name: str, comps: dict[str, list[Instr]], seen=None) -> int:
    """Instructions in a computation and everything it calls."""
    seen = seen if seen is not None else set()
    if name in seen:
        return 0
    seen.add(name)
    instrs = comps.get(name, [])
    return len(instrs) + sum(_size(c, comps, seen) for i in instrs for _, c in CALLEE.findall(i.rest))


def multiplicities(
    comps: dict[str, list[Instr]], types: dict[str, str], dynamic_trips: DynamicTrips | None = None
) -> tuple[dict[str, int], list[tuple[str, int]]]:
    """How many times each computation runs per step, and the (body, trip count) of every loop.
    A loop whose trip count is data-dependent gets ``dynamic_trips`` of the dims its matmuls
    share and have (1 without it, as XLA counts)."""
    mult: dict[str, int] = defaultdict(int)
    loops = []

    def loop_trips(instr: Instr) -> int:
        if trips := trip_count(instr, comps):
            return trips
        body = re.search(r"body=%?([\w.\-]+)", instr.rest).group(1)
        dims = _dot_dims(body, comps, types)
        common = set.intersection(*dims) if dims else set()
        return dynamic_trips(common, set.union(*dims)) if dynamic_trips and dims else 1

    def visit(name: str, times: int) -> None:
        mult[name] += times
        for instr in comps.get(name, []):
            trips = loop_trips(instr) if instr.opcode == "while" else 1
            for key, callee in CALLEE.findall(instr.rest):
                visit(callee, times * (trips if key == "body" else 1))
                if key == "body":
                    loops.append((callee, trips))
            if found := branches(instr):  # data-dependent: count the branch that does least
                visit(min(found, key=lambda b: _size(b, comps)), times)

    visit("ENTRY", 1)
    return dict(mult), loops


def _operand_shapes(instr: Instr, types: dict[str, str]) -> list[list[int]]:
    """Operand dims, looked up by name (optimized HLO prints operands without their types)."""
    names = re.findall(r"%([\w.\-]+)", instr.rest.split(")")[0])
    return [dims_of(types.get(n, "")) for n in names]


def matmul_flops(instr: Instr, types: dict[str, str]) -> float:
    operands = _operand_shapes(instr, types)
    if instr.opcode == "dot":
        lhs = operands[0] if operands else []
        m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instr.rest)
        contracted = math.prod(lhs[int(i)] for i in m.group(1).split(",") if i) if m else 1
        return 2.0 * math.prod(dims_of(instr.result)) * contracted
    # convolution: 2 x output elements x (kernel elements / output features)
    if len(operands) < 2:
        return 0.0
    kernel = operands[1]
    out = dims_of(instr.result)
    return 2.0 * math.prod(out) * math.prod(kernel) / max(out[-1] if out else 1, 1)


def _braced(text: str, start: int) -> str:
    """The ``{...}`` group opening at ``text[start]``, braces inside it (layouts ``{3,2,1,0}``) matched."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start : i + 1]
    return text[start:]


def _fmha_flops(instr: Instr) -> float:
    """cuDNN fused attention's matmul FLOPs, from its operand shapes (layout BTNH: batch, length,
    heads, head dim for q, k and v, the first three operands)."""
    key = "operand_layout_constraints="
    start = instr.rest.find(key)
    if start < 0:
        return 0.0
    shapes = _braced(instr.rest, start + len(key))
    q, k, v = ([int(x) for x in dims.split(",") if x] for _, dims in _SHAPE.findall(shapes)[:3])
    B, S, H, dqk = q
    T, dv = k[1], v[3]
    pairs = (
        B * H * S * T * (S + 1) / (2 * S) if '"mask_type":"CAUSAL"' in instr.rest.replace(" ", "") else B * H * S * T
    )
    backward = _TARGET.search(instr.rest).group(1).endswith("Backward")
    return 2.0 * pairs * ((3 * dqk + 2 * dv) if backward else (dqk + dv))


def _ragged_dot_flops(instr: Instr, expert_rows: ExpertRows | None) -> float:
    """A grouped GEMM's FLOPs from its two floating-point operands and its result: [M, K] x
    [G, K, N] (or [G, N, K]) -> [M, N] (forward, input gradient), or [M, K] (or [K, M]) x [M, N]
    -> [G, K, N] (weight gradient); the M rows counted as ``expert_rows`` says."""
    key = "operand_layout_constraints="
    start = instr.rest.find(key)
    shapes = _SHAPE.findall(_braced(instr.rest, start + len(key))) if start >= 0 else []
    floats = [[int(x) for x in dims.split(",") if x] for dtype, dims in shapes if not dtype.startswith(("s", "u"))]
    out = dims_of(instr.result)
    if len(floats) != 2 or len(out) not in (2, 3):
        return 0.0
    if len(out) == 2:
        M, N = out
        K = math.prod(floats[0]) // max(M, 1)
    else:
        _, K, N = out
        M = math.prod(floats[0]) // max(K, 1)
    rows = expert_rows(M) if expert_rows else M
    return 2.0 * rows * K * N


def custom_call_flops(instr: Instr, expert_rows: ExpertRows | None = None) -> float | None:
    """Matmul FLOPs of a custom call this module knows, None for one it does not."""
    target = _TARGET.search(instr.rest)
    if target and target.group(1).startswith("__cudnn$fmha"):
        return _fmha_flops(instr)
    if RAGGED_DOT_OP in op_name(instr):
        return _ragged_dot_flops(instr, expert_rows)
    return None


def replica_groups(rest: str) -> list[list[int]] | None:
    if m := re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", rest):
        groups, size = int(m.group(1)), int(m.group(2))
        dims = [int(x) for x in m.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(4):
            ids = ids.transpose([int(x) for x in m.group(4).split(",")])
        return ids.reshape(groups, size).tolist()
    mesh = r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?\s*\{([^}]*)\}"
    if m := re.search(mesh, rest):  # mesh['a'=4,'b'=2] {'b'}, over the devices 0.. or a permutation of them
        axes = re.findall(r"'(\w+)'=(\d+)", m.group(1))
        names, dims = [a for a, _ in axes], [int(n) for _, n in axes]
        grouped = [names.index(a) for a in re.findall(r"'(\w+)'", m.group(4))]
        ids = np.arange(math.prod(dims))
        if m.group(2):  # device_ids=([2,128]T(1,0)): an iota of that shape, transposed, flattened
            ids = ids.reshape([int(x) for x in m.group(2).split(",")])
            if m.group(3):
                ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        ids = ids.reshape(dims)
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


def collective_bytes(instr: Instr, types: dict[str, str]) -> tuple[str, float] | None:
    """(kind, bytes per device) of a collective (synchronous or the ``-start`` of an asynchronous
    one), None for any other instruction."""
    kind = instr.opcode.removesuffix("-start")
    if kind not in COLLECTIVES or instr.opcode.endswith("-done"):
        return None
    if kind == "reduce-scatter":  # the operands, named before the first ')'
        return kind, sum(shape_bytes(types.get(n, "")) for n in re.findall(r"%([\w.\-]+)", instr.rest.split(")")[0]))
    parts = tuple_elements(instr.result)
    if not instr.opcode.endswith("-start") or kind == "all-reduce" or len(parts) == 1:
        return kind, shape_bytes(instr.result)
    # async starts pair (operands, result): the result is last, a collective-permute's second
    return kind, shape_bytes(parts[1] if kind == "collective-permute" else parts[-1])


def element_type(instr: Instr) -> str:
    """The element type a collective moves (its result's; an async start's received part)."""
    parts = tuple_elements(instr.result)
    received = parts[1 if instr.opcode == "collective-permute-start" else -1] if len(parts) > 1 else instr.result
    m = re.match(r"\s*\(*\s*(\w+)\[", received)
    return m.group(1) if m else "?"


def op_name(instr: Instr) -> str:
    m = re.search(r'op_name="((?:[^"\\]|\\.)*)"', instr.rest)  # tokamax's op names hold escaped quotes
    return m.group(1) if m else ""


def hlo_stats(
    text: str,
    mesh_shape: dict[str, int],
    dynamic_trips: DynamicTrips | None = None,
    scopes: tuple[str, ...] = (),
    expert_rows: ExpertRows | None = None,
    host_decided: set[str] | None = None,
) -> HloStats:
    """FLOPs, collectives and loops of a compiled program; ``scopes`` names JAX named scopes
    (carried in each op's name) whose matmul FLOPs are also reported apart. ``host_decided``
    names the loops and conditionals the GPU runtime decides on the host (``thunks.py``; the
    others run inside command buffers): only those count as host round-trips (None: all)."""
    comps = parse_computations(text)
    types = {i.name: i.result for instrs in comps.values() for i in instrs}
    mult, loops = multiplicities(comps, types, dynamic_trips)
    flops = 0.0
    kinds = {k: {"count": 0, "bytes": 0.0} for k in COLLECTIVES}
    by_axes: dict[str, dict[str, float]] = {}
    largest: list[tuple[str, float, str]] = []
    by_op: dict[str, float] = {}
    uncounted: dict[str, int] = {}
    by_scope = dict.fromkeys(scopes, 0.0)
    by_dtype: dict[str, dict[str, float]] = {}
    # XLA:CPU prints fused matmuls (and often their fusions) without an op name: they take the
    # nearest caller's that has one (a loop's, for a flash attention block)
    callers = {
        callee: (comp, i) for comp, instrs in comps.items() for i in instrs for _, callee in CALLEE.findall(i.rest)
    }

    def caller_name(comp: str, depth: int = 0) -> str:
        if comp not in callers or depth > 32:
            return ""
        parent, instr = callers[comp]
        return op_name(instr) or caller_name(parent, depth + 1)

    host_syncs: dict[str, dict[str, int]] = {}
    for name, instrs in comps.items():
        times = mult.get(name, 0)
        if not times:
            continue
        for instr in instrs:
            data_dependent = instr.opcode == "conditional" or (instr.opcode == "while" and not trip_count(instr, comps))
            if data_dependent and (host_decided is None or instr.name in host_decided):
                where = op_name(instr) or caller_name(name)
                key = next((s for s in scopes if f"/{s}/" in where), _short(where))
                entry = host_syncs.setdefault(key, {"while": 0, "conditional": 0})
                entry[instr.opcode] += times
                continue
            if instr.opcode in ("dot", "convolution", "custom-call"):
                if instr.opcode == "custom-call":
                    counted = custom_call_flops(instr, expert_rows)
                else:
                    counted = matmul_flops(instr, types)
                target = _TARGET.search(instr.rest)
                key = target.group(1) if target else "?"
                if counted is None and MATMUL_LIKE.search(key):
                    uncounted[key] = uncounted.get(key, 0) + times
                flops += times * (counted or 0.0)
                where = op_name(instr) or caller_name(name)
                for scope in scopes:
                    if f"/{scope}/" in where:
                        by_scope[scope] += times * (counted or 0.0)
                continue
            found = collective_bytes(instr, types)
            if found is None:
                continue
            kind, nbytes = found
            kinds[kind]["count"] += times
            kinds[kind]["bytes"] += times * nbytes
            key = f"{kind} over {group_axes(replica_groups(instr.rest), mesh_shape)}"
            entry = by_axes.setdefault(key, {"count": 0, "bytes": 0.0})
            entry["count"] += times
            entry["bytes"] += times * nbytes
            entry = by_dtype.setdefault(f"{kind} of {element_type(instr)}", {"count": 0, "bytes": 0.0})
            entry["count"] += times
            entry["bytes"] += times * nbytes
            op = op_name(instr)
            largest.append((kind, nbytes, op))
            primitive = f"{kind} of {(op or '?').rsplit('/', 1)[-1]}"
            by_op[primitive] = by_op.get(primitive, 0.0) + times * nbytes
    largest = sorted(largest, key=lambda x: -x[1])[:LARGEST]
    return HloStats(flops, kinds, by_axes, loops, largest, by_op, uncounted, by_scope, by_dtype, host_syncs)


def _short(op: str) -> str:
    """An op name without its ``jit(...)`` prefix and transformation wrappers, for a report line."""
    parts = [p for p in op.split("/") if p and not p.startswith(("jit(", "jvp(", "transpose(", "checkpoint"))]
    return "/".join(parts[-3:]) or "?"
