"""The training step's small parts against their textbook definitions."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from MaxText.layers.vocab_parallel import head_nll_sum
from MaxText.train.loss import mtp_weights
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


def test_adamw_is_optax_adamw_and_its_moments_can_be_bfloat16():
    """The optimizer is optax's AdamW (same state tree, same updates); with opt_state_dtype
    bfloat16 its moments are stored in bfloat16 and the updates differ by their rounding only."""
    keys = ("learning_rate=0.01", "warmup_steps=0", "gradient_clipping_threshold=0", "router_learning_rate_scale=1")
    config = make_config(*keys)
    params = {"layer": {"wq_a": jax.random.normal(jax.random.key(0), (16, 8)), "norm": {"scale": jnp.ones(16)}}}
    grads = [jax.tree.map(lambda p, i=i: jnp.sin(p * (i + 1)) * 1e-3, params) for i in range(3)]
    reference = optax.adamw(
        learning_rate_schedule(config),
        b1=config.adam_b1,
        b2=config.adam_b2,
        eps=config.adam_eps,
        weight_decay=config.adam_weight_decay,
        mask=weight_decay_mask,
    )
    ours, narrow = make_optimizer(config), make_optimizer(make_config(*keys, "opt_state_dtype=bfloat16"))
    states = [t.init(params) for t in (reference, ours, narrow)]
    assert jax.tree.structure(states[0]) == jax.tree.structure(states[1]) == jax.tree.structure(states[2])
    for g in grads:
        steps = [t.update(g, s, params) for t, s in zip((reference, ours, narrow), states, strict=True)]
        (want, _), (got, _), (rounded, _) = steps
        states = [s for _, s in steps]
        jax.tree.map(np.testing.assert_array_equal, got, want)
        # bfloat16 keeps 8 bits of each moment: an update moves by 1%, or by 0.5% of the learning rate
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-2, atol=5e-3 * 0.01), rounded, want)
    moments = states[2][0]
    assert {x.dtype for x in jax.tree.leaves((moments.mu, moments.nu))} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves((states[1][0].mu, states[1][0].nu))} == {jnp.dtype(jnp.float32)}


def test_bfloat16_moments_halve_the_optimizer_state_in_the_accounting():
    from MaxText.models.accounting import memory_estimate

    wide, narrow = memory_estimate(make_config()), memory_estimate(make_config("opt_state_dtype=bfloat16"))
    assert narrow.optimizer * 2 == wide.optimizer
    assert (narrow.weights, narrow.gradients) == (wide.weights, wide.gradients)


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


def cross_entropy(logits_BSV, targets_BS, weights_BS):
    """Mean token cross-entropy over positions with weight 1 (the tests' reference)."""
    logprobs = jax.nn.log_softmax(logits_BSV, axis=-1)
    nll = -jnp.take_along_axis(logprobs, targets_BS[..., None], axis=-1)[..., 0]
    return (nll * weights_BS).sum() / jnp.maximum(weights_BS.sum(), 1)


def test_cross_entropy_and_mtp_weights():
    logits = jnp.log(jnp.array([[[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]]]))
    targets = jnp.array([[0, 2]])
    head = jnp.eye(3)  # the head's sum over an identity head: the cross-entropy of these logits
    assert float(head_nll_sum(logits, head, targets, jnp.ones((1, 2)), 1, ())) == pytest.approx(
        -(math.log(0.5) + math.log(0.8))
    )
    assert float(head_nll_sum(logits, head, targets, jnp.array([[0.0, 1.0]]), 1, ())) == pytest.approx(-math.log(0.8))
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


# ---------------------------------------------------------------- padding and accumulation


def _padded_batch(config, lengths, seed):
    """Rows holding one document each of the given lengths, padded (segment id 0) to the sequence
    length, as ``packing: false`` produces them."""
    B, S = len(lengths), config.max_target_length
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, config.vocab_size, size=(B, S + 1))
    real = np.arange(S)[None, :] < np.asarray(lengths)[:, None]
    return {
        "inputs": jnp.asarray(np.where(real, tokens[:, :-1], 0), jnp.int32),
        "targets": jnp.asarray(np.where(real, tokens[:, 1:], 0), jnp.int32),
        "inputs_position": jnp.asarray(np.where(real, np.arange(S), 0), jnp.int32),
        "inputs_segmentation": jnp.asarray(real, jnp.int32),
        "targets_segmentation": jnp.asarray(real, jnp.int32),
    }


@pytest.mark.slow
def test_padding_is_left_out_of_expert_loads_and_balance_loss():
    """A padded row gives the same loads and balance loss as its real tokens alone: causal,
    same-document attention makes their hidden states independent of the padding."""
    from MaxText.models.deepseek import DeepSeekV3
    from MaxText.moe.block import BIAS, LOAD, LOSS
    from MaxText.train.state import dummy_inputs

    config = make_config("dtype=float32", "mtp_num_layers=0")
    model = DeepSeekV3(config)
    variables = jax.jit(model.init)(jax.random.key(0), *dummy_inputs(config))
    variables = {"params": variables["params"], BIAS: variables[BIAS]}
    apply = jax.jit(
        lambda b: model.apply(
            variables, b["inputs"], b["inputs_position"], b["inputs_segmentation"], mutable=[LOAD, LOSS]
        )[1]
    )
    n = 23
    padded = _padded_batch(config, [n], seed=1)
    alone = {k: v[:, :n] for k, v in padded.items()}
    stats_padded, stats_alone = apply(padded), apply(alone)
    load_padded = np.concatenate([np.ravel(x) for x in jax.tree.leaves(stats_padded[LOAD])])
    np.testing.assert_array_equal(
        load_padded, np.concatenate([np.ravel(x) for x in jax.tree.leaves(stats_alone[LOAD])])
    )
    assert load_padded.sum() == config.num_moe_layers * n * config.num_experts_per_tok
    np.testing.assert_allclose(jax.tree.leaves(stats_padded[LOSS]), jax.tree.leaves(stats_alone[LOSS]), rtol=1e-5)


@pytest.mark.slow
def test_accumulated_micro_batches_equal_one_big_batch():
    """Micro-batches with different padding: summed token losses over the whole batch's token
    count give the big batch's loss and gradients (averaging per-micro-batch means would not)."""
    from MaxText.models.deepseek import DeepSeekV3
    from MaxText.parallel.mesh import make_mesh
    from MaxText.train.state import create_train_state
    from MaxText.train.step import train_step

    overrides = ("dtype=float32", "per_device_batch_size=4", "ici_fsdp_parallelism=1", "load_balance_loss_weight=0.01")
    one, two = make_config(*overrides), make_config(*overrides, "gradient_accumulation_steps=2")
    # split_micro_batches gives rows 0, 2 to the first micro-batch and 1, 3 to the second:
    # the first is nearly full, the second mostly padding.
    batch = _padded_batch(one, [64, 9, 60, 5], seed=2)
    mesh = make_mesh(one, jax.devices()[:1])
    model = DeepSeekV3(one)
    # new params = params - 1e4 x gradients: the gradients themselves are compared (the large rate
    # keeps the parameters' own rounding out of the difference).
    sgd = optax.sgd(1e4)
    state, _ = create_train_state(model, one, sgd, mesh)  # accumulation changes the step, not the state
    results = []
    for config in (one, two):
        step = jax.jit(lambda s, b, c=config: train_step(model, c, sgd, s, b))
        new_state, metrics = step(state, batch)
        grads = jax.tree.map(jnp.subtract, state.params, new_state.params)
        results.append(((state.params, state.moe_bias), grads, jax.device_get(metrics)))
    ((params, bias), grads_1, m_1), (_, grads_2, m_2) = results
    for key in ("loss", "lm_loss", "mtp_loss", "aux_loss", "grad_norm"):
        assert m_2[key] == pytest.approx(m_1[key], rel=1e-5), key
    np.testing.assert_array_equal(
        m_2["expert_load_max_over_mean_per_layer"], m_1["expert_load_max_over_mean_per_layer"]
    )
    for a, b in zip(jax.tree.leaves(grads_1), jax.tree.leaves(grads_2), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6 * float(np.abs(a).max()))
    # The old rule, the mean of the two micro-batches' own means, is measurably different here.
    halves = split_micro_batches(batch, 2)
    lm_mean = _lm_mean(one)
    means = [float(lm_mean(params, bias, {k: v[i] for k, v in halves.items()})) for i in range(2)]
    assert abs(np.mean(means) - float(lm_mean(params, bias, batch))) > 1e-3


def _lm_mean(config):
    """The main head's mean cross-entropy over a batch, ``(params, bias, batch) -> mean`` (jitted:
    eager execution of the model is slow; one function, compiled once per batch shape)."""
    from MaxText.models.deepseek import DeepSeekV3
    from MaxText.moe.block import BIAS, LOAD, LOSS

    model = DeepSeekV3(config)

    @jax.jit
    def mean(params, bias, batch):
        (logits, _), _ = model.apply(
            {"params": params, BIAS: bias},
            batch["inputs"],
            batch["inputs_position"],
            batch["inputs_segmentation"],
            mutable=[LOAD, LOSS],
        )
        return cross_entropy(logits, batch["targets"], (batch["targets_segmentation"] != 0).astype(jnp.float32))

    return mean


@pytest.mark.slow
def test_output_head_in_slices_equals_the_whole_head():
    """``vocab_chunks``: the loss (main and MTP heads) and every gradient equal the head
    applied to the whole sequence, with padding; and the logits are never whole, in either pass."""
    import flax.linen as nn

    from MaxText.models.deepseek import DeepSeekV3
    from MaxText.moe.block import BIAS
    from MaxText.train.loss import compute_loss
    from MaxText.train.state import dummy_inputs

    small = ("dtype=float32", "max_target_length=16", "base_num_decoder_layers=2", "first_num_dense_layers=1")
    whole, sliced = (make_config(*small, f"vocab_chunks={n}") for n in (1, 4))
    variables = nn.unbox(jax.jit(DeepSeekV3(whole).init)(jax.random.key(0), *dummy_inputs(whole)))
    params, bias = variables["params"], variables[BIAS]
    batch = _padded_batch(whole, [whole.max_target_length, 11], seed=2)

    def loss_and_grads(config):
        fn = jax.value_and_grad(lambda p: compute_loss(DeepSeekV3(config), config, p, bias, batch).loss)
        return jax.jit(fn).lower(params)

    whole_program, sliced_program = loss_and_grads(whole), loss_and_grads(sliced)
    (loss_1, grads_1), (loss_4, grads_4) = whole_program.compile()(params), sliced_program.compile()(params)
    np.testing.assert_allclose(loss_4, loss_1, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads_4), jax.tree.leaves(grads_1), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)
    S, V = whole.max_target_length, whole.vocab_size
    hlo = sliced_program.as_text()  # the forward and the backward pass
    assert f"2x{S // 4}x{V}xf32" in hlo and f"2x{S}x{V}xf32" not in hlo  # [B, S, V] logits


def test_vocab_chunks_must_divide_the_sequence():
    from MaxText.config import ConfigError

    with pytest.raises(ConfigError, match="vocab_chunks"):
        make_config("vocab_chunks=3")
