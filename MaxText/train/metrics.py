"""Training metrics: throughput, model FLOPs utilisation, and where they are written.

MFU = achieved model TFLOP/s per device / the device's dense peak at the run's precision.
Peaks are dense (no sparsity) vendor figures; unknown devices (CPU, say) report ``mfu: null``.
"""

import json
from pathlib import Path
from typing import Any

# Dense peak TFLOP/s per GPU, by device-kind substring and precision. Order matters: "GB200"
# must be matched before "B200".
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("GB300", {"bf16": 2500.0, "fp8": 5000.0}),
    ("GB200", {"bf16": 2500.0, "fp8": 5000.0}),
    ("B200", {"bf16": 2250.0, "fp8": 4500.0}),
    ("H200", {"bf16": 989.0, "fp8": 1979.0}),
    ("H100", {"bf16": 989.0, "fp8": 1979.0}),
    ("H800", {"bf16": 989.0, "fp8": 1979.0}),  # the H100 die with NVLink cut to 400 GB/s
)
PRECISION_OF_DTYPE = {"bfloat16": "bf16", "float16": "bf16"}
# HBM per GPU in GB (vendor figures), matched the same way; tools/aot_compile.py checks against it.
HBM_GB: tuple[tuple[str, float], ...] = (
    ("GB300", 288.0),
    ("GB200", 186.0),
    ("B200", 180.0),
    ("H200", 141.0),
    ("H100", 80.0),
    ("H800", 80.0),
)

# Every metrics.jsonl line has at least these fields.
METRIC_FIELDS = (
    "step",
    "loss",
    "lm_loss",
    "aux_loss",
    "mtp_loss",
    "grad_norm",
    "learning_rate",
    "step_time_s",
    "tokens_per_s",
    "tflops_per_device",
    "mfu",
    "expert_load_max_over_mean",
    "expert_load_max_over_mean_per_layer",
    "dropped_tokens",
)


def hbm_gb(device_kind: str | None) -> float | None:
    """HBM of the first device kind named in ``device_kind`` (a kind, or a recipe's file name)."""
    return next((gb for name, gb in HBM_GB if device_kind and name.lower() in device_kind.lower()), None)


def peak_tflops(device_kind: str, dtype: str) -> float | None:
    precision = PRECISION_OF_DTYPE.get(dtype)
    for name, peaks in PEAK_TFLOPS:
        if name.lower() in device_kind.lower():
            return peaks.get(precision) if precision else None
    return None


def throughput(
    tokens_per_step: int, step_time_s: float, flops_per_token: float, num_devices: int, peak: float | None
) -> dict[str, float | None]:
    tokens_per_s = tokens_per_step / step_time_s
    tflops = flops_per_token * tokens_per_s / num_devices / 1e12
    return {
        "step_time_s": step_time_s,
        "tokens_per_s": tokens_per_s,
        "tflops_per_device": tflops,
        "mfu": tflops / peak if peak else None,
    }


class MetricsWriter:
    """metrics.jsonl (always), TensorBoard events (optional), and the loss plot at the end."""

    def __init__(self, output_dir: Path, tensorboard: bool):
        self.output_dir = output_dir
        self.jsonl = (output_dir / "metrics.jsonl").open("a")
        self.records: list[dict[str, Any]] = []
        self.tensorboard = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self.tensorboard = SummaryWriter(str(output_dir / "tensorboard"))

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.tensorboard:
            for key, value in record.items():
                if isinstance(value, list):  # per-layer figures: one curve per layer
                    for i, item in enumerate(value):
                        self.tensorboard.add_scalar(f"{key}/{i}", item, record["step"])
                elif key != "step" and value is not None:
                    self.tensorboard.add_scalar(key, value, record["step"])

    def close(self) -> Path | None:
        self.jsonl.close()
        if self.tensorboard:
            self.tensorboard.close()
        return plot_losses(self.records, self.output_dir / "loss.png") if self.records else None


def plot_losses(records: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key in ("loss", "lm_loss", "mtp_loss"):
        if any(r.get(key) for r in records):
            ax.plot(steps, [r[key] for r in records], label=key, marker="o" if len(steps) < 30 else None)
    evals = [r for r in records if r.get("eval_loss") is not None]
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], label="eval_loss", marker="s")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats)")
    ax.set_title(path.parent.name)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
