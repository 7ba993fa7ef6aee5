"""The training step's small parts against their textbook definitions."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from MaxText.train.loss import cross_entropy, mtp_weights
from MaxText.train.metrics import peak_tflops, throughput
from MaxText.train.optimizer import learning_rate_schedule, make_optimizer, weight_decay_mask
from MaxText.train.step import load_max_over_mean_per_router, split_micro_batches, update_correction_bias
from tests.conftest import make_config


def test_schedule_warmup_then_cosine():
    config = make_config("learning_rate=1.0", "warmup_steps=10", "steps=110", "learning_rate_final_fraction=0.1")
    lr = learning_rate_schedule(config)
    assert float(lr(0)) == 0.0
    assert float(lr(5)) == pytest.approx(0.5)
    assert float(lr(10)) == pytest.approx(1.0)
    for step in (35, 60, 85):
        progress = (step - 10) / 100
        assert float(lr(step)) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)), rel=1e-5)
    assert float(lr(110)) == pytest.approx(0.1)


def test_schedule_length_can_differ_from_steps():
    short = make_config("steps=4", "learning_rate_schedule_steps=60", "warmup_steps=6")
    full = make_config("steps=60", "warmup_steps=6")
    for step in range(4):
        assert float(learning_rate_schedule(short)(step)) == float(learning_rate_schedule(full)(step))


def test_no_weight_decay_on_norm_scales():
    params = {
        "norm": {"scale": jnp.ones(3)},
        "layer": {"wq_a": jnp.ones((3, 2)), "pre_ffn_norm": {"scale": jnp.ones(3)}},
    }
    assert weight_decay_mask(params) == {
        "norm": {"scale": False},
        "layer": {"wq_a": True, "pre_ffn_norm": {"scale": False}},
    }
    # With zero gradients only decay moves a parameter: matrices shrink, scales stay.
    config = make_config("learning_rate=0.1", "warmup_steps=0", "adam_weight_decay=0.5")
    optimizer = make_optimizer(config)
    grads = jax.tree.map(jnp.zeros_like, params)
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    new = optax.apply_updates(params, updates)
    assert np.all(np.asarray(new["layer"]["wq_a"]) < 1.0)
    assert np.all(np.asarray(new["norm"]["scale"]) == 1.0)


def test_correction_bias_update_is_sign_of_load_deficit():
    bias = {"a": jnp.zeros(4), "b": jnp.zeros((2, 4))}
    load = {"a": jnp.array([1, 5, 3, 3]), "b": jnp.array([[4, 4, 4, 4], [0, 0, 0, 16]])}
    new = update_correction_bias(bias, load, rate=0.01)
    np.testing.assert_allclose(new["a"], [0.01, -0.01, 0.0, 0.0])
    np.testing.assert_allclose(new["b"], [[0, 0, 0, 0], [0.01, 0.01, 0.01, -0.01]])
    np.testing.assert_allclose(load_max_over_mean_per_router(load), [5 / 3, 1, 4], rtol=1e-6)


def test_micro_batches_partition_the_rows():
    batch = {"inputs": np.arange(8 * 3).reshape(8, 3)}
    micro = split_micro_batches(batch, 2)["inputs"]
    assert micro.shape == (2, 4, 3)
    assert sorted(np.asarray(micro).reshape(-1).tolist()) == list(range(24))


def test_cross_entropy_and_mtp_weights():
    logits = jnp.log(jnp.array([[[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]]]))
    targets = jnp.array([[0, 2]])
    assert float(cross_entropy(logits, targets, jnp.ones((1, 2)))) == pytest.approx(
        -(math.log(0.5) + math.log(0.8)) / 2
    )
    assert float(cross_entropy(logits, targets, jnp.array([[0.0, 1.0]]))) == pytest.approx(-math.log(0.8))
    segments = jnp.array([[1, 1, 1, 2, 2, 0]])
    # Depth 1 at position i predicts target i+1: valid inside a document and the sequence only.
    np.testing.assert_array_equal(mtp_weights(segments, 1), [[1, 1, 0, 1, 0, 0]])


def test_peak_table_and_mfu():
    assert peak_tflops("NVIDIA GB200", "bfloat16") == 2500.0
    assert peak_tflops("NVIDIA B200", "bfloat16") == 2250.0
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bfloat16") == 989.0
    assert peak_tflops("NVIDIA H200", "float32") is None
    assert peak_tflops("cpu", "float32") is None
    figures = throughput(tokens_per_step=1000, step_time_s=0.5, flops_per_token=1e9, num_devices=2, peak=1.0)
    assert figures["tokens_per_s"] == 2000
    assert figures["tflops_per_device"] == pytest.approx(1.0)
    assert figures["mfu"] == pytest.approx(1.0)
