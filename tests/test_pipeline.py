"""The circular pipeline (``parallel/pipeline.py``) on 8 simulated CPU devices, float32: outputs,
per-layer statistics and every gradient equal the layers applied one after another to each
micro-batch (written out here with a Python loop), for 2 and 4 stages, 1 and 2 repeats, p and 2p
micro-batches, with FSDP inside the stages; bubbles filled with NaN leave no NaN anywhere. Then the
whole DeepSeek model with its MoE stack pipelined (``ici_pipeline_parallelism``): the loss, the
MoE statistics and every gradient equal the unpipelined model's."""

import functools
import itertools
import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from MaxText.parallel.pipeline import bubble_fraction, circular_pipeline, from_stages, to_stages

D, F, B, S = 16, 32, 4, 8  # model dim, hidden dim, rows per micro-batch, sequence


def layer(params, x, scale):
    """A residual MLP layer with a statistic that depends on its input (like an expert load) and
    a side input each micro-batch has its own of (like positions)."""
    h = jnp.tanh(jnp.einsum("bsd,df->bsf", x * scale[:, :, None], params["w_in"]))
    y = x + jnp.einsum("bsf,fd->bsd", h, params["w_out"])
    return y, {"load": jnp.sum(h >= 0, axis=(0, 1)).astype(jnp.float32), "sq": jnp.mean(y**2) + 1}


def reference(layer_fn, stack, x_MB, side_MB):
    """Layer after layer on each micro-batch; each layer's statistics summed over micro-batches."""
    layers = jax.tree.leaves(stack)[0].shape[0]
    side = [jax.tree.map(lambda a, m=m: a[m], side_MB) for m in range(x_MB.shape[0])]
    outs, totals = [], None
    for x, side_m in zip(x_MB, side, strict=True):
        per_layer = []
        for i in range(layers):
            x, stats = layer_fn(jax.tree.map(lambda w, i=i: w[i], stack), x, side_m)
            per_layer.append(stats)
        outs.append(x)
        stacked = jax.tree.map(lambda *a: jnp.stack(a), *per_layer)
        totals = stacked if totals is None else jax.tree.map(jnp.add, totals, stacked)
    return jnp.stack(outs), totals


def make_stack(layers: int, key) -> dict:
    k1, k2 = jax.random.split(key)
    return {
        "w_in": jax.random.normal(k1, (layers, D, F)) / np.sqrt(D),
        "w_out": jax.random.normal(k2, (layers, F, D)) / np.sqrt(F),
    }


def objective(outputs, stats):
    """A scalar that every output and statistic reaches (so every gradient path is checked)."""
    return jnp.sum(outputs**2) + jnp.sum(stats["sq"] * jnp.arange(1, stats["sq"].size + 1).reshape(stats["sq"].shape))


def assert_close(got, want, tolerance=1e-5):
    """Within ``tolerance`` of the reference's largest magnitude (float32 sums in another order)."""
    got, want = np.asarray(got), np.asarray(want)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=0, atol=tolerance * max(np.abs(want).max(), 1.0))


def with_grads(run):
    """``run(stack, x_MB, *rest) -> (outputs, stats)`` jitted with ``objective`` and its gradients
    for the stack and the input: one program for the outputs, the statistics and the gradients."""

    def loss(stack, x_MB, *rest):
        out, stats = run(stack, x_MB, *rest)
        return objective(out, stats), (out, stats)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


# p in {2, 4}, r in {1, 2}, m in {p, 2p}, one layer per stage; two layers per stage once; and m
# not a multiple of p (the buffer between repeats reuses its slots in another order). Lanes (each
# micro-batch's rows dealt into 2 or 3, each lane's transfer under the next one's work): with 1 and
# 2 repeats, the buffer's reordered slots, and a stage of two layers.
CASES = [(p, r, m, 1, 1) for p, r in itertools.product((2, 4), (1, 2)) for m in (p, 2 * p)]
CASES += [(2, 2, 4, 2, 1), (2, 3, 3, 1, 1), (4, 2, 5, 1, 1)]
CASES += [(2, 1, 2, 1, 2), (4, 2, 5, 1, 2), (2, 2, 4, 2, 3)]


@pytest.mark.slow
@pytest.mark.parametrize("stages, repeats, microbatches, per_stage, lanes", CASES)
def test_pipelined_layers_equal_the_layers_in_order(stages, repeats, microbatches, per_stage, lanes):
    layers = stages * repeats * per_stage
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(stages, 8 // stages), ("stage", "fsdp"))
    kx, kw = jax.random.split(jax.random.key(stages * 100 + repeats * 10 + microbatches + per_stage + 1000 * lanes))
    stack = make_stack(layers, kw)
    rows = B * lanes
    x_MB = jax.random.normal(kx, (microbatches, rows, S, D))
    scale_MB = 1 + jnp.arange(microbatches * rows * S, dtype=jnp.float32).reshape(microbatches, rows, S) / 100

    def in_order(stack, x_MB):  # each lane (rows l, l + lanes, ...) of each micro-batch on its own
        items = jnp.concatenate([x_MB[:, lane::lanes] for lane in range(lanes)])
        scales = jnp.concatenate([scale_MB[:, lane::lanes] for lane in range(lanes)])
        out, stats = reference(layer, stack, items, scales)
        out = jnp.stack(jnp.split(out, lanes), axis=2)  # [lanes, M, b, ...] -> [M, b, lanes, ...]
        return out.reshape(x_MB.shape), stats

    def pipelined(stack, x_MB, fill):
        staged = to_stages(stack, stages, repeats)
        out, stats = circular_pipeline(layer, staged, x_MB, scale_MB, fill=fill, lanes=lanes)
        return out, from_stages(stats)

    (_, (want_out, want_stats)), want_grads = with_grads(in_order)(stack, x_MB)
    weights = NamedSharding(mesh, P(None, "fsdp"))  # FSDP inside the stages
    batch = NamedSharding(mesh, P(None, "fsdp"))
    with jax.set_mesh(mesh):
        stack_sharded = jax.device_put(stack, weights)
        x_sharded = jax.device_put(x_MB, batch)
        run = with_grads(pipelined)
        for fill in (0.0, np.nan):  # one program: the fill is an input
            (_, (out, stats)), grads = run(stack_sharded, x_sharded, jnp.float32(fill))
            assert_close(out, want_out)
            for name in want_stats:
                assert_close(stats[name], want_stats[name])
            for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
                assert_close(got, want)


@pytest.mark.parametrize("policy", [None, "nothing_saveable", "dots_with_no_batch_dims_saveable"])
def test_no_iteration_keeps_a_copy_of_its_layers_weights(policy, capsys):
    """What the backward pass keeps, under no remat policy, full remat and minimal remat: of the
    weights, only the stack itself (loop-invariant, [R, P, J, ...]); no slice of a layer's weights
    or its cast per iteration, which would hold (m r + p - 1) copies of a stage's weights."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("stage", "fsdp"))
    stack = make_stack(8, jax.random.key(0))
    x_MB = jnp.zeros((4, B, S, D))

    def cast_layer(params, x, scale):  # a layer that reads its weights in another dtype, as the model does
        return layer(jax.tree.map(lambda w: w.astype(jnp.bfloat16).astype(jnp.float32), params), x, scale)

    def loss(stack, x_MB):
        remat = getattr(jax.checkpoint_policies, policy) if policy else None
        out, stats = circular_pipeline(
            cast_layer, to_stages(stack, 2, 2), x_MB, jnp.ones((4, B, S)), remat_policy=remat
        )
        return objective(out, stats)

    with jax.set_mesh(mesh):
        print_saved_residuals(loss, stack, x_MB)
    shapes = re.findall(r"^\w+\[([\d,]+)\]", capsys.readouterr().out, re.MULTILINE)
    kept = {tuple(int(d) for d in shape.split(",")) for shape in shapes}
    weights = {shape for shape in kept if shape[-2:] in ((D, F), (F, D))}
    assert weights == {(2, 2, 2, D, F), (2, 2, 2, F, D)}
    assert any(len(shape) > 4 and shape[-1] in (D, F) for shape in kept - weights)  # the activations kept per iteration


@pytest.mark.parametrize("repeats, lanes", [(1, 1), (1, 2), (2, 1), (2, 2)])
def test_the_stacks_gradient_is_summed_in_place(repeats, lanes):
    """The gradient of a stage's weights is summed over the iterations and the layers in the
    loops' carry (the gradient sink), in place. Compiled with the gradient laid out like the
    weights (as a train step does) and the weights far larger than the activations, the
    program's temporary memory stays under 1.5 copies of the stage's weights (0.4x, 0.7x, 0.4x and
    1.2x for the four cases). With the stack a loop-invariant input, each loop level summed its
    gradient in a buffer of its own (2.0x, 3.5x, 1.7x, 1.4x); with the sink but each layer's
    slice taken as two nested slices, XLA copied the gradient with lanes (1.0x, 1.7x, 0.8x, 2.3x)."""
    d, f, layers = 256, 1024, 8
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("stage", "fsdp"))
    staged = to_stages({"w_in": jnp.zeros((layers, d, f)), "w_out": jnp.zeros((layers, f, d))}, 2, repeats)
    x_MB, scale_MB = jnp.zeros((4, 2 * lanes, 4, d)), jnp.ones((4, 2 * lanes, 4))
    full_remat = jax.checkpoint_policies.nothing_saveable

    def loss(staged, x_MB):
        out, stats = circular_pipeline(layer, staged, x_MB, scale_MB, lanes=lanes, remat_policy=full_remat)
        return objective(out, stats)

    with jax.set_mesh(mesh):
        weights = NamedSharding(mesh, P(None, "stage", None, "fsdp"))
        staged = jax.device_put(staged, weights)
        compiled = jax.jit(jax.grad(loss), out_shardings=weights).lower(staged, x_MB).compile()
    stage_weights = sum(w.nbytes for w in jax.tree.leaves(staged)) / 8  # per device: stage 2 x fsdp 4
    assert compiled.memory_analysis().temp_size_in_bytes < 1.5 * stage_weights


def test_the_bubble_is_p_minus_1_of_the_iterations():
    assert bubble_fraction(4, 1, 4) == pytest.approx(3 / 7)
    assert bubble_fraction(4, 2, 8) == pytest.approx(3 / 19)
    assert bubble_fraction(1, 3, 5) == 0


def test_fewer_micro_batches_than_stages_are_refused():
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("stage", "fsdp"))
    stack = to_stages(make_stack(4, jax.random.key(0)), 4, 1)
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="3 micro-batches cannot fill 4 stages"):
        circular_pipeline(layer, stack, jnp.zeros((3, B, S, D)))
    with pytest.raises(ValueError, match="6 layers do not split into 4 stages x 1 repeats"):
        to_stages(make_stack(6, jax.random.key(0)), 4, 1)


@pytest.mark.slow
def test_deepseek_moe_layers_through_the_pipeline_equal_them_in_order():
    """deepseek3-tiny's MoE decoder layers (MLA, router, dropless routed and shared experts) as the
    pipeline's layers, 2 stages x fsdp 2 x expert 2, its buffers filled with NaN: the outputs, the
    MoE loads and balance losses of every layer (the statistics the bias update and the loss take)
    equal the layers in order, and so do the parameters' gradients, with the expert exchange inside
    the stages (the model tests below take both exchange backends)."""
    import flax.linen as nn

    from MaxText.models.decoder import DecoderLayer
    from MaxText.parallel.sharding import axis_rules
    from tests.conftest import make_config

    config = make_config(
        "model_name=deepseek3-tiny", "ici_fsdp_parallelism=2", "ici_expert_parallelism=2", "moe_ep_comm=all_to_all"
    ).with_platform("cpu")
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 1, 2, 2, 1), ("stage", "data", "fsdp", "expert", "tensor"))
    layers, microbatches, rows, seq = 2, 2, 4, 16  # a layer per stage: the loop compiles each layer per micro-batch
    decoder = DecoderLayer(config, True)
    x_MB = jax.random.normal(jax.random.key(0), (microbatches, rows, seq, config.emb_dim))
    positions = jnp.broadcast_to(jnp.arange(seq), (microbatches, rows, seq))
    segments = jnp.ones((microbatches, rows, seq), jnp.int32).at[1, :, -3:].set(0)  # padding in one micro-batch
    init = jax.jit(decoder.init)  # one compile for every layer (eager, each layer's init took seconds)
    variables = [init(jax.random.key(i + 1), x_MB[0], positions[0], segments[0]) for i in range(layers)]
    stack = jax.tree.map(
        lambda *a: jnp.stack(a), *[nn.unbox({k: v[k] for k in ("params", "moe_bias")}) for v in variables]
    )

    def moe_layer(params, x, side):
        (y, _), state = decoder.apply(params, x, *side, mutable=["moe_load", "moe_loss"])
        return y, (state["moe_load"], state["moe_loss"])

    def in_order(stack):
        return reference(moe_layer, stack, x_MB, (positions, segments))

    def pipelined(stack):  # the buffers filled with NaN before real data reaches them
        out, stats = circular_pipeline(moe_layer, to_stages(stack, 2, 1), x_MB, (positions, segments), fill=np.nan)
        return out, from_stages(stats)

    def objective(run, stack):  # one compile each for the outputs, the statistics and the gradients
        out, (load, balance) = run(stack)
        return jnp.sum(out**2) + sum(jnp.sum(b) for b in jax.tree.leaves(balance)), (out, (load, balance))

    with jax.set_mesh(mesh), nn.logical_axis_rules(axis_rules(config)):
        (_, (want, want_stats)), want_grads = jax.jit(jax.value_and_grad(partial(objective, in_order), has_aux=True))(
            stack
        )
        (_, (got, got_stats)), grads = jax.jit(jax.value_and_grad(partial(objective, pipelined), has_aux=True))(stack)
    assert_close(got, want)
    for a, b in zip(jax.tree.leaves(got_stats), jax.tree.leaves(want_stats), strict=True):
        assert_close(a, b)
    assert jax.tree.leaves(want_stats[0])[0].sum() > 0  # the loads counted tokens
    for a, b in zip(jax.tree.leaves(grads["params"]), jax.tree.leaves(want_grads["params"]), strict=True):
        assert_close(a, b)


# The DeepSeek model with 8 MoE layers (p x r divides 8), each pipelined layout once: p in {2, 4},
# r in {1, 2}, m in {p, 2p}, both exchange backends; fsdp, or tensor, inside the stages where
# devices are left; 2 lanes where a micro-batch's rows deal into them.
MODEL_CASES = [
    (
        "ici_pipeline_parallelism=2",
        "num_pipeline_repeats=1",
        "num_pipeline_microbatches=2",
        "ici_fsdp_parallelism=2",
        "moe_ep_comm=allgather",
        "num_pipeline_lanes=2",
    ),
    (
        "ici_pipeline_parallelism=2",
        "num_pipeline_repeats=2",
        "num_pipeline_microbatches=4",
        "ici_fsdp_parallelism=1",
        "ici_tensor_parallelism=2",  # tensor x stage: heads and hidden dims split inside the stages
        "moe_ep_comm=all_to_all",
        "num_pipeline_lanes=2",
    ),
    (
        "ici_pipeline_parallelism=4",
        "num_pipeline_repeats=1",
        "num_pipeline_microbatches=8",
        "ici_fsdp_parallelism=1",
        "moe_ep_comm=all_to_all",
    ),
    (
        "ici_pipeline_parallelism=4",
        "num_pipeline_repeats=2",
        "num_pipeline_microbatches=4",
        "ici_fsdp_parallelism=1",
        "moe_ep_comm=allgather",
    ),
]
MODEL = ("dtype=float32", "base_num_decoder_layers=9", "per_device_batch_size=2", "ici_expert_parallelism=2")


@functools.cache
def model_inputs():
    """deepseek3-tiny's variables, a random correction bias and one batch of 16 sequences with
    padding: the same for every mesh, so initialised once (jitted: eager, the init took 35 s)."""
    import flax.linen as nn

    from MaxText.models.deepseek import DeepSeekV3
    from tests.conftest import make_config

    config = make_config(*MODEL)
    rows, seq = 16, config.max_target_length
    rng = np.random.default_rng(0)
    batch = {
        "inputs": rng.integers(0, config.vocab_size, (rows, seq)),
        "targets": rng.integers(0, config.vocab_size, (rows, seq)),
        "inputs_position": np.tile(np.arange(seq), (rows, 1)),
        "inputs_segmentation": np.ones((rows, seq), np.int32),
    }
    batch["inputs_segmentation"][3, -5:] = 0  # padding: out of the loads and the balance loss
    batch["targets_segmentation"] = batch["inputs_segmentation"]
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    variables = nn.unbox(
        jax.jit(DeepSeekV3(config).init)(
            jax.random.key(0), batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"]
        )
    )
    bias = jax.tree.map(lambda b: 0.01 * jax.random.normal(jax.random.key(3), b.shape), variables["moe_bias"])
    return batch, variables["params"], bias


def model_loss_and_grads(*overrides: str):
    """deepseek3-tiny (1 dense + 8 MoE layers, MTP) on ``model_inputs``: the loss parts, the
    gradient of every parameter, and whether the program moves activations between stages, on the
    mesh of ``overrides``."""
    import flax.linen as nn

    from MaxText.models.deepseek import DeepSeekV3
    from MaxText.parallel.mesh import make_mesh
    from MaxText.parallel.sharding import axis_rules
    from MaxText.train.loss import compute_loss
    from tests.conftest import make_config

    config = make_config(*MODEL, *overrides)
    batch, params, bias = model_inputs()
    model = DeepSeekV3(config)

    def loss(params):
        parts = compute_loss(model, config, params, bias, batch)
        return parts.loss, parts

    with jax.set_mesh(make_mesh(config)), nn.logical_axis_rules(axis_rules(config)):
        lowered = jax.jit(jax.value_and_grad(loss, has_aux=True)).lower(params)
        (_, parts), grads = lowered.compile()(params)
    return parts, grads, "collective_permute" in lowered.as_text()  # the stage transfers: pipelined


@pytest.fixture(scope="module")
def unpipelined():
    return model_loss_and_grads("ici_fsdp_parallelism=4")


@pytest.mark.slow
@pytest.mark.parametrize("overrides", MODEL_CASES, ids=lambda o: "-".join(v.split("=")[1] for v in o))
def test_pipelined_model_equals_the_unpipelined_model(unpipelined, overrides):
    """Loss, MTP and balance terms, every MoE layer's loads (what the bias update takes) and the
    gradient of every parameter: the pipelined model's equal the unpipelined model's."""
    want, want_grads, _ = unpipelined
    got, grads, transfers = model_loss_and_grads(*overrides)
    assert transfers and not unpipelined[2]
    for name in ("loss", "lm_loss", "mtp_loss", "aux_loss"):
        assert_close(getattr(got, name), getattr(want, name))
    assert float(want.aux_loss) > 0
    assert jax.tree.structure(got.expert_load) == jax.tree.structure(want.expert_load)
    for a, b in zip(jax.tree.leaves(got.expert_load), jax.tree.leaves(want.expert_load), strict=True):
        np.testing.assert_array_equal(a, b)  # token counts: exact
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        assert_close(a, b)
