"""A parallel layout: how many ways each mesh axis splits, inside and across NVLink domains.

The axes are the repository's mesh axes (``MaxText/parallel/axes.py``: stage, data, fsdp, expert,
tensor); a pipeline over ``stage`` is timed as Megatron-LM's interleaved 1F1B for Megatron's stacks, the
repository's own schedule (``MaxText/parallel/pipeline.py``; ``circular.py``) for its own.
Each axis has an ``ici`` part inside one NVLink domain and a ``dcn`` part across domains, as in
``MaxText/parallel/mesh.py``: a collective over a set of axes spans ``prod(ici)`` GPUs in each of
``prod(dcn)`` domains.

A Megatron-LM layout (TP, PP, VPP, EP, DP) maps onto these axes: TP = tensor, EP = expert, PP =
stage, and its data parallelism outside EP = data; its ranks fill a domain in the order tensor,
expert, data, stage (``megatron``).

Batch terms: ``mbs`` is sequences per model replica (a tensor x stage group) per micro-batch, as
Megatron's micro-batch size; ``gbs`` sequences per optimizer step. The repository's
``per_device_batch_size`` is ``mbs / tensor`` and ``gradient_accumulation_steps`` the number of
micro-batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from MaxText.config import ConfigError
from MaxText.parallel.axes import MESH_AXES, parallelism_key

REMAT_POLICIES = ("none", "minimal", "names", "full")  # the repository's remat_policy values
MODELLED_REMAT = (*REMAT_POLICIES, "selective")  # + Megatron's selective recompute


@dataclass(frozen=True)
class Layout:
    ici: dict[str, int]  # axis -> ways inside a domain
    dcn: dict[str, int]  # axis -> ways across domains
    mbs: int  # sequences per model replica per micro-batch
    gbs: int  # sequences per optimizer step
    remat: str = "full"
    vpp: int = 1  # virtual pipeline stages per GPU (interleaved 1F1B)
    experts_over_tensor: bool = False  # experts spread over the tensor ranks too (Megatron ETP 1)

    def size(self, *axes: str) -> int:
        return math.prod(self.ici.get(a, 1) * self.dcn.get(a, 1) for a in axes)

    def local(self, *axes: str) -> int:
        """GPUs of a group over ``axes`` inside one domain."""
        return math.prod(self.ici.get(a, 1) for a in axes)

    def domains(self, *axes: str) -> int:
        """Domains a group over ``axes`` spans."""
        return math.prod(self.dcn.get(a, 1) for a in axes)

    @property
    def num_gpus(self) -> int:
        return self.size(*MESH_AXES)

    @property
    def tp(self) -> int:
        return self.size("tensor")

    @property
    def pp(self) -> int:
        return self.size("stage")

    @property
    def ep_axes(self) -> tuple[str, ...]:
        """The axes of the expert-parallel (dispatch) group."""
        return ("expert", "tensor") if self.experts_over_tensor else ("expert",)

    @property
    def ep(self) -> int:
        return self.size(*self.ep_axes)

    @property
    def expert_shards(self) -> int:
        """Ways each routed expert's weights are split by model parallelism (not FSDP)."""
        return self.ep * self.pp * (1 if self.experts_over_tensor else self.tp)

    @property
    def replicas(self) -> int:
        """Data-parallel model replicas (everything but tensor and stage)."""
        return self.num_gpus // (self.tp * self.pp)

    @property
    def microbatches(self) -> int:
        return self.gbs // (self.mbs * self.replicas)

    @property
    def runnable(self) -> bool:
        """The repository has its remat policy and a whole per-device batch (a pipelined layout
        also needs its stack to split: ``Estimate.not_runnable_reason``)."""
        return self.mbs % self.tp == 0 and self.remat in REMAT_POLICIES

    def check(self, num_experts: int, heads: int, kv_heads: int) -> None:
        """The split rules a layout must meet before it is costed (ConfigError naming the rule)."""
        for part in (self.ici, self.dcn):
            for axis, ways in part.items():
                if axis not in MESH_AXES or ways < 1:
                    raise ConfigError(f"layout: '{axis}' must be a mesh axis with >= 1 ways, got {ways}")
        if num_experts % self.ep:
            raise ConfigError(f"layout: num_experts ({num_experts}) is not divisible by expert parallelism ({self.ep})")
        if heads % self.tp or kv_heads % self.tp:
            raise ConfigError(f"layout: tensor parallelism {self.tp} does not divide the heads ({heads}, {kv_heads})")
        if self.mbs < 1 or self.gbs < 1 or self.gbs % (self.mbs * self.replicas):
            raise ConfigError(
                f"layout: global batch {self.gbs} is not a multiple of micro-batch {self.mbs} x {self.replicas} replicas"
            )
        if self.remat not in MODELLED_REMAT:
            raise ConfigError(f"layout: remat must be one of {MODELLED_REMAT}, got '{self.remat}'")
        if self.vpp < 1 or (self.vpp > 1 and self.pp == 1):
            raise ConfigError("layout: virtual pipeline stages need pipeline parallelism")

    def describe(self) -> str:
        parts = []
        for short, axes in (
            ("TP", ("tensor",)),
            ("PP", ("stage",)),
            ("EP", self.ep_axes),
            ("FSDP", ("fsdp",)),
            ("DP", ("data",)),
        ):
            if self.size(*axes) > 1:
                split = f"({self.local(*axes)}x{self.domains(*axes)})" if self.domains(*axes) > 1 else ""
                parts.append(f"{short}{self.size(*axes)}{split}")
        if self.vpp > 1:
            parts.insert(2, f"VPP{self.vpp}")
        return " ".join(parts or ["1 GPU"]) + f" mbs {self.mbs} gbs {self.gbs} remat {self.remat}"

    def overlay(self) -> dict[str, int | str]:
        """The layout as base.yml keys (runnable layouts only). Pipelined, the micro-batches are the
        pipeline's (one batch of ``gbs`` per step cut into them), not gradient accumulation."""
        if not self.runnable:
            raise ConfigError(f"layout: {self.describe()} is not one this repository runs; no overlay to write")
        keys: dict[str, int | str] = {}
        for axis in MESH_AXES:
            keys[parallelism_key("ici", axis)] = self.ici.get(axis, 1)
            keys[parallelism_key("dcn", axis)] = self.dcn.get(axis, 1)
        if self.pp > 1:
            keys["per_device_batch_size"] = self.gbs // self.num_gpus
            keys["gradient_accumulation_steps"] = 1
            keys["num_pipeline_microbatches"] = self.microbatches
            keys["num_pipeline_repeats"] = self.vpp
        else:
            keys["per_device_batch_size"] = self.mbs // self.tp
            keys["gradient_accumulation_steps"] = self.microbatches
        keys["remat_policy"] = self.remat
        return keys


def megatron(
    num_gpus: int, domain: int, tp: int, pp: int, ep: int, mbs: int, gbs: int, vpp: int = 1, remat: str = "selective"
) -> Layout:
    """A Megatron-LM layout, its ranks filling each domain in the order tensor, expert, data, stage."""
    over_tensor = num_gpus % (tp * pp * ep) != 0  # EP carved out of TP x DP (expert tensor parallel 1)
    expert = ep // tp if over_tensor else ep
    if ep % (tp if over_tensor else 1) or num_gpus % (tp * pp * expert):
        raise ConfigError(f"layout: {num_gpus} GPUs cannot be split into TP{tp} x PP{pp} x EP{ep}")
    sizes = {"tensor": tp, "expert": expert, "data": num_gpus // (tp * pp * expert), "stage": pp}
    ici, dcn, room = {}, {}, domain
    for axis in ("tensor", "expert", "data", "stage"):
        inside = math.gcd(sizes[axis], room)
        ici[axis], dcn[axis] = inside, sizes[axis] // inside
        room //= inside
    return Layout(ici, dcn, mbs, gbs, remat, vpp, experts_over_tensor=over_tensor)
