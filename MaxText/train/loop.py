"""The training loop, in named steps: devices, mesh, data, model, optimizer, pre-flight memory
check, compile, state, loop, outputs.

The state comes from the newest good checkpoint of the run when there is one (the same command
resumes), else it is created (with ``load_parameters_path``'s parameters for a warm start).
Before it is, the train state's and then the compiled step's memory are checked against the
devices' (``preflight.py``; exit 2 with the figures). Checkpoints are saved every
``checkpoint_period`` steps, at the last step, and when SIGTERM or SIGINT asks the run to stop
(with several processes, at the next multiple of ``preemption_check_period``), after which the
loop waits for the write and returns normally; none is saved while steps are being skipped, so
the newest stays the last good state.

Only process 0 writes files. Each step's loss and skip flag are read one step late, while the
next step runs (``health.py``: the non-finite and loss-spike guards); the other metrics are
fetched every ``log_period`` steps (and at the last step). Every ``eval_interval`` steps the same
``eval_steps`` batches of the held-out split give ``eval_loss`` (the main head's cross-entropy,
averaged over tokens), logged on that step's metrics line. Wall time is accounted by category
(``goodput.py``), printed at the end and written as the last metrics record.
"""

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

import flax.linen as nn
import jax
from tqdm import tqdm

from MaxText.aot.compile import compile_for_devices
from MaxText.checkpointing import Checkpoints, load_moe_bias, load_parameters
from MaxText.checkpointing.local import LocalCheckpoints
from MaxText.checkpointing.tiers import restore_newest
from MaxText.config import Config, config_to_yaml
from MaxText.data.source import make_data_source, make_eval_source
from MaxText.data.types import DataSource
from MaxText.layers.attention_ops import check_attention
from MaxText.models.accounting import count_parameters_of, train_flops_per_token
from MaxText.models.deepseek import DeepSeekV3
from MaxText.moe.experts import check_backend, moe_context
from MaxText.parallel.distributed import wait_for_every_process
from MaxText.parallel.mesh import make_mesh
from MaxText.parallel.sharding import axis_rules, batch_sharding, put_global_batch
from MaxText.quantization.quantize import check_quantization, gpu_compute_capability
from MaxText.train.goodput import Goodput, device_memory_gb
from MaxText.train.goodput import render as render_goodput
from MaxText.train.health import Guards, TrainingHalted
from MaxText.train.metrics import MetricsWriter, peak_tflops, throughput
from MaxText.train.optimizer import make_optimizer
from MaxText.train.preemption import PreemptionWatch
from MaxText.train.preflight import abstract_batch, check_state_fits, check_step_fits, step_io_bytes
from MaxText.train.profiler import StepProfiler
from MaxText.train.state import TrainState, abstract_train_state, create_train_state
from MaxText.train.step import jit_train_step, make_eval_step
from MaxText.train.xla_memory import device_compiler_options


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
    model,
    config: Config,
    optimizer,
    mesh,
    abstract,
    checkpoints: Checkpoints | None,
    local: LocalCheckpoints | None,
    data,
    goodput: Goodput,
) -> tuple[TrainState, int]:
    """(state, steps already done): restored from the newest good checkpoint of either tier, which
    also rewinds the data iterator, or new (warm-started from ``load_parameters_path``: its
    parameters, and its MoE correction biases when it has them)."""
    if checkpoints is not None:
        with goodput.timing("restore"):
            restored = restore_newest(checkpoints, local, abstract)
        if restored is not None:
            if restored.data_state:
                data.set_state(restored.data_state)
            tier = "the node-local checkpoint" if local is not None and restored.path.is_relative_to(local.root) else ""
            log(f"resuming from {tier + ' ' if tier else ''}{restored.path} (step {restored.step})")
            return restored.state, restored.step
    with goodput.timing("startup"):
        state, _ = create_train_state(model, config, optimizer, mesh, abstract)
        if config.load_parameters_path:
            state = state.replace(params=load_parameters(config.load_parameters_path, abstract.params))
            if (bias := load_moe_bias(config.load_parameters_path, abstract.moe_bias)) is not None:
                state = state.replace(moe_bias=bias)  # routing depends on them as much as on the weights
            log(f"parameters loaded from {config.load_parameters_path}")
    return state, 0


def finish(
    goodput: Goodput,
    progress,
    profiler: StepProfiler,
    writer: MetricsWriter | None,
    tiers,
    sources,
    is_writer: bool,
) -> list[Path]:
    """Close the progress bar and the profiler's window, wait for the last checkpoint, close the
    data, write the plots and the goodput record (also when a guard stopped the run: what was
    written so far is kept)."""
    progress.close()
    with goodput.timing("profile"):
        profiler.close()
    with goodput.timing("checkpoint"):
        for tier in tiers:
            if tier is not None:
                tier.close()  # waits for the last write
    with goodput.timing("outputs"):
        for source in sources:
            if hasattr(source, "close"):
                source.close()
        outputs = writer.plot() if writer else []
    totals = goodput.record()
    if writer:
        writer.write(totals)
        writer.close()
    if is_writer:
        print(render_goodput(totals), flush=True)
    return outputs


@contextlib.contextmanager
def run_context(config: Config, mesh, tokens_per_device: int):
    """What tracing and running the step need: the mesh, the logical-axis rules, the MoE setup."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(axis_rules(config)), moe_context(config, mesh, tokens_per_device):
        yield


def train(config: Config) -> RunResult:
    goodput = Goodput()
    # ---- devices, config resolution, mesh, state size, data (a bad layout, size or dataset stops the run before anything is compiled) ----
    with goodput.timing("startup"):
        config = config.with_platform(jax.devices()[0].platform)
        topology = runtime_topology(config)
        is_writer = jax.process_index() == 0
        output_dir = config.output_dir
        if is_writer:
            output_dir.mkdir(parents=True, exist_ok=True)
            (output_dir / "config.yml").write_text(config_to_yaml(config, topology))
        check_backend(config, topology["platform"])
        check_quantization(config, topology["platform"], gpu_compute_capability(jax.devices()[0]))
        check_attention(config, topology["platform"])
        mesh = make_mesh(config)
        num_devices = topology["num_devices"]
        global_batch = config.global_batch_size(num_devices)

        # ---- model, optimizer, and the pre-flight memory check of the state (nothing allocated yet) ----
        model = DeepSeekV3(config)
        optimizer = make_optimizer(config)
        abstract = abstract_train_state(model, config, optimizer, mesh)
        check_state_fits(abstract, jax.local_devices())
        data = make_data_source(config, global_batch, jax.process_index(), jax.process_count())
        eval_data = make_eval_source(config, global_batch, jax.process_index(), jax.process_count())
        state_shardings = jax.tree.map(lambda leaf: leaf.sharding, abstract)
        batch_shards = batch_sharding(mesh, config)
        tokens_per_device = config.tokens_per_device(num_devices)

    # ---- the step compiled ahead of its first call, and its memory checked against the devices' ----
    with goodput.timing("compile"), run_context(config, mesh, tokens_per_device):
        step_fn = jit_train_step(model, config, optimizer, state_shardings, batch_shards)
        inputs = abstract_batch(config, mesh)
        # on a GPU, XLA plans for the memory the allocator holds (train/xla_memory.py)
        options = device_compiler_options(jax.local_devices()[0], step_io_bytes(abstract, inputs))
        # on a GPU with latency_profile: model or model_contended, twice (aot/compile.py: profile_guided)
        compiled_step = compile_for_devices(step_fn.lower(abstract, inputs), options, config, mesh)
        memory = check_step_fits(compiled_step, jax.local_devices())
        wait_for_every_process("step compiled")
    log(f"step compiled in {goodput.totals['compile']:.1f} s; {memory['total'] / 1e9:.2f} GB per device (XLA)")

    # ---- state: restored when the run has a checkpoint, else created ----
    with goodput.timing("startup"):
        checkpoints = Checkpoints(output_dir / "checkpoints", config) if config.enable_checkpointing else None
        local = LocalCheckpoints(config, abstract) if config.enable_emergency_checkpoint else None
    state, done_steps = initial_state(model, config, optimizer, mesh, abstract, checkpoints, local, data, goodput)

    # ---- evaluation and accounting ----
    with goodput.timing("startup"):
        if eval_data is not None:
            eval_start = eval_data.get_state()
            eval_fn = jax.jit(make_eval_step(model, config), in_shardings=(state_shardings, batch_shards))
        tokens_per_step = global_batch * config.max_target_length
        counts = count_parameters_of(config, abstract.variables)
        flops_per_token = train_flops_per_token(config, counts)
        peak = peak_tflops(topology["device_kind"], config.dtype)
        writer = MetricsWriter(output_dir, config.enable_tensorboard) if is_writer else None
    guards = Guards(config, checkpoints, abstract, data, goodput, writer, log)
    profile_dir = output_dir / "profile"
    if jax.process_count() > 1:
        profile_dir = profile_dir / f"process-{jax.process_index()}"
    profiler = StepProfiler(config.profiler, config.profile_start_step, config.profile_steps, profile_dir, is_writer)

    # ---- loop ----
    losses: dict[int, float] = {}
    record: dict = {}
    window_start, window_steps, window_data_wait = time.perf_counter(), 0, 0.0
    progress = tqdm(
        initial=done_steps, total=config.steps, desc="train", unit="step", disable=not is_writer, dynamic_ncols=True
    )
    step = done_steps
    try:
        with (
            run_context(config, mesh, tokens_per_device),
            PreemptionWatch(config.preemption_check_period) as preemption,
        ):
            while step < config.steps:
                step += 1
                t0 = time.perf_counter()
                batch = put_global_batch(next(data), batch_shards)
                waited = time.perf_counter() - t0
                goodput.add("data_wait", waited)
                window_data_wait += waited
                with goodput.timing("profile"):
                    profiler.maybe_start(step)
                with goodput.timing("step"), profiler.annotate(step):
                    state, metrics = compiled_step(state, batch)
                    guards.dispatched(step, metrics)
                    # the previous step's loss and skip flag, read while this step runs
                    state, rolled_to = guards.check(state, before=step)
                window_steps += 1
                if profiler.ends_at(step):
                    with goodput.timing("step"):
                        jax.block_until_ready(metrics)
                    with goodput.timing("profile"):
                        profiler.close()
                with goodput.timing("step"):  # with several processes, an agreement: it waits for the step
                    stop = preemption.should_stop(step)
                eval_now = eval_data is not None and step % config.eval_interval == 0
                log_now = step == 1 or step % config.log_period == 0 or step == config.steps or eval_now
                save_now = checkpoints is not None and (
                    step % config.checkpoint_period == 0 or step == config.steps or stop
                )
                if rolled_to is None and (log_now or save_now):
                    with goodput.timing("step"):
                        state, rolled_to = guards.check(state, before=step + 1)
                if rolled_to is not None:  # a spike: continue from the checkpoint, on later batches
                    step = rolled_to
                    losses = {s: loss for s, loss in losses.items() if s <= step}
                    record = record if record.get("step", 0) <= step else {}
                    window_start, window_steps, window_data_wait = time.perf_counter(), 0, 0.0
                    progress.update(step - progress.n)
                    continue
                if log_now:
                    with goodput.timing("step"):
                        fetched = jax.device_get(metrics)
                    with goodput.timing("logging"):
                        now = time.perf_counter()
                        record = {
                            "step": step,
                            **{k: v.tolist() for k, v in fetched.items()},
                            "skipped_steps": guards.skips.total,
                            **throughput(
                                tokens_per_step, (now - window_start) / window_steps, flops_per_token, num_devices, peak
                            ),
                            "data_wait_s": window_data_wait / window_steps,
                            **device_memory_gb(jax.local_devices()),
                        }
                        window_start, window_steps, window_data_wait = now, 0, 0.0
                    if eval_now:
                        with goodput.timing("eval"):
                            record["eval_loss"] = evaluate(
                                eval_fn, state, eval_data, eval_start, config.eval_steps, batch_shards
                            )
                        window_start = time.perf_counter()  # evaluation time is not training time
                    with goodput.timing("logging"):
                        losses[step] = record["loss"]
                        progress.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
                        if writer:
                            writer.write(record)
                with goodput.timing("logging"):
                    progress.update(step - progress.n)
                saved = save_now and guards.may_save(step)
                if saved:
                    with goodput.timing("checkpoint"):
                        checkpoints.save(step, state, data.get_state(), config)
                if local is not None and step % config.local_checkpoint_period == 0 and guards.may_save(step):
                    with goodput.timing("checkpoint"):
                        local.save(step, state, data.get_state())
                if stop:
                    progress.close()
                    if saved:
                        with goodput.timing("checkpoint"):
                            checkpoints.wait()
                        said = f"saved {checkpoints.step_path(step)}"
                    elif checkpoints is None:
                        said = "checkpointing is off, nothing saved"
                    else:
                        said = f"not saved (steps being skipped); newest checkpoint: {guards.newest_checkpoint()}"
                    log(f"stopped by {preemption.signal_name()} after step {step}; {said}")
                    break
    except TrainingHalted:
        finish(goodput, progress, profiler, writer, (checkpoints, local), (data, eval_data), is_writer)
        raise
    except BaseException:  # keep what was written; a failing checkpoint or plot must not hide the error
        progress.close()
        with contextlib.suppress(Exception):
            profiler.close()
            if writer:
                writer.close()
        raise
    outputs = finish(goodput, progress, profiler, writer, (checkpoints, local), (data, eval_data), is_writer)
    if is_writer:  # the last line names every output, the newest checkpoint (what the export tool takes) among them
        if record:
            print(f"final loss {record['loss']:.4f} at step {record['step']}")
        if checkpoints is None:
            newest = "no checkpoint (enable_checkpointing=false)"
        elif steps := checkpoints.steps():
            newest = f"newest checkpoint: {output_dir / 'checkpoints' / str(steps[-1])}"
        else:
            newest = "no checkpoint saved"
        print(
            f"outputs in {output_dir}: config.yml, metrics.jsonl"
            + (", tensorboard/" if config.enable_tensorboard else "")
            + "".join(f", {path.name}" for path in outputs)
            + (", profile/" if profile_dir.exists() else "")
            + f"; {newest}",
            flush=True,
        )
    return RunResult(output_dir, losses, record)
