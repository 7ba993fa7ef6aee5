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
    "skipped",
    "skipped_steps",
    "data_wait_s",
    "device_memory_in_use_gb",
    "device_memory_peak_gb",
)


def gpu_name(device_kind: str | None) -> str | None:
    """The first GPU of ``PEAK_TFLOPS`` named in ``device_kind`` (a JAX device kind, or a recipe's
    file name): "NVIDIA GB200" is a GB200, not a B200."""
    return next((name for name, _ in PEAK_TFLOPS if device_kind and name.lower() in device_kind.lower()), None)


def hbm_gb(device_kind: str | None) -> float | None:
    """HBM of the GPU ``device_kind`` names (``gpu_name``)."""
    return dict(HBM_GB).get(gpu_name(device_kind))


def peak_tflops(device_kind: str, dtype: str) -> float | None:
    precision = PRECISION_OF_DTYPE.get(dtype)
    peaks = dict(PEAK_TFLOPS).get(gpu_name(device_kind))
    return peaks.get(precision) if peaks and precision else None


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
    """metrics.jsonl (always), TensorBoard events (optional), and the plots at the end."""

    def __init__(self, output_dir: Path, tensorboard: bool):
        self.output_dir = output_dir
        path = output_dir / "metrics.jsonl"
        cut = False
        if path.exists() and path.stat().st_size:
            with path.open("rb") as f:
                f.seek(-1, 2)  # the last byte only: the file grows with the run
                cut = f.read(1) != b"\n"
        self.jsonl = path.open("a")
        if cut:  # a run killed mid-line: its resumption starts on a line of its own
            self.jsonl.write("\n")
        self.records: list[dict[str, Any]] = []
        self.tensorboard = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self.tensorboard = SummaryWriter(str(output_dir / "tensorboard"))

    def write(self, record: dict[str, Any]) -> None:
        """A step's record, or an event's (an ``event`` key: a rollback, the goodput totals), which
        goes to metrics.jsonl only."""
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if "event" in record:
            return
        self.records.append(record)
        if self.tensorboard:
            for key, value in record.items():
                if isinstance(value, list):  # per-layer figures: one curve per layer
                    for i, item in enumerate(value):
                        self.tensorboard.add_scalar(f"{key}/{i}", item, record["step"])
                elif key != "step" and value is not None:
                    self.tensorboard.add_scalar(key, value, record["step"])

    def plot(self) -> list[Path]:
        """loss.png and expert_load.png (``plots.py``) of the steps logged so far."""
        from MaxText.train.plots import plot_expert_load, plot_losses

        if not self.records:
            return []
        written = [plot_losses(self.records, self.output_dir / "loss.png")]
        written.append(plot_expert_load(self.records, self.output_dir / "expert_load.png"))
        return [p for p in written if p is not None]

    def close(self) -> None:
        self.jsonl.close()
        if self.tensorboard:
            self.tensorboard.close()


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The records of ``run_dir/metrics.jsonl``, in file order.

    A cut-off last line (a run killed mid-write) is dropped; a bad line elsewhere is an error,
    since it means the file is not what the trainer wrote.
    """
    path = Path(run_dir) / "metrics.jsonl"
    lines = [(n, line) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    records = []
    for i, (n, line) in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}:{n}: not JSON ({err.msg})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{n}: not a JSON object")
        records.append(record)
    return records


def step_of(record: dict[str, Any]) -> int | None:
    """The record's step, or None for anything that is not a logged step."""
    step = record.get("step")
    if "event" in record or not isinstance(step, int) or isinstance(step, bool):
        return None
    return step


def step_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of logged steps, events (a rollback, the goodput totals) left out."""
    return [r for r in records if step_of(r) is not None]
