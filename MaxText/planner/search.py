"""Enumerate the layouts the repository can run, cost each, rank them, and say why the others lose.

Legal means what the repository itself would accept: the mesh ``MaxText/parallel/mesh.py``
``mesh_shape`` builds from the ``ici_*``/``dcn_*`` keys (each ``ici`` product inside one NVLink
domain), expert parallelism dividing ``num_experts``, tensor parallelism dividing the heads, and
every parameter split by ``logical_axis_rules`` dividing its dim (``sharding.parameter_mesh_axes``,
applied in ``memory.sharded_state_bytes``). A legal layout that does not fit in HBM is kept in the
count of rejects with its reason. Data parallelism is searched across domains only (inside one, fsdp
moves the same NVLink traffic and saves memory). Pipeline layouts (``stage`` > 1) are only costed on request, to say
what pipelining would gain; they are never the runnable winner.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import partial

from MaxText.config import ConfigError
from MaxText.planner.constants import Stack
from MaxText.planner.estimate import Estimate, estimate
from MaxText.planner.layout import Layout
from MaxText.planner.model import ModelSpec
from MaxText.planner.systems import System

PER_DEVICE_BATCHES = (1, 2, 4, 8)
SEARCH_REMAT = ("full", "minimal", "names")  # names: this repository's stacks and models only
PIPELINE_REMAT = (*SEARCH_REMAT, "selective")  # Megatron's policy too, for its stacks' pipelines
PIPELINE_DEGREES = (2, 4, 8)
VIRTUAL_STAGES = (1, 4)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_mesh(spec: ModelSpec, layout: Layout) -> None:
    """The repository's own mesh rules (``mesh_shape``) on this layout's keys."""
    if spec.config is None:
        return
    from MaxText.parallel.mesh import mesh_shape

    mesh_shape(spec.config.model_copy(update=layout.overlay()), layout.num_gpus)


@dataclass
class SearchResult:
    ranked: list[Estimate]  # fitting layouts, best first
    rejected: dict[str, int]  # reason -> count
    pipelined: Estimate | None  # the best modelled pipeline layout, if asked


def candidates(spec: ModelSpec, system: System, num_gpus: int, gbs: int, pipeline: bool = False):
    domain = system.domain_gpus(num_gpus)
    racks = num_gpus // domain
    stages = (1, *PIPELINE_DEGREES) if pipeline else (1,)
    for pp, t in itertools.product(stages, (1, 2, 4, 8)):
        if domain % t or spec.heads % t or spec.kv_heads % t or racks % pp and domain % (pp * t):
            continue
        pp_ici = 1 if racks % pp == 0 else pp  # stages across racks when they divide, else inside
        pp_dcn = pp // pp_ici
        rest_i = domain // (t * pp_ici)
        for e_i in _divisors(rest_i):
            f_i = rest_i // e_i
            for e_d in _divisors(racks // pp_dcn):
                if spec.num_experts % (e_i * e_d):
                    continue
                for f_d in _divisors(racks // (pp_dcn * e_d)):
                    d_d = racks // (pp_dcn * e_d * f_d)
                    ici = {"tensor": t, "expert": e_i, "fsdp": f_i, "stage": pp_ici}
                    dcn = {"expert": e_d, "fsdp": f_d, "data": d_d, "stage": pp_dcn}
                    for b, remat in itertools.product(PER_DEVICE_BATCHES, PIPELINE_REMAT if pp > 1 else SEARCH_REMAT):
                        mbs = b * t
                        replicas = num_gpus // (t * pp)
                        if gbs % (mbs * replicas):
                            continue
                        for vpp in VIRTUAL_STAGES if pp > 1 else (1,):
                            yield Layout(ici, dcn, mbs, gbs, remat, vpp)


def search(
    spec: ModelSpec,
    system: System,
    stack: Stack,
    num_gpus: int,
    gbs: int,
    precision: str = "bf16",
    exchange_buffer_factor: float = 2.0,
    pipeline: bool = False,
    fp8_kernels: str = "fused",
) -> SearchResult:
    ranked, pipelined, rejected = [], [], {}
    for layout in candidates(spec, system, num_gpus, gbs, pipeline):
        if layout.remat == "names" and not (stack.runs_here and spec.config is not None):
            continue
        try:
            if layout.pp == 1:
                _check_mesh(spec, layout)
            est = estimate(spec, layout, system, stack, precision, exchange_buffer_factor, False, fp8_kernels)
        except ConfigError as err:
            reason = (
                str(err).split(":")[0] + ": " + ("split does not divide" if "split" in str(err) else "illegal mesh")
            )
            rejected[reason] = rejected.get(reason, 0) + 1
            continue
        if not est.fits:
            rejected["does not fit in HBM"] = rejected.get("does not fit in HBM", 0) + 1
            continue
        if layout.pp == 1 and est.split_problem:  # a split this repository's own path cannot run
            rejected["split not runnable here"] = rejected.get("split not runnable here", 0) + 1
            continue
        (ranked if layout.pp == 1 else pipelined).append(est)
    ranked = _rank(ranked)
    pipelined.sort(key=lambda e: (not e.runnable, -e.tflops))  # what the repository runs first
    again = partial(estimate, spec, system=system, stack=stack, precision=precision, fp8_kernels=fp8_kernels)
    top = [again(layout=e.layout, exchange_buffer_factor=exchange_buffer_factor) for e in ranked[:5]]
    best_pp = again(layout=pipelined[0].layout, exchange_buffer_factor=exchange_buffer_factor) if pipelined else None
    return SearchResult(top + ranked[5:], rejected, best_pp)


TIE = 0.005  # layouts within 0.5% of the best are a tie: the model is not that precise


def _rank(fitting: list[Estimate]) -> list[Estimate]:
    """Fastest first; among those tied with the fastest, the simplest (fewest tensor ways and
    micro-batches) with the most memory headroom wins."""
    if not fitting:
        return []
    best = max(e.tflops for e in fitting)
    tied = [e for e in fitting if e.tflops >= best * (1 - TIE)]
    rest = [e for e in fitting if e.tflops < best * (1 - TIE)]
    tied.sort(key=lambda e: (e.layout.tp, e.layout.microbatches, e.memory["total"]))
    return tied + sorted(rest, key=lambda e: -e.tflops)


TERMS = ("compute", "dispatch", "tensor", "fsdp", "dp", "pipeline", "bubble")


def _terms(e: Estimate) -> dict[str, float]:
    exposed = e.exposed
    in_step = e.compute_time + exposed["dispatch"] + exposed["tensor"] + exposed["pipeline"] + exposed["fsdp"]
    return {
        "compute": e.compute_time,
        "dispatch": exposed["dispatch"],
        "tensor": exposed["tensor"],
        "fsdp": exposed["fsdp"],
        "dp": exposed["dp"],
        "pipeline": exposed["pipeline"],
        "bubble": in_step * e.bubble,
    }


def why_loses(loser: Estimate, winner: Estimate) -> str:
    """The term that costs the loser most relative to the winner, per token."""
    tl, tw = 1 / loser.tokens_per_s, 1 / winner.tokens_per_s
    lt, wt = _terms(loser), _terms(winner)
    scale_l = loser.step_time * loser.tokens_per_s  # tokens per GPU per step
    scale_w = winner.step_time * winner.tokens_per_s
    deltas = {k: lt[k] / scale_l - wt[k] / scale_w for k in TERMS}
    worst = max(deltas, key=deltas.get)
    if tl <= tw * (1 + TIE):
        return (
            f"ties the winner ({100 * (tl / tw - 1):+.1f}% per token); the tie-break prefers the simpler, leaner layout"
        )
    return f"{100 * (tl / tw - 1):.1f}% slower per token, mostly {worst} (+{1e6 * deltas[worst]:.1f} us/token)"
