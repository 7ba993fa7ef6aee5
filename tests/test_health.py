"""Training health through the real entry point: the non-finite guard (exit 3, the newest checkpoint
the last good state), a non-finite batch skipped inside the step, the loss-spike rollback on real
data, the profiler's trace, the goodput accounting, and the pre-flight memory check (exit 2)."""

import gzip
import json
import random
import subprocess
import sys
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from MaxText.train.metrics import read_metrics, step_records
from tests.conftest import cpu_env, make_config

pytestmark = pytest.mark.slow  # whole runs: `make test-fast` leaves this file out

REPO = Path(__file__).resolve().parents[1]
TINY = ("dtype=float32", "per_device_batch_size=4", "enable_tensorboard=false")


def train(output: Path, *args: str, devices: int = 1, timeout: int = 600):
    command = [sys.executable, "-m", "MaxText.train", f"base_output_directory={output}", *args]
    return subprocess.run(command, cwd=REPO, env=cpu_env(devices), capture_output=True, text=True, timeout=timeout)


def saved_params(checkpoint: Path) -> dict:
    return ocp.StandardCheckpointer().restore(checkpoint / "state")["params"]


# ---------------------------------------------------------------- non-finite steps


def test_every_update_non_finite_stops_with_exit_3_and_keeps_the_last_good_checkpoint(tmp_path):
    """Learning rate 1e20: the first update is finite but leaves weights whose next forward pass
    overflows; every later step is skipped, and the run stops after 3 in a row."""
    args = (
        *TINY,
        "dataset_type=synthetic",
        "learning_rate=1e20",
        "warmup_steps=0",
        "max_consecutive_skipped_steps=3",
        "checkpoint_period=1",
        "log_period=1",
        "learning_rate_schedule_steps=20",  # the one-step run below compiles the same step (a cache hit)
    )
    result = train(tmp_path, *args, "run_name=blowup", "steps=20")
    assert result.returncode == 3, result.stdout[-2000:] + result.stderr[-2000:]
    error = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(error) == 1 and error[0].startswith("error: steps 2-4: loss or gradient norm not finite"), error
    run = tmp_path / "blowup"
    assert error[0].endswith(f"newest checkpoint: {run / 'checkpoints' / '1'}")
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == ["1"]
    records = step_records(read_metrics(run))
    assert [(r["step"], r["skipped"], r["skipped_steps"]) for r in records] == [(1, 0, 0), (2, 1, 1), (3, 1, 2)]
    assert read_metrics(run)[-1]["event"] == "goodput"  # the outputs are still written

    # The newest checkpoint holds exactly the state after step 1: that of a run that stopped there.
    reference = train(tmp_path, *args, "run_name=one_step", "steps=1")
    assert reference.returncode == 0, reference.stderr[-2000:]
    kept, good = saved_params(run / "checkpoints" / "1"), saved_params(tmp_path / "one_step" / "checkpoints" / "1")
    for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(good), strict=True):
        assert np.all(np.isfinite(a)) and np.array_equal(a, b)
    assert max(float(np.abs(x).max()) for x in jax.tree.leaves(kept)) > 1e18  # the update did blow the weights up


def test_a_batch_with_a_non_finite_loss_is_skipped_and_training_goes_on():
    """A batch whose targets lie outside the vocabulary (a tokenizer that does not match the model)
    gives a NaN loss: that step changes nothing, and the run continues exactly as if the batch had
    never been there. The real step and optimizer; the batch is the only thing changed."""
    from MaxText.data.synthetic import SyntheticSource
    from MaxText.models.deepseek import DeepSeekV3
    from MaxText.parallel.mesh import make_mesh
    from MaxText.train.optimizer import make_optimizer
    from MaxText.train.state import create_train_state
    from MaxText.train.step import make_train_step

    config = make_config("dtype=float32", "per_device_batch_size=4", "warmup_steps=0")
    mesh = make_mesh(config, jax.devices()[:1])
    model, optimizer = DeepSeekV3(config), make_optimizer(config)
    step = jax.jit(make_train_step(model, config, optimizer))
    data = SyntheticSource(config, 4, 0, 1)
    batches = [{k: jnp.asarray(v) for k, v in next(data).items()} for _ in range(5)]
    bad = dict(batches[2], targets=batches[2]["targets"].at[1, 7].set(config.vocab_size))

    initial, _ = create_train_state(model, config, optimizer, mesh)  # the step donates nothing: both runs start here

    def losses(sequence):
        state, out = initial, []
        for batch in sequence:
            before = state
            state, metrics = step(state, batch)
            out.append((float(metrics["loss"]), int(metrics["skipped"])))
            if metrics["skipped"]:
                same = partial(jax.tree.map, lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)))
                assert all(
                    jax.tree.leaves(
                        same(
                            (state.params, state.opt_state, state.moe_bias),
                            (before.params, before.opt_state, before.moe_bias),
                        )
                    )
                )
                assert int(state.step) == int(before.step) + 1  # the step counts the batch it consumed
        return out

    with_bad = losses([*batches[:2], bad, *batches[3:]])
    without = losses([*batches[:2], *batches[3:]])
    assert [s for _, s in with_bad] == [0, 0, 1, 0, 0] and np.isnan(with_bad[2][0])
    assert with_bad[:2] + with_bad[3:] == without  # exactly: the skipped step left no trace
    assert all(np.isfinite(loss) for loss, _ in without)


# ---------------------------------------------------------------- loss spikes


def prepare(corpus: Path, docs: list[str], output: Path) -> list[str]:
    """``docs`` as a one-file corpus prepared as dataset ``spiky``; the texts in the order a run
    without shuffling reads them (the builder orders records by a hash of their key, the file and
    line: the same for any texts)."""
    from MaxText.data.source import open_records

    (corpus / "docs.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs) + "\n")
    tool = [sys.executable, "tools/prepare_dataset.py", "--input", str(corpus), "--output", str(output)]
    made = subprocess.run(
        [*tool, "--name", "spiky", "--val-fraction", "0"], cwd=REPO, env=cpu_env(1), capture_output=True
    )
    assert made.returncode == 0, made.stderr[-2000:]
    config = make_config("dataset_type=tfds", "dataset_name=spiky", f"dataset_path={output}")
    return [record["text"].decode() for record in open_records(config, "train")]


def test_a_loss_spike_rolls_back_and_skips_its_batches(tmp_path):
    """Short sentences of three words, except batches 30-32 (steps 31-33), which are digits the model
    never saw. Step 31 is no logging step, so its loss is read while step 32 runs: the spike rolls
    back to the step-30 checkpoint, drops the in-flight step 32 with its batch, and skips 2 batches
    beyond the 32 read, so the run never meets batches 31-33 again, and ends at step 40 with no
    other event."""
    length, garbage = 64, range(30 * 4, 33 * 4)  # one document per row, 4 rows (TINY) a batch
    rng = random.Random(0)

    def sentence() -> str:  # length - 1 bytes: with BOS and EOS, one whole sequence
        text = ""
        while len(text) < length - 1:
            text += rng.choice(["the", "cat", "sat"]) + " "
        return text[: length - 1]

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    docs = [sentence() + str(n) for n in range(200)]  # unique; the number's bytes are cut to fit below
    docs = [d[-(length - 1) :] for d in docs]
    order = prepare(corpus, docs, tmp_path / "first")
    spiky = {docs.index(order[p]) for p in garbage}
    docs = [
        "".join(rng.choice("0123456789") for _ in range(length - 1)) if i in spiky else d for i, d in enumerate(docs)
    ]
    order = prepare(corpus, docs, tmp_path / "prepared")
    assert [p for p, text in enumerate(order) if text.isdigit()] == list(garbage)
    result = train(
        tmp_path / "runs",
        *TINY,
        "run_name=spiky",
        "dataset_type=tfds",
        "dataset_name=spiky",
        f"dataset_path={tmp_path / 'prepared'}",
        f"max_target_length={length}",
        "packing=false",
        "enable_data_shuffling=false",
        "grain_worker_count=0",
        "eval_interval=0",
        "steps=40",
        "log_period=4",
        "checkpoint_period=10",
        "loss_spike_rollback=true",
        "loss_spike_window=5",
        "spike_skip_batches=2",
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    records = read_metrics(tmp_path / "runs" / "spiky")
    events = [r for r in records if r.get("event") not in (None, "goodput")]
    assert len(events) == 1, events
    (event,) = events
    assert (event["event"], event["step"], event["restored_step"], event["skipped_batches"]) == ("rollback", 31, 30, 2)
    assert event["loss"] > 2 * event["median"]
    assert "loss spike at step 31" in result.stdout and "rolled back to step 30" in result.stdout
    steps = step_records(records)
    # the spike's step is reported by its event only; step 31 is then trained on batch 34
    assert [r["step"] for r in steps] == [1, *range(4, 41, 4)]
    assert all(r["loss"] < 2 * event["median"] for r in steps if r["step"] > 30)  # no digits met again


# ---------------------------------------------------------------- profiler and goodput


def test_profiler_trace_goodput_and_plots(tmp_path):
    """``profiler=xplane profile_start_step=5 profile_steps=3``: a trace with the three steps'
    annotations; the wall time accounted by category; the expert-load heatmap."""
    result = train(
        tmp_path,
        *TINY,
        "dataset_type=synthetic",
        "run_name=profiled",
        "steps=10",
        "learning_rate_schedule_steps=40",  # the spike run's step, from the compilation cache
        "log_period=2",
        "checkpoint_period=4",
        "profiler=xplane",
        "profile_start_step=5",
        "profile_steps=3",
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    run = tmp_path / "profiled"
    (trace,) = run.glob("profile/plugins/profile/*/perfetto_trace.json.gz")
    assert list(trace.parent.glob("*.xplane.pb"))  # what TensorBoard's profile plugin reads
    events = json.loads(gzip.decompress(trace.read_bytes()))
    events = events["traceEvents"] if isinstance(events, dict) else events
    annotated = sorted(int(e["args"]["step_num"]) for e in events if e.get("name") == "train" and "args" in e)
    assert annotated == [5, 6, 7]

    records = read_metrics(run)
    totals = records[-1]
    assert totals["event"] == "goodput"
    parts = sum(v for k, v in totals.items() if k.endswith("_s") and k != "wall_s")
    assert parts == pytest.approx(totals["wall_s"], rel=0.05)
    assert totals["goodput"] == pytest.approx(totals["step_s"] / totals["wall_s"])
    assert totals["profile_s"] > 0 and totals["compile_s"] > 0 and totals["step_s"] > 0
    assert "goodput" in result.stdout and "compile" in result.stdout
    for record in step_records(records):
        assert record["data_wait_s"] > 0  # every step fetched a batch
        assert record["device_memory_in_use_gb"] is None and record["device_memory_peak_gb"] is None  # CPU
    assert (run / "expert_load.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- pre-flight memory check


def test_a_state_that_cannot_fit_exits_2_in_seconds(tmp_path):
    """The README's first suggestion, ``model_name=deepseek3-small``: its train state (2.6B float32
    parameters and two Adam moments, 31.4 GB) exceeds this host's RAM, so the run stops before
    allocating anything."""
    from MaxText.config import load_config
    from MaxText.models.deepseek import DeepSeekV3
    from MaxText.parallel.mesh import make_mesh
    from MaxText.train.optimizer import make_optimizer
    from MaxText.train.preflight import host_available_bytes, state_bytes_per_device
    from MaxText.train.state import abstract_train_state

    config = load_config(["model_name=deepseek3-small", "run_name=t"]).with_platform("cpu")
    mesh = make_mesh(config, jax.devices()[:1])
    state = state_bytes_per_device(abstract_train_state(DeepSeekV3(config), config, make_optimizer(config), mesh))
    assert state == pytest.approx(31.35e9, rel=0.01)
    # On a host with more RAM than that, keep it from fitting: replicate it on 8 devices sharing the RAM.
    assert 8 * state > host_available_bytes(), "a host this large needs a larger model here"
    spread = [] if state > host_available_bytes() else ["ici_fsdp_parallelism=1", "ici_data_parallelism=-1"]
    result = train(tmp_path, "model_name=deepseek3-small", "run_name=small", *spread, devices=8 if spread else 1)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: memory: the train state alone needs 31.4 GB per device")
    assert "opt_state_dtype" in lines[0] and "fsdp" in lines[0]
    assert not (tmp_path / "small" / "checkpoints").exists()


def test_a_step_that_cannot_fit_exits_2_with_xla_figures(tmp_path):
    """The tiny model's state fits anywhere; 65,536 sequences of 4,096 per device do not: XLA's
    memory analysis of the compiled step says so before the state is created."""
    result = train(
        tmp_path,
        "dataset_type=synthetic",
        "run_name=huge_batch",
        "per_device_batch_size=65536",
        "max_target_length=4096",
    )
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: memory: the training step needs"), lines
    assert "per_device_batch_size" in lines[0] and "remat_policy=full" in lines[0]


def test_goodput_counts_nested_time_once():
    """A rollback found while waiting for a step counts as rollback, not also as step time."""
    import time

    from MaxText.train.goodput import Goodput

    goodput = Goodput()
    with goodput.timing("step"):
        time.sleep(0.05)
        with goodput.timing("rollback"):
            time.sleep(0.1)
        goodput.add("data_wait", 0.02)  # measured by hand inside a timed stretch
    totals = goodput.record()
    assert totals["rollback_s"] == pytest.approx(0.1, abs=0.03)
    assert totals["step_s"] == pytest.approx(0.03, abs=0.03)  # 0.15 s elapsed, less 0.12 s nested
    assert totals["accounted_fraction"] == pytest.approx(1.0, abs=0.1)


def test_the_guards_decisions():
    """The trackers alone: a streak of skips, a spike against the running median (skipped steps
    and undone steps out of it), and the median's window."""
    from MaxText.train.health import SkipTracker, SpikeDetector

    skips = SkipTracker(max_in_a_row=3)
    for step, skipped in [(1, False), (2, True), (3, True), (4, False), (5, True), (6, True)]:
        skips.record(step, skipped)
        assert not skips.must_stop
    skips.record(7, True)
    assert skips.must_stop and skips.total == 5 and skips.halt_message(7, "c/4").startswith("steps 5-7: ")

    spikes = SpikeDetector(factor=2.0, window=3)
    for step, loss in [(1, 5.0), (2, 3.0)]:
        spikes.record(step, loss)
        assert not spikes.is_spike(100.0)  # no spike is called before the window fills
    spikes.record(3, 2.0)
    assert spikes.median() == 3.0 and spikes.is_spike(6.1) and not spikes.is_spike(6.0)
    spikes.record(4, 1.0)
    assert spikes.median() == 2.0  # the window slides
    spikes.forget_after(3)
    assert spikes.median() is None  # steps 4 and later were undone: 2 of 3 left
