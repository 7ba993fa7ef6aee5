"""How much communication XLA:GPU's schedule hides behind computation, read from the scheduled HLO.

XLA:GPU issues a collective as a ``-start`` / ``-done`` pair and its latency-hiding scheduler moves
independent work between the two: that work runs while the collective moves its bytes. A pair
with nothing between them is marked synchronous (``"is_sync":true``) and hides nothing. For every
pair this module walks the schedule between start and done and credits the collective with the
time of the computation it passes:

- a collective's time is its bytes over the links it crosses, by the planner's bandwidth terms
  (``planner/comms.py``): all-gather and reduce-scatter hierarchically, ``(l-1)/l`` of the buffer
  over NVLink and ``(r-1)/(r l)`` over the network for a group of ``l`` GPUs in each of ``r``
  NVLink domains; all-reduce twice that; an all-to-all sends ``(n-1)/n`` of its buffer, the
  share for other domains over the network, both at once; a ``ragged-all-to-all`` only the rows
  balanced routing sends (``ragged_rows`` of its buffer's rows; ``inside_rows`` on the two-hop
  exchange's hop inside a domain). Links run at the planner's
  ``COLLECTIVE_EFFICIENCY``.
- a computation's time is a roofline: its matmul FLOPs at the planner's dense GEMM efficiency of
  the bfloat16 peak, or the bytes it reads and writes at the HBM bandwidth, whichever is longer;
  a loop counts its body times its trip count.
- collectives in flight at once share the computation between them evenly (each takes no more
  than it still needs), so two transfers cannot both hide behind the same microsecond.

The shares are estimates from a cost model, not measurements: XLA:GPU's own schedule decisions are
real, the durations on both sides are modelled. Each collective is put in one category by where
its op came from: the MoE block's expert-parallel ``shard_map`` (the expert exchange), the
vocabulary split's ``shard_map`` (the ``routed_experts`` and ``vocab_split`` named scopes mark
them in op names), and otherwise by kind (all-gathers: FSDP weight gathers; reduce-scatters: FSDP
gradient scatters; all-reduces: data-parallel gradient sums and statistics; the pipeline's
``stage_transfer`` scope: its stage transfers; other all-to-alls: reshards).
"""

from __future__ import annotations

import copy
import functools
import re
from dataclasses import asdict, dataclass, field

import numpy as np

from MaxText.aot.compute_time import compute_breakdown
from MaxText.aot.hlo_stats import (
    CALLEE,
    FREE,
    DynamicTrips,
    ExpertRows,
    Instr,
    branches,
    collective_bytes,
    custom_call_flops,
    dims_of,
    matmul_flops,
    multiplicities,
    op_name,
    parse_computations,
    replica_groups,
    shape_bytes,
    trip_count,
    tuple_elements,
)
from MaxText.layers.vocab_parallel import VOCAB_SCOPE
from MaxText.moe.expert_parallel import WEIGHTS_SCOPE
from MaxText.parallel.pipeline import TRANSFER_SCOPE
from MaxText.planner.comms import exchange_link_bytes, exchange_seconds, gather_link_bytes, link_seconds
from MaxText.planner.constants import GEMM_EFFICIENCY
from MaxText.planner.systems import System

CATEGORIES = (
    "expert exchange",
    "vocabulary split",
    "FSDP weight gathers",
    "FSDP gradient scatters",
    "all-reduces",
    "pipeline stage transfers",
    "reshards",
)


def category(kind: str, name: str) -> str:
    """A collective's category from its kind and JAX op name (a combined collective carries one of
    its ops' names; XLA:GPU gives ragged-all-to-all none, and only the exchange uses it). Inside
    the experts' ``shard_map`` an all-reduce other than the rounds' ``pmax`` sums the experts'
    weight gradients over the token axes (their FSDP gather there, and its transpose, run under
    the ``expert_weights`` scope), and inside the vocabulary split's the all-reduces sum
    the weights' gradients over the axes outside the group (and a few softmax statistics):
    gradient reductions, not token traffic."""
    in_experts = "/routed_experts/shard_map" in name and f"/{WEIGHTS_SCOPE}/" not in name
    if kind == "ragged-all-to-all" or (in_experts and (kind != "all-reduce" or name.endswith("pmax"))):
        return "expert exchange"
    if VOCAB_SCOPE in name and "shard_map" in name and kind != "all-reduce":  # "jvp(vocab_split)/shard_map" too
        return "vocabulary split"
    if TRANSFER_SCOPE in name:
        return "pipeline stage transfers"
    return {
        "all-gather": "FSDP weight gathers",
        "reduce-scatter": "FSDP gradient scatters",
        "all-reduce": "all-reduces",  # gradient sums over data parallelism (and token axes), statistics
    }.get(kind, "reshards")


@dataclass
class Share:
    count: float = 0.0  # collectives per step
    synchronous: float = 0.0  # of which XLA left nothing to overlap
    bytes: float = 0.0  # buffer bytes per step
    nvlink_bytes: float = 0.0  # bytes a GPU sends over NVLink per step (the planner's measure)
    network_bytes: float = 0.0  # and over the scale-out network
    seconds: float = 0.0  # modelled link time per step
    hidden_seconds: float = 0.0  # of it, behind computation

    @property
    def hidden(self) -> float:
        """The share of communication time hidden behind computation."""
        return self.hidden_seconds / self.seconds if self.seconds else 1.0


@dataclass
class OverlapReport:
    shares: dict[str, Share] = field(default_factory=dict)
    compute_seconds: float = 0.0  # the step's modelled computation time
    step_seconds: float = 0.0  # computation plus the communication left exposed
    # the shortest step any order of each computation's instructions would model: where it is
    # far below step_seconds a better order gains; where close, only fewer bytes or more
    # computation beside them do (``ScheduledProgram.overlap``)
    floor_seconds: float = 0.0
    compute: dict = field(default_factory=dict)  # compute_time.compute_breakdown: where the computation time goes

    @property
    def total(self) -> Share:
        total = Share()
        for s in self.shares.values():
            for k in ("count", "synchronous", "bytes", "nvlink_bytes", "network_bytes", "seconds", "hidden_seconds"):
                setattr(total, k, getattr(total, k) + getattr(s, k))
        return total

    def as_dict(self) -> dict:
        return {
            "shares": {k: {**asdict(v), "hidden": v.hidden} for k, v in self.shares.items()},
            "hidden": self.total.hidden,
            "compute_seconds": self.compute_seconds,
            "step_seconds": self.step_seconds,
            "floor_seconds": self.floor_seconds,
            "compute": self.compute,
        }


def _body(instr: Instr) -> str:
    """A while loop's body computation."""
    return re.search(r"body=%?([\w.\-]+)", instr.rest).group(1)


class _CostModel:
    def __init__(
        self,
        comps,
        types,
        trips,
        system: System,
        domain_of: np.ndarray,
        ragged_rows: int | None,
        expert_rows: ExpertRows | None = None,
        inside_rows: int | None = None,
    ):
        self.comps, self.types, self.trips, self.expert_rows = comps, types, trips, expert_rows
        self.inside_rows = inside_rows
        self.flops_per_s = system.peak_flops("bf16") * GEMM_EFFICIENCY["dense"]["bf16"]
        self.hbm, self.system = system.hbm_bw, system
        self.domain_of, self.ragged_rows = domain_of, ragged_rows
        self._flops: dict[str, float] = {}
        self._seconds: dict[str, float] = {}

    def flops(self, comp: str) -> float:
        """Matmul FLOPs of one run of a computation and what it calls (loops times their trips)."""
        if comp not in self._flops:
            self._flops[comp] = 0.0  # a cycle guard
            self._flops[comp] = sum(self.instr_flops(i) for i in self.comps.get(comp, []))
        return self._flops[comp]

    def instr_flops(self, instr: Instr) -> float:
        if instr.opcode in ("dot", "convolution"):
            return matmul_flops(instr, self.types)
        if instr.opcode == "custom-call":
            return custom_call_flops(instr, self.expert_rows) or 0.0
        if instr.opcode == "while":
            return self.trips.get(_body(instr), 1) * self.flops(_body(instr))
        return sum(self.flops(c) for key, c in CALLEE.findall(instr.rest) if key in ("calls", "to_apply"))

    def seconds(self, instr: Instr) -> float:
        """Modelled time of one top-level instruction of a scheduled computation."""
        if instr.opcode in FREE or instr.opcode.endswith("-done") or collective_bytes(instr, self.types):
            return 0.0
        if instr.opcode == "while":
            return self.trips.get(_body(instr), 1) * self.computation_seconds(_body(instr))
        if instr.opcode in ("call", "conditional"):
            called = [c for _, c in CALLEE.findall(instr.rest)] + branches(instr)
            times = [self.computation_seconds(c) for c in called]
            return min(times) if instr.opcode == "conditional" and times else sum(times)
        names = re.findall(r"%([\w.\-]+)", instr.rest.split(")")[0])
        operands = [shape_bytes(self.types.get(n, "")) for n in names]
        called = [c for key, c in CALLEE.findall(instr.rest) if key == "calls"]
        body = self.comps.get(called[0], []) if instr.opcode == "fusion" and called else [instr]
        read = [_bytes_read(body, i, size) for i, size in enumerate(operands)]
        if body and body[-1].opcode == "dynamic-update-slice":  # writes its update in place
            moved = 2 * (sum(read) - max(read))
        else:
            moved = shape_bytes(instr.result) + sum(read)
        return max(self.instr_flops(instr) / self.flops_per_s, moved / self.hbm)

    def leaves(self, comp: str = "ENTRY") -> tuple[dict[str, list], float]:
        """Every instruction that launches a kernel in one run of ``comp``, as
        ``computation_seconds`` walks them (loops times their trips, a conditional's cheaper
        branch): ``{name: [instr, runs per step, of them inside loops the data decides]}``, and
        the iterations of those loops per step."""
        found: dict[str, list] = {}
        iterations = 0.0

        def walk(name: str, times: float, decided_by_data: bool) -> None:
            nonlocal iterations
            for instr in self.comps.get(name, []):
                if instr.opcode in FREE or instr.opcode.endswith("-done"):
                    continue
                if instr.opcode == "while":
                    runs = times * self.trips.get(_body(instr), 1)
                    by_data = not trip_count(instr, self.comps)
                    iterations += runs if by_data else 0.0
                    walk(_body(instr), runs, decided_by_data or by_data)
                elif instr.opcode in ("call", "conditional"):
                    called = [c for _, c in CALLEE.findall(instr.rest)]
                    if taken := branches(instr):
                        called.append(min(taken, key=self.computation_seconds))
                    for callee in called:
                        walk(callee, times, decided_by_data)
                else:
                    leaf = found.setdefault(instr.name, [instr, 0.0, 0.0])
                    leaf[1] += times
                    leaf[2] += times if decided_by_data else 0.0

        walk(comp, 1.0, False)
        return found, iterations

    def computation_seconds(self, comp: str) -> float:
        if comp not in self._seconds:
            self._seconds[comp] = 0.0
            self._seconds[comp] = sum(self.seconds(i) for i in self.comps.get(comp, []))
        return self._seconds[comp]

    def collective_link(self, instr: Instr, kind: str, nbytes: float) -> tuple[float, float, float]:
        """``link`` for a collective instruction of ``kind`` moving a ``nbytes`` buffer."""
        rows = dims_of(tuple_elements(instr.result)[-1])[:1] or [0]
        return self.link(kind, nbytes, replica_groups(instr.rest), rows[0])

    def link(
        self, kind: str, nbytes: float, groups: list[list[int]] | None, rows: int = 0
    ) -> tuple[float, float, float]:
        """(NVLink bytes, network bytes, seconds) one GPU spends on a collective (``rows``: a
        ragged-all-to-all's buffer rows, of which it moves ``ragged_rows``, or ``inside_rows`` in a
        group inside one domain), by the planner's terms."""
        group = groups[0] if groups else list(range(len(self.domain_of)))
        n = len(group)
        if n <= 1:
            return 0.0, 0.0, 0.0
        r = len(set(self.domain_of[np.asarray(group)].tolist()))
        if kind in ("all-to-all", "ragged-all-to-all"):
            if kind == "ragged-all-to-all":  # its rows moved; a group inside one domain: the hop inside a node
                moved = self.inside_rows if r == 1 and self.inside_rows else self.ragged_rows
                nbytes *= min(1.0, moved / rows) if moved and rows else 1.0
            nvl, net = exchange_link_bytes(nbytes, n // r, n)
            return nvl, net, exchange_seconds(nvl, net, self.system)
        if kind == "collective-permute":
            nvl, net = (0.0, nbytes) if r > 1 else (nbytes, 0.0)
        else:  # an all-reduce is a reduce-scatter and an all-gather
            nvl, net = gather_link_bytes(nbytes * (2 if kind == "all-reduce" else 1), n // r, r)
        return nvl, net, link_seconds(nvl, net, self.system)


SLICING = ("dynamic-slice", "slice", "gather")


def _bytes_read(body: list[Instr], index: int, size: float) -> float:
    """Bytes a fused computation reads of its ``index``-th operand (``size`` bytes): only the
    slices where slicing ops are its only users (a layer's slice of a scan's stacked weights),
    directly or through bitcasts (views of the same bytes)."""
    if len(body) == 1:  # not a fusion: the instruction itself
        return shape_bytes(body[0].result) if body[0].opcode in SLICING and index == 0 else size
    param = next((i.name for i in body if i.opcode == "parameter" and re.match(rf"\s*{index}\)", i.rest)), None)
    if param is None:
        return size
    slices, views, seen = [], [param], {param}
    while views:
        name = views.pop()
        users = [i for i in body if re.search(rf"%{re.escape(name)}(?![\w.\-])", i.rest.split(")")[0])]
        if not users:  # the fusion's result is this view of the whole operand
            return size
        for user in users:
            if user.opcode == "bitcast":
                if user.name not in seen:
                    seen.add(user.name)
                    views.append(user.name)
            elif user.opcode in SLICING:
                slices.append(user)
            else:
                return size
    return min(size, sum(shape_bytes(u.result) for u in slices))


def _walk(
    instrs: list[Instr],
    model: _CostModel,
    times: float,
    shares: dict[str, Share],
    durations: dict[str, float] | None = None,
) -> float:
    """Stream one computation's schedule: each collective in flight takes an even part of each
    instruction's time until its done (XLA:GPU's collective pipeliner moves whole start/done pairs
    into the previous iteration: every done follows its start in the same computation in the
    recipes' programs). Returns the link time of one run of its collectives, and fills
    ``durations`` (when given) with each asynchronous one's time from start to end under the
    model: the time it spent in flight until its link time was covered (sharing the computation
    with others stretches it), plus what was left at its done."""
    link_per_run = 0.0
    in_flight: dict[str, list] = {}  # start name -> [category, link seconds, still to hide, time in flight]

    def spend(seconds: float, flights: dict[str, list]) -> None:
        while seconds > 1e-15 and (needy := [f for f in flights.values() if f[2] > 0]):
            part = seconds / len(needy)
            for f in needy:
                took = min(part, f[2])
                f[2] -= took
                f[3] += took * len(needy)  # its part arrives at 1/len(needy) of the instruction's pace
                seconds -= took

    def land(name: str, flight: list) -> None:
        share = shares.setdefault(flight[0], Share())
        share.hidden_seconds += times * (flight[1] - flight[2])
        if durations is not None:
            durations[name] = flight[3] + flight[2]

    for instr in instrs:
        if instr.opcode.endswith("-done"):
            source = re.findall(r"%([\w.\-]+)", instr.rest.split(")")[0])
            if source and source[0] in in_flight:
                land(source[0], in_flight.pop(source[0]))
            continue
        found = collective_bytes(instr, model.types)
        if found is None:
            spend(model.seconds(instr), in_flight)
            continue
        kind, nbytes = found
        cat = category(kind, op_name(instr))
        nvl, net, link = model.collective_link(instr, kind, nbytes)
        share = shares.setdefault(cat, Share())
        share.count += times
        share.bytes += times * nbytes
        share.nvlink_bytes += times * nvl
        share.network_bytes += times * net
        share.seconds += times * link
        link_per_run += link
        if not instr.opcode.endswith("-start") or '"is_sync":true' in instr.rest:
            share.synchronous += times
            continue
        in_flight[instr.name] = [cat, link, link, 0.0]
    for name, flight in in_flight.items():  # a start without its done here (none in the recipes' programs)
        land(name, flight)
    return link_per_run


@dataclass(frozen=True)
class CostInputs:
    """What the cost model needs besides a scheduled program: the ``system`` it runs on, the
    NVLink domain of each partition (``domain_of[p]``: the mesh's p-th device), the rows a
    ragged-all-to-all moves under balanced routing (``ragged_rows``; None: its whole buffer), the
    trips of loops the data decides (``dynamic_trips``), the rows a grouped GEMM kernel
    computes (``expert_rows``; ``hlo_stats.ExpertRows``) and, for the two-hop exchange, the rows
    its ragged-all-to-all inside one NVLink domain moves (``inside_rows``; None: ``ragged_rows``):
    its hop inside a node, where a node is the NVLink domain (8-GPU nodes)."""

    system: System
    domain_of: np.ndarray
    ragged_rows: int | None = None
    dynamic_trips: DynamicTrips | None = None
    expert_rows: ExpertRows | None = None
    inside_rows: int | None = None


class ScheduledProgram:
    """A scheduled GPU program read once under the cost model: what its schedule hides
    (``overlap``) and each instruction's modelled time as a profile for XLA (``latency_profile``)."""

    def __init__(self, text: str, inputs: CostInputs):
        comps = parse_computations(text)
        types = {i.name: i.result for instrs in comps.values() for i in instrs}
        self.mult, loops = multiplicities(comps, types, inputs.dynamic_trips)
        trips: dict[str, float] = {}
        for body, n in loops:
            trips.setdefault(body, n)
        self.model = _CostModel(
            comps,
            types,
            trips,
            inputs.system,
            inputs.domain_of,
            inputs.ragged_rows,
            inputs.expert_rows,
            inputs.inside_rows,
        )

    def scheduled(self) -> list[Instr]:
        return scheduled_instructions(self.model.comps)

    def latency_profile(self, contended: bool = False) -> str:
        """The cost model's time for every instruction the scheduler places, as the profile
        XLA:GPU's profile-guided latency estimator reads (a ``ProfiledInstructionsProto`` in text:
        ``costs { name: "fusion.12" cost_us: 41.5 }``, a collective under its ``-start``'s name).

        Without a profile the latency-hiding scheduler's own estimator gives every kernel about
        the same small cost and every collective the same latency, so it starts a large gather
        only a few kernels before its use. A profile measured on the GPU corrects that; this one
        says what the cost model says, so that a second compile is scheduled as if the model's
        costs were measured (``compile.profile_guided``).

        A collective's cost is its link time; ``contended``, its duration in this schedule under
        the model, as a GPU would measure it: its link time where it ran alone, longer where
        others in flight shared the computation under it (they share the links and the SMs), plus
        what its done still waited for. The scheduler counts each collective's overlap as if it ran
        alone; given the link times, it started the H100 recipe's FSDP gathers under the expert
        exchange's computation and left each layer's attention with nothing in flight
        (docs/aot_compile.md)."""
        durations = self._walked[2] if contended else {}
        lines = []
        for instr in self.scheduled():
            if found := collective_bytes(instr, self.model.types):
                seconds = durations.get(instr.name) or self.model.collective_link(instr, *found)[2]
            else:
                seconds = self.model.seconds(instr)
            lines.append(f'costs {{ name: "{instr.name}" cost_us: {seconds * 1e6:.3f} }}')
        return "\n".join(lines) + "\n"

    @functools.cached_property
    def _walked(self) -> tuple[dict[str, Share], float, dict[str, float]]:
        """Every computation that holds collectives walked once (``_walk``): the shares per
        category, the link time no order of its computation covers (the floor's part; a
        collective is hidden only by what runs between its start and its done in its own
        computation, shared with the others in flight) and each asynchronous collective's duration."""
        model, mult = self.model, self.mult
        shares: dict[str, Share] = {c: Share() for c in CATEGORIES}
        durations: dict[str, float] = {}
        uncoverable = 0.0
        for name, instrs in model.comps.items():
            if mult.get(name) and any(i.opcode.endswith("-start") or collective_bytes(i, model.types) for i in instrs):
                link = _walk(instrs, model, mult[name], shares, durations)
                uncoverable += mult[name] * max(0.0, link - model.computation_seconds(name))
        return shares, uncoverable, durations

    def overlap(self) -> OverlapReport:
        """The overlap of every asynchronous collective, and the step's modelled time."""
        model = self.model
        shares, uncoverable, _ = self._walked
        report = OverlapReport({k: copy.copy(v) for k, v in shares.items() if v.count})
        report.compute_seconds = model.computation_seconds("ENTRY")
        report.compute = compute_breakdown(model)
        exposed = report.total.seconds - report.total.hidden_seconds
        report.step_seconds = report.compute_seconds + exposed
        report.floor_seconds = report.compute_seconds + uncoverable
        return report


def scheduled_instructions(comps: dict[str, list[Instr]]) -> list[Instr]:
    """The instructions a schedule orders that launch work: not those inside fused kernels or
    reducers (the computations a fusion's ``calls=`` or a reduction's ``to_apply=`` names), nor
    the free ones and a collective's ``-done``."""
    inside = {
        callee
        for instrs in comps.values()
        for i in instrs
        for key, callee in CALLEE.findall(i.rest)
        if (key == "calls" and i.opcode == "fusion") or (key == "to_apply" and i.opcode != "call")
    }
    return [
        i
        for name, instrs in comps.items()
        if name not in inside
        for i in instrs
        if i.opcode not in FREE and not i.opcode.endswith("-done")
    ]


def overlap(text: str, inputs: CostInputs) -> OverlapReport:
    """The overlap of every asynchronous collective in a scheduled GPU program (``ScheduledProgram``)."""
    return ScheduledProgram(text, inputs).overlap()
