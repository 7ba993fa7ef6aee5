"""The scale planner: memory, step time, TFLOPS/GPU and scaling of DeepSeek-V3 training layouts.

    python tools/plan.py model_name=deepseek3-671b --system gb200-nvl72 --gpus 256
    python tools/plan.py model_name=deepseek3-671b --system gb300-nvl72 --gpus 1024 --pipeline --emit-config plan.yml
    python tools/plan.py model_name=deepseek3-671b ici_expert_parallelism=64 dcn_fsdp_parallelism=-1 \\
        ici_fsdp_parallelism=1 --system gb200-nvl72 --gpus 256        # cost the layout the config names
    python tools/plan.py --arch qwen3-235b-a22b --system h100 --gpus 256 --stack megatron --tp 2 --pp 8 --vpp 4 --ep 32 --gbs 2048
    python tools/plan.py --calibrate                                 # published results vs the model

Arguments other than flags are config arguments, as for training. With no layout named (neither a
``*_parallelism`` key nor ``--tp/--pp/--ep``), the planner searches the layouts this repository can
run and prints the best few with why each loses. Bad input exits 2 with one line.

``--emit-config plan.yml`` writes the winner (or the named layout) as a flat YAML file of base.yml
keys: the mesh, the micro-batch, gradient accumulation, remat and, when pipelined, the pipeline
keys. A recipe takes it from the ``CONFIG`` environment variable, after its own arguments, so the
plan's keys win over the recipe's (and ``MAXTEXT_ARGS`` over both):

    CONFIG=plan.yml sbatch recipes/slurm/deepseek3-671b-gb200-nvl72.sbatch

A file rather than the keys pasted into ``MAXTEXT_ARGS`` or a recipe: it is written once, anywhere
(on the submit host, or on a Kubernetes volume where the pods read it, docs/kubernetes.md), it can
be reviewed and kept with the run, and it is also a valid overlay for ``python -m MaxText.train
plan.yml key=value ...``. That overlay ranks below every key=value argument (base.yml < model <
extra yml < key=value), which is why the recipes, whose layout is key=value, read it through
``CONFIG`` instead.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # only shapes are traced: never claim an accelerator

import yaml  # noqa: E402

from MaxText.config import ConfigError, load_config  # noqa: E402
from MaxText.planner.constants import DEFAULT_STACK, STACKS  # noqa: E402
from MaxText.planner.layout import MODELLED_REMAT  # noqa: E402
from MaxText.planner.systems import PRECISIONS, SYSTEMS  # noqa: E402

ARCHS = ("qwen3-235b-a22b",)


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse prints usage + message; one line is the contract
        raise ConfigError(f"arguments: {message}")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("config", nargs="*", help="The model and its batch: [extra.yml ...] key=value ..., as for training.")
    p.add_argument(
        "--system", choices=sorted(SYSTEMS), help="The GPU system to plan for (required unless --calibrate)."
    )
    p.add_argument("--gpus", type=int, help="The number of GPUs to plan for (required unless --calibrate).")
    p.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="bf16",
        help="The GEMMs' precision; attention stays bf16 (default: %(default)s).",
    )
    p.add_argument(
        "--fp8-kernels",
        choices=("emulated", "fused"),
        default="emulated",
        help="How FP8 GEMMs run: this repository's emulation (the default), or fused FP8 kernels as published.",
    )
    p.add_argument(
        "--stack",
        choices=sorted(STACKS),
        default=DEFAULT_STACK,
        help="The software stack to model (default: %(default)s).",
    )
    p.add_argument(
        "--exchange",
        choices=("all_to_all", "allgather", "hierarchical"),
        help="Cost the stack with another expert exchange, as a what-if (default: the stack's, or allgather where the config says so).",
    )
    p.add_argument("--arch", choices=ARCHS, help="A model the config cannot express, in the planner's own description.")
    p.add_argument(
        "--seq", type=int, default=4096, help="The sequence length of an --arch model (default: %(default)s)."
    )
    p.add_argument(
        "--tp", type=int, help="A Megatron-style layout's tensor parallelism (with --pp, --vpp, --ep, --mbs)."
    )
    p.add_argument("--pp", type=int, default=1, help="The layout's pipeline stages (default: %(default)s).")
    p.add_argument(
        "--vpp", type=int, default=1, help="The layout's virtual pipeline stages per GPU (default: %(default)s)."
    )
    p.add_argument("--ep", type=int, help="The layout's expert parallelism.")
    p.add_argument(
        "--mbs",
        type=int,
        default=1,
        help="Micro-batch sequences per model replica, with --tp/--ep (default: %(default)s).",
    )
    p.add_argument("--gbs", type=int, help="The global batch in sequences (default: the config's).")
    p.add_argument(
        "--remat",
        choices=MODELLED_REMAT,
        help="The rematerialisation policy to cost (default: the config's remat_policy).",
    )
    p.add_argument("--pipeline", action="store_true", help="Also model pipeline layouts and say what they would gain.")
    p.add_argument("--calibrate", action="store_true", help="Print published results beside the model's predictions.")
    p.add_argument("--json", action="store_true", help="Print one JSON object instead of the report.")
    p.add_argument(
        "--emit-config",
        type=Path,
        help="Write the best runnable layout to this file as a flat YAML overlay, which the recipes take as CONFIG=<file>.",
    )
    p.add_argument("--top", type=int, default=5, help="How many layouts to list (default: %(default)s).")
    args = p.parse_args(argv)
    if not args.calibrate:
        if args.system is None or args.gpus is None:
            raise ConfigError("arguments: --system and --gpus are required (or --calibrate)")
        if args.gpus < 1:
            raise ConfigError(f"arguments: --gpus must be >= 1, got {args.gpus}")
        if args.precision == "mxfp8" and not SYSTEMS[args.system].mxfp8:
            raise ConfigError(f"arguments: --precision mxfp8 needs Blackwell; {args.system} has no MXFP8 tensor cores")
    for name in ("pp", "vpp", "mbs", "top", "seq"):
        if getattr(args, name) < 1:
            raise ConfigError(f"arguments: --{name} must be >= 1")
    return args


def _layout_from_config(config, num_gpus: int, remat: str, gbs: int | None):
    from MaxText.parallel.axes import MESH_AXES
    from MaxText.parallel.mesh import mesh_shape
    from MaxText.planner.layout import Layout

    dcn, ici = mesh_shape(config, num_gpus)
    tp = ici[MESH_AXES.index("tensor")] * dcn[MESH_AXES.index("tensor")]
    micro = config.micro_batch_size(num_gpus)
    stages = config.pipeline_stages
    if stages > 1 and config.gradient_accumulation_steps > 1:
        raise ConfigError(
            "config key 'gradient_accumulation_steps': the planner costs a pipeline over one batch per step "
            "(each accumulated batch pays its own bubble); set it to 1 and raise per_device_batch_size"
        )
    # Megatron's terms: a micro-batch is a pipeline micro-batch (1/M of a batch, M per step).
    microbatches = config.pipeline_microbatches if stages > 1 else 1
    return Layout(
        dict(zip(MESH_AXES, ici, strict=True)),
        dict(zip(MESH_AXES, dcn, strict=True)),
        mbs=config.per_device_batch_size * tp * stages // microbatches,
        gbs=gbs or micro * config.gradient_accumulation_steps,
        remat=remat,
        vpp=config.num_pipeline_repeats if stages > 1 else 1,
    )


def run(args: argparse.Namespace) -> dict:
    from dataclasses import replace

    from MaxText.planner.calibration import held_out_points, ladder, run_all
    from MaxText.planner.estimate import estimate
    from MaxText.planner.layout import megatron
    from MaxText.planner.model import from_config, qwen3_235b
    from MaxText.planner.report import render_calibration, render_estimate, render_search
    from MaxText.planner.search import search

    if args.calibrate:
        rows = run_all()
        ladders = {p.name: ladder(p) for p in held_out_points()}
        return {"calibration": rows, "held_out_ladders": ladders, "text": render_calibration(rows, ladders)}

    config = load_config(["run_name=plan", *args.config]).with_platform("gpu")
    spec = qwen3_235b(args.seq) if args.arch else from_config(config)
    system, stack = SYSTEMS[args.system], STACKS[args.stack]
    if args.exchange or config.moe_ep_comm in ("allgather", "hierarchical"):  # the config's own exchange
        stack = replace(stack, exchange=args.exchange or config.moe_ep_comm)
    remat = args.remat or config.remat_policy
    gbs = args.gbs or config.global_batch_size(args.gpus)
    named = any("_parallelism" in a for a in args.config if "=" in a) or any(
        "_parallelism" in k
        for a in args.config
        if a.endswith((".yml", ".yaml"))
        for k in yaml.safe_load(Path(a).read_text()) or {}
    )
    if args.tp or args.ep or args.pp > 1:
        domain = system.domain_gpus(args.gpus)
        layout = megatron(args.gpus, domain, args.tp or 1, args.pp, args.ep or 1, args.mbs, gbs, args.vpp, remat)
    elif named:
        layout = _layout_from_config(config, args.gpus, remat, args.gbs)
    else:
        if spec.config is None:
            raise ConfigError("arguments: --arch models are costed with a given layout (--tp/--pp/--ep), not searched")
        result = search(
            spec,
            system,
            stack,
            args.gpus,
            gbs,
            args.precision,
            config.moe_ep_buffer_factor,
            args.pipeline,
            args.fp8_kernels,
        )
        out = {
            "ranked": [e.as_dict() for e in result.ranked[: args.top]],
            "rejected": result.rejected,
            "pipelined": result.pipelined.as_dict() if result.pipelined else None,
            "text": render_search(result, args.top),
        }
        if result.ranked:
            out["winner_overlay"] = result.ranked[0].layout.overlay()
        if result.pipelined and result.ranked:
            out["pipeline_gain"] = result.pipelined.tflops / result.ranked[0].tflops - 1
        return out
    est = estimate(
        spec, layout, system, stack, args.precision, config.moe_ep_buffer_factor, fp8_kernels=args.fp8_kernels
    )
    out = est.as_dict()
    out["text"] = render_estimate(est)
    if est.runnable:
        out["winner_overlay"] = layout.overlay()
    return out


def emit_config(args: argparse.Namespace, out: dict, argv: list[str]) -> None:
    """Write the layout as a flat YAML file of base.yml keys, headed by how it was made and how to use it."""
    overlay = out.get("winner_overlay")
    if overlay is None:
        raise ConfigError("arguments: --emit-config: no runnable layout to write")
    chosen = out["ranked"][0] if "ranked" in out else out
    header = [
        f"Layout planned by tools/plan.py for {args.gpus} x {args.system} ({args.precision}, stack {args.stack}):",
        f"{chosen['layout']}, {chosen['tflops_per_gpu']:.0f} predicted TFLOPS/GPU, "
        f"{chosen['memory_gb']['total']:.1f} GB per GPU.",
        "  python tools/plan.py " + shlex.join(argv),
        "Use it with the recipe of the same model; its keys win over the recipe's, MAXTEXT_ARGS over both:",
        f"  CONFIG={args.emit_config} sbatch recipes/slurm/<recipe>.sbatch",
        "  Kubernetes: copy it to the volume and set the CONFIG env entry to its path (docs/kubernetes.md)",
        f"or as an overlay (key=value arguments win over it): python -m MaxText.train {args.emit_config} ...",
    ]
    text = "".join(f"# {line}\n" for line in header) + yaml.safe_dump(overlay, sort_keys=False)
    args.emit_config.write_text(text)


def main(argv: list[str] | None = None) -> None:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        out = run(args)
        if args.emit_config:
            emit_config(args, out, sys.argv[1:] if argv is None else argv)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    text = out.pop("text")
    print(json.dumps(out) if args.json else text)


if __name__ == "__main__":
    main()
