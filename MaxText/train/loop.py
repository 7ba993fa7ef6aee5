"""The training loop, in named steps: devices, mesh, data, model, optimizer, state, loop, outputs.

The state comes from the newest good checkpoint of the run when there is one (the same command
resumes), else it is created (with ``load_parameters_path``'s parameters for a warm start).
Checkpoints are saved every ``checkpoint_period`` steps, at the last step, and when SIGTERM or
SIGINT asks the run to stop (with several processes, at the next multiple of
``preemption_check_period``), after which the loop waits for the write and returns normally.

Only process 0 writes files. Metrics are fetched from the device every ``log_period`` steps
(and at the last step), so the loop never waits on the device in between. Every
``eval_interval`` steps the same ``eval_steps`` batches of the held-out split give ``eval_loss``
(the main head's cross-entropy, averaged over tokens), logged on that step's metrics line.
"""

import time
from dataclasses import dataclass
from pathlib import Path

import flax.linen as nn
import jax
from tqdm import tqdm

from MaxText.checkpointing import Checkpoints, load_moe_bias, load_parameters
from MaxText.config import Config, config_to_yaml
from MaxText.data.source import DataSource, make_data_source, make_eval_source
from MaxText.layers.attention_ops import check_attention
from MaxText.models.accounting import train_flops_per_token
from MaxText.models.deepseek import DeepSeekV3
from MaxText.moe.experts import check_backend, moe_context
from MaxText.parallel.mesh import make_mesh
from MaxText.parallel.sharding import axis_rules, batch_sharding, put_global_batch
from MaxText.quantization.quantize import check_quantization, gpu_compute_capability
from MaxText.train.metrics import MetricsWriter, peak_tflops, throughput
from MaxText.train.optimizer import make_optimizer
from MaxText.train.preemption import PreemptionWatch
from MaxText.train.state import StateSetup, abstract_train_state, create_train_state
from MaxText.train.step import jit_train_step, make_eval_step


@dataclass
class RunResult:
    output_dir: Path
    losses: dict[int, float]  # the loss at every logged step
    final_metrics: dict


def runtime_topology(config: Config) -> dict:
    devices = jax.devices()
    return {
        "num_processes": jax.process_count(),
        "num_devices": len(devices),
        "device_kind": devices[0].device_kind,
        "platform": devices[0].platform,
        "dtype": config.dtype,
    }


def evaluate(eval_fn, state, source: DataSource, start: dict, steps: int, sharding) -> float:
    """Token-averaged cross-entropy over ``steps`` batches read from ``start`` (the same batches each time)."""
    source.set_state(start)
    total, tokens = 0.0, 0
    for _ in range(steps):
        out = jax.device_get(eval_fn(state, put_global_batch(next(source), sharding)))
        total, tokens = total + float(out["lm_loss_sum"]), tokens + int(out["tokens"])
    return total / max(tokens, 1)


def log(message: str) -> None:
    if jax.process_index() == 0:
        print(message, flush=True)


def initial_state(
    model, config: Config, optimizer, mesh, checkpoints: Checkpoints | None, data
) -> tuple[StateSetup, int]:
    """(state and its shardings, steps already done): restored from the newest good checkpoint,
    which also rewinds the data iterator, or new (warm-started from ``load_parameters_path``: its
    parameters, and its MoE correction biases when it has them)."""
    abstract = abstract_train_state(model, config, optimizer, mesh)
    shardings = jax.tree.map(lambda leaf: leaf.sharding, abstract)
    if checkpoints is not None and (restored := checkpoints.restore_latest(abstract)) is not None:
        if restored.data_state:
            data.set_state(restored.data_state)
        log(f"resuming from {restored.path} (step {restored.step})")
        return StateSetup(restored.state, shardings), restored.step
    state, shardings = create_train_state(model, config, optimizer, mesh)
    if config.load_parameters_path:
        state = state.replace(params=load_parameters(config.load_parameters_path, abstract.params))
        if (bias := load_moe_bias(config.load_parameters_path, abstract.moe_bias)) is not None:
            state = state.replace(moe_bias=bias)  # routing depends on them as much as on the weights
        log(f"parameters loaded from {config.load_parameters_path}")
    return StateSetup(state, shardings), 0


def train(config: Config) -> RunResult:
    # ---- devices and config resolution ----
    config = config.with_platform(jax.devices()[0].platform)
    topology = runtime_topology(config)
    is_writer = jax.process_index() == 0
    output_dir = config.output_dir
    if is_writer:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "config.yml").write_text(config_to_yaml(config, topology))

    # ---- mesh and data (first, so that a bad layout or dataset stops the run before anything is compiled) ----
    check_backend(config, topology["platform"])
    check_quantization(config, topology["platform"], gpu_compute_capability(jax.devices()[0]))
    check_attention(config, topology["platform"])
    mesh = make_mesh(config)
    num_devices = topology["num_devices"]
    global_batch = config.global_batch_size(num_devices)
    data = make_data_source(config, global_batch, jax.process_index(), jax.process_count())
    eval_data = make_eval_source(config, global_batch, jax.process_index(), jax.process_count())

    # ---- model, optimizer, state (restored when the run has a checkpoint) ----
    model = DeepSeekV3(config)
    optimizer = make_optimizer(config)
    checkpoints = Checkpoints(output_dir / "checkpoints", config) if config.enable_checkpointing else None
    (state, state_shardings), done_steps = initial_state(model, config, optimizer, mesh, checkpoints, data)
    batch_shards = batch_sharding(mesh, config)
    step_fn = jit_train_step(model, config, optimizer, state_shardings, batch_shards)

    # ---- evaluation and accounting ----
    if eval_data is not None:
        eval_start = eval_data.get_state()
        eval_fn = jax.jit(make_eval_step(model, config), in_shardings=(state_shardings, batch_shards))
    tokens_per_step = global_batch * config.max_target_length
    flops_per_token = train_flops_per_token(config)
    peak = peak_tflops(topology["device_kind"], config.dtype)

    # ---- loop ----
    writer = MetricsWriter(output_dir, config.enable_tensorboard) if is_writer else None
    losses: dict[int, float] = {}
    record: dict = {}
    window_start, window_steps = time.perf_counter(), 0
    progress = tqdm(
        range(done_steps + 1, config.steps + 1),
        initial=done_steps,
        total=config.steps,
        desc="train",
        unit="step",
        disable=not is_writer,
        dynamic_ncols=True,
    )
    tokens_per_device = global_batch * config.max_target_length // num_devices // config.gradient_accumulation_steps
    with (
        jax.set_mesh(mesh),
        nn.logical_axis_rules(axis_rules(config)),
        moe_context(config, mesh, tokens_per_device),
        PreemptionWatch(config.preemption_check_period) as preemption,
    ):
        for step in progress:
            batch = put_global_batch(next(data), batch_shards)
            state, metrics = step_fn(state, batch)
            window_steps += 1
            eval_now = eval_data is not None and step % config.eval_interval == 0
            if step == 1 or step % config.log_period == 0 or step == config.steps or eval_now:
                metrics = {k: v.tolist() for k, v in jax.device_get(metrics).items()}
                now = time.perf_counter()
                step_time = (now - window_start) / window_steps
                window_start, window_steps = now, 0
                record = {
                    "step": step,
                    **metrics,
                    **throughput(tokens_per_step, step_time, flops_per_token, num_devices, peak),
                }
                if eval_now:
                    record["eval_loss"] = evaluate(
                        eval_fn, state, eval_data, eval_start, config.eval_steps, batch_shards
                    )
                    window_start = time.perf_counter()  # evaluation time is not training time
                losses[step] = metrics["loss"]
                progress.set_postfix(loss=f"{metrics['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
                if writer:
                    writer.write(record)
            stop = preemption.should_stop(step)
            if checkpoints is not None and (step % config.checkpoint_period == 0 or step == config.steps or stop):
                checkpoints.save(step, state, data.get_state(), config)
            if stop:
                progress.close()
                if checkpoints is not None:
                    checkpoints.wait()
                    log(f"stopped by {preemption.signal_name()} after step {step}; saved {checkpoints.step_path(step)}")
                else:
                    log(f"stopped by {preemption.signal_name()} after step {step}; checkpointing is off, nothing saved")
                break
    if checkpoints is not None:
        checkpoints.close()  # waits for the last write
    for source in (data, eval_data):
        if hasattr(source, "close"):
            source.close()
    plot = writer.close() if writer else None
    if is_writer:
        print(
            f"outputs in {output_dir}: config.yml, metrics.jsonl"
            + (", tensorboard/" if config.enable_tensorboard else "")
            + (f", {plot.name}" if plot else "")
        )
        if record:
            print(f"final loss {record['loss']:.4f} at step {record['step']}")
    return RunResult(output_dir, losses, record)
