"""Parameter counts, training FLOPs per token and state memory of a configured model, without allocating it.

    python tools/model_stats.py model_name=deepseek3-671b
    python tools/model_stats.py model_name=deepseek3-small --devices 8
    python tools/model_stats.py my_run.yml num_experts=64 --json

Arguments other than the flags are config arguments, as for training (``[extra.yml ...] key=value``).
Memory per device assumes the state is fully sharded over ``--devices`` (FSDP x expert parallelism).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # only shapes are traced: never claim an accelerator

from MaxText.config import Config, load_config_or_exit  # noqa: E402
from MaxText.models.accounting import (  # noqa: E402
    MemoryEstimate,
    ParamCounts,
    TrainFlops,
    count_parameters,
    memory_estimate,
    train_flops,
)
from MaxText.moe.expert_parallel import exchange_buffer_bytes  # noqa: E402
from MaxText.moe.experts import resolve_exchange  # noqa: E402

GB = 1e9


def exchange_stats(config: Config) -> dict | None:
    """The expert-parallel exchange's buffers per MoE layer and device, as they would be on GPU
    (dtype and ``moe_ep_comm`` resolved for it), when the config splits experts over devices."""
    ep = config.ici_expert_parallelism * config.dcn_expert_parallelism
    if ep <= 1:
        return None
    config = config.with_platform("gpu")
    exchange = resolve_exchange(config.moe_ep_comm, "gpu")
    tokens = config.per_device_batch_size * config.max_target_length
    stats = {"exchange": exchange, "ep": ep, "tokens_per_device": tokens, "dtype": config.dtype}
    if exchange != "te":  # Transformer Engine sizes its own buffers
        stats |= exchange_buffer_bytes(config, tokens, ep, exchange)
    return stats


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="*", help="Config arguments as for training ([extra.yml ...] key=value ...).")
    parser.add_argument("--json", action="store_true", help="Print one JSON object instead of the table.")
    parser.add_argument(
        "--devices",
        type=int,
        default=0,
        help="Also show memory per device, fully sharded over this many devices (default: %(default)s, none).",
    )
    args = parser.parse_args(argv)
    if args.devices < 0:
        parser.error("--devices must be >= 0")
    return args


def stats_dict(config: Config, counts: ParamCounts, flops: TrainFlops, memory: MemoryEstimate, devices: int) -> dict:
    """Everything the table shows, machine-readable (counts exact, bytes not rounded)."""
    stats = {
        "model_name": config.model_name,
        "total_params": counts.total,
        "active_params": counts.active,
        "mtp_params": counts.mtp,
        "mtp_active_params": counts.mtp_active,
        "train_flops_per_token": flops.total,
        "train_flops": {"matmul": flops.matmul, "attention": flops.attention, "mtp": flops.mtp},
        "seq_len": config.max_target_length,
        "components": counts.main,
        "mtp_components": {k: v for k, v in counts.mtp_parts.items() if v},
        "memory_bytes": {
            "weights": memory.weights,
            "gradients": memory.gradients,
            "optimizer": memory.optimizer,
            "total": memory.total,
        },
    }
    if devices:
        stats["devices"] = devices
        stats["memory_bytes_per_device"] = {k: v / devices for k, v in stats["memory_bytes"].items()}
    return stats


def _row(label: str, value: str, note: str = "") -> str:
    return f"  {label:<22}{value:>20}  {note}".rstrip()


def render(stats: dict, config: Config) -> str:
    """The human-readable report."""
    c = config
    total = stats["total_params"]
    lines = [
        f"{c.model_name}: {c.base_num_decoder_layers} layers ({c.first_num_dense_layers} dense + {c.num_moe_layers} MoE), "
        f"{c.num_experts} experts top-{c.num_experts_per_tok} + {c.shared_experts} shared, D {c.emb_dim}, "
        f"MTP depth {c.mtp_num_layers}",
        "",
        "parameters (main model)",
    ]
    lines += [_row(name, f"{n:,}", f"{100 * n / total:5.1f}%") for name, n in stats["components"].items()]
    lines += [
        _row("total", f"{total:,}"),
        _row("active per token", f"{stats['active_params']:,}", f"{100 * stats['active_params'] / total:5.1f}%"),
    ]
    if stats["mtp_params"]:
        lines += ["", "MTP modules (unique weights; embedding and head are shared)"]
        lines += [_row(name, f"{n:,}") for name, n in stats["mtp_components"].items()]
        lines += [
            _row("total", f"{stats['mtp_params']:,}"),
            _row("active per token", f"{stats['mtp_active_params']:,}"),
        ]
    f = stats["train_flops"]
    lines += [
        "",
        f"training FLOPs per token at sequence length {stats['seq_len']}",
        _row("6 x active non-embed", f"{f['matmul'] / 1e9:,.1f}", "GFLOP"),
        _row("causal attention", f"{f['attention'] / 1e9:,.1f}", "GFLOP"),
        _row("main model", f"{(f['matmul'] + f['attention']) / 1e9:,.1f}", "GFLOP"),
        _row("MTP", f"{f['mtp'] / 1e9:,.1f}", "GFLOP"),
        _row("total", f"{stats['train_flops_per_token'] / 1e9:,.1f}", "GFLOP"),
        "",
        f"training state in GB (weights in {c.weight_dtype}; activations not included)",
    ]
    per_device = stats.get("memory_bytes_per_device")
    for name, nbytes in stats["memory_bytes"].items():
        note = f"{per_device[name] / GB:,.2f} per device of {stats['devices']}" if per_device else ""
        lines.append(_row(name if name != "optimizer" else "Adam moments", f"{nbytes / GB:,.2f}", note))
    if x := stats.get("expert_parallel_exchange"):
        lines += [
            "",
            f"expert-parallel exchange per MoE layer and device ({x['exchange']}, ep {x['ep']}, "
            f"{x['tokens_per_device']:,} tokens per device, {x['dtype']})",
        ]
        if x["exchange"] == "allgather":
            lines.append(_row("buffers", f"{x['buffer_bytes'] / GB:,.2f}", "GB: the group's tokens, gathered"))
        elif "buffer_bytes" in x:
            lines += [
                _row(
                    "buffers",
                    f"{x['buffer_bytes'] / GB:,.2f}",
                    f"GB: {x['rows_per_pair']:,} rows per pair, "
                    f"up to {x['rounds']} rounds (moe_ep_buffer_factor {c.moe_ep_buffer_factor})",
                ),
                _row("worst case, one round", f"{x['worst_case_bytes'] / GB:,.2f}", "GB"),
            ]
            if "inside_rows_per_pair" in x:  # the two-hop exchange: the figures above are across nodes
                lines.append(
                    _row(
                        "hop inside a node",
                        f"{x['inside_rows_per_pair']:,}",
                        f"rows per pair, up to {x['inside_rounds']} rounds",
                    )
                )
        else:
            lines.append("  sized by Transformer Engine (its dropless receive capacity)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    loaded = load_config_or_exit(args.config)
    config = loaded.with_platform("cpu")
    counts = count_parameters(config)
    stats = stats_dict(config, counts, train_flops(config, counts), memory_estimate(config), args.devices)
    if exchange := exchange_stats(loaded):
        stats["expert_parallel_exchange"] = exchange
    print(json.dumps(stats) if args.json else render(stats, config))


if __name__ == "__main__":
    main()
