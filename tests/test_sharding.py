"""Mesh construction from ici_*/dcn_* and the logical-axis shardings, on 8 simulated devices."""

import jax
import pytest
from jax.sharding import PartitionSpec as P

from MaxText.config import ConfigError
from MaxText.models.deepseek import DeepSeekV3
from MaxText.parallel.mesh import make_mesh, mesh_shape
from MaxText.parallel.sharding import logical_to_shardings, parameter_mesh_axes
from MaxText.train.state import dummy_inputs
from tests.conftest import make_config


def test_fill_and_dcn_outermost():
    config = make_config("dcn_data_parallelism=2", "ici_fsdp_parallelism=-1")
    assert mesh_shape(config, 8) == ([1, 2, 1, 1, 1], [1, 1, 4, 1, 1])
    mesh = make_mesh(config, jax.devices())
    assert dict(mesh.shape) == {"stage": 1, "data": 2, "fsdp": 4, "expert": 1, "tensor": 1}
    # The dcn factor is outermost: the first fast domain holds devices 0-3.
    assert sorted(d.id for d in mesh.devices[0, 0].reshape(-1)) == [0, 1, 2, 3]


def test_dcn_fill_uses_the_remaining_devices():
    config = make_config("ici_fsdp_parallelism=2", "ici_expert_parallelism=2", "dcn_data_parallelism=-1")
    assert mesh_shape(config, 8) == ([1, 2, 1, 1, 1], [1, 1, 2, 2, 1])


def test_pipeline_stages_are_the_outermost_split():
    """Stages across fast domains: the first stage holds the first domain's devices, and the MoE
    stack's layers are split over the stages, each holding its consecutive layers."""
    config = make_config("dcn_pipeline_parallelism=2", "ici_expert_parallelism=2", "ici_fsdp_parallelism=-1")
    assert mesh_shape(config, 8) == ([2, 1, 1, 1, 1], [1, 1, 2, 2, 1])
    mesh = make_mesh(config, jax.devices())
    assert sorted(d.id for d in mesh.devices[0].reshape(-1)) == [0, 1, 2, 3]
    moe = _shardings(config)["moe_layers"]["layers"]
    assert moe["moe"]["wi_0"].spec[0] == "stage" and moe["attention"]["wq_a"].spec[0] == "stage"
    assert _shardings(config)["dense_layers"]["layers"]["mlp"]["wi_0"].spec[0] is None  # outside the pipeline


@pytest.mark.parametrize(
    "overrides, devices, key",
    [
        (("ici_fsdp_parallelism=3",), 8, "ici_"),
        (("ici_fsdp_parallelism=1", "ici_expert_parallelism=-1"), 32, "ici_expert_parallelism"),
        # 8 sequences in 4 micro-batches of 2 rows, over the 4 devices of a stage: refused.
        (
            ("ici_pipeline_parallelism=2", "num_pipeline_microbatches=4", "per_device_batch_size=1"),
            8,
            "num_pipeline_microbatches",
        ),
        # 16 sequences in 2 micro-batches of 8 rows over a stage's 4 devices: 2 lanes of 4 fit, 4 of 2 do not.
        (
            (
                "ici_pipeline_parallelism=2",
                "num_pipeline_microbatches=2",
                "per_device_batch_size=2",
                "num_pipeline_lanes=4",
            ),
            8,
            "num_pipeline_lanes",
        ),
    ],
)
def test_mesh_errors_name_the_key(overrides, devices, key):
    with pytest.raises(ConfigError, match=key):
        mesh_shape(make_config(*overrides), devices)


def _shardings(config):
    model = DeepSeekV3(config)
    boxed = jax.eval_shape(model.init, jax.random.key(0), *dummy_inputs(config))
    return logical_to_shardings({"params": boxed["params"]}, make_mesh(config, jax.devices()), config)["params"]


def test_parameters_land_on_their_mesh_axes():
    shardings = _shardings(make_config("ici_fsdp_parallelism=2", "ici_expert_parallelism=4"))
    moe = shardings["moe_layers"]["layers"]["moe"]
    assert moe["wi_0"].spec == P(
        "stage", ("expert", "fsdp"), None, "tensor"
    )  # [layers (over the stages), exp, embed, mlp]
    assert moe["wo"].spec == P("stage", ("expert", "fsdp"), "tensor", None)  # [layers, exp, mlp, embed]
    assert shardings["token_embedding"].spec == P("tensor", ("fsdp", "expert"))  # [vocab, embed]
    # The MLA up-projections split their latent dim over fsdp x expert (32 / 8 divides) ...
    attention = shardings["moe_layers"]["layers"]["attention"]
    assert attention["wkv_b"].spec == P(
        "stage", ("fsdp", "expert"), "tensor", None
    )  # [layers, kv_lora, heads, head_dim]
    assert attention["wq_b"].spec == P("stage", ("fsdp", "expert"), "tensor", None)
    # ... and over fsdp alone where fsdp x expert does not divide (kv_lora 36 / 8, 36 / 2 does).
    fallback = _shardings(make_config("ici_fsdp_parallelism=2", "ici_expert_parallelism=4", "kv_lora_rank=36"))
    assert fallback["moe_layers"]["layers"]["attention"]["wkv_b"].spec == P("stage", "fsdp", "tensor", None)
    # Split over the vocabulary, the embedding and the head are stored by rows over the group, as
    # the split reads them (their embed dim over the FSDP axes left).
    split = _shardings(
        make_config("ici_fsdp_parallelism=2", "ici_expert_parallelism=4", "vocab_parallel_axes=[expert]")
    )
    assert split["token_embedding"].spec == P("expert", "fsdp")  # [vocab, embed]
    assert split["output_head"].spec == P("fsdp", "expert")  # [embed, vocab]


def test_divisibility_fallback_follows_rule_order():
    rules = (("embed", ("fsdp", "expert")), ("embed", "fsdp"), ("kv_lora", ("fsdp", "expert")), ("kv_lora", "fsdp"))
    sizes = {"fsdp": 4, "expert": 16}
    # wkv_a [embed, kv_lora]: embed takes fsdp x expert; kv_lora finds both its axes used and stays whole.
    assert parameter_mesh_axes(("embed", "kv_lora"), (7168, 576), rules, sizes) == (("fsdp", "expert"), None)
    # wkv_b's latent 512 divides 64 ways; 36 does not even divide 4 ways, which is an error naming the split.
    assert parameter_mesh_axes(("kv_lora", None), (512, 3), rules, sizes) == (("fsdp", "expert"), None)
    assert parameter_mesh_axes(("kv_lora", None), (1020, 3), rules, sizes) == ("fsdp", None)
    with pytest.raises(ValueError, match=r"4 ways over fsdp \(dim 34\)"):
        parameter_mesh_axes(("kv_lora", None), (34, 3), rules, sizes)


def test_indivisible_split_names_the_parameter():
    config = make_config("ici_fsdp_parallelism=8", "kv_lora_rank=36")
    with pytest.raises(ConfigError, match=r"wkv_b.*36"):
        _shardings(config)
