"""Parameter, FLOPs and memory accounting against the DeepSeek-V3 reference numbers and a real init.

The 671B figures are the exact counts in docs/reference (checked against the released weights); the
formulas are written out here, independently of the accounting module's path rules.
"""

import json
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from conftest import make_config

from MaxText.models import accounting
from MaxText.models.deepseek import DeepSeekV3

REPO = Path(__file__).resolve().parents[1]
CLI = REPO / "tools" / "model_stats.py"

# DeepSeek-V3 671B shapes.
D, V, H, RQ, RKV, DN, DR, DV, ID, IM, E, K = 7168, 129280, 128, 1536, 512, 128, 64, 128, 18432, 2048, 256, 8
DENSE, MOE, S = 3, 58, 4096
ATTENTION = D * RQ + RQ + RQ * H * (DN + DR) + D * (RKV + DR) + RKV + RKV * H * (DN + DV) + H * DV * D
EXPERT = 3 * D * IM
ROUTER = E * D + E  # gate matrix + correction bias
DENSE_LAYER = ATTENTION + 2 * D + 3 * D * ID
MOE_LAYER = ATTENTION + 2 * D + ROUTER + (E + 1) * EXPERT
MTP_MODULE = 2 * D + 2 * D * D + MOE_LAYER + D


@pytest.fixture(scope="module")
def big():
    config = make_config(model="deepseek3-671b")
    return config, accounting.count_parameters(config)


def test_reference_formulas_themselves():
    assert (ATTENTION, DENSE_LAYER, EXPERT, ROUTER, MOE_LAYER) == (
        187_107_328,
        583_483_392,
        44_040_192,
        1_835_264,
        11_507_286_272,
    )


def test_671b_totals(big):
    _, counts = big
    assert counts.total == 671_026_419_200 == 2 * V * D + D + DENSE * DENSE_LAYER + MOE * MOE_LAYER
    assert counts.active == 37_552_297_472
    assert counts.mtp == 11_610_068_224 == MTP_MODULE


def test_671b_components(big):
    _, counts = big
    layers = DENSE + MOE
    assert counts.main == {
        "attention": layers * ATTENTION,
        "layer_norms": layers * 2 * D,
        "dense_mlp": DENSE * 3 * D * ID,
        "router": MOE * ROUTER,
        "shared_experts": MOE * EXPERT,
        "routed_experts": MOE * E * EXPERT,
        "embedding": V * D,
        "output_head": V * D,
        "final_norm": D,
    }
    mtp = {name: n for name, n in counts.mtp_parts.items() if n}
    assert mtp == {
        "attention": ATTENTION,
        "layer_norms": 2 * D,
        "router": ROUTER,
        "shared_experts": EXPERT,
        "routed_experts": E * EXPERT,
        "mtp_projection": 2 * D * D,
        "mtp_norms": 3 * D,
    }


def test_671b_flops(big):
    config, counts = big
    flops = accounting.train_flops(config, counts)
    attention_per_layer = 3 * S * H * (DN + DR + DV)
    active = counts.total - MOE * E * EXPERT * (E - K) // E
    assert flops.matmul == 6 * (active - V * D)
    assert flops.attention == (DENSE + MOE) * attention_per_layer
    mtp_active = MTP_MODULE - E * EXPERT * (E - K) // E
    assert flops.mtp == 6 * mtp_active + attention_per_layer + 6 * V * D
    assert flops.matmul + flops.attention == pytest.approx(250.5e9, rel=0.01)
    assert flops.mtp == pytest.approx(10e9, rel=0.025)  # the reference rounds 10.19 to "~10"
    assert accounting.train_flops_per_token(config) == float(flops.total)


def test_671b_memory(big):
    config, counts = big
    biases = (MOE + 1) * E  # float32 correction biases, not trained by the optimizer
    memory = accounting.memory_estimate(config)
    assert memory.weights == 4 * (counts.total + counts.mtp)
    assert memory.gradients == 4 * (counts.total + counts.mtp - biases)
    assert memory.optimizer == 2 * memory.gradients
    bf16 = accounting.memory_estimate(make_config("weight_dtype=bfloat16", model="deepseek3-671b"))
    assert bf16.weights == 2 * (counts.total + counts.mtp - biases) + 4 * biases


def test_tiny_counts_match_a_real_init(tiny_config, monkeypatch):
    # Zeros instead of truncated-normal: same variables and shapes, but XLA:CPU compiles the
    # truncated normal's erf/erf_inv slowly (~0.3 s per parameter, 30-50 s for this init).
    monkeypatch.setattr(nn.initializers, "truncated_normal", lambda stddev: nn.initializers.zeros)
    tokens = jnp.zeros((1, 2), jnp.int32)
    variables = nn.meta.unbox(jax.jit(DeepSeekV3(tiny_config).init)(jax.random.key(0), tokens, tokens, tokens))
    real = sum(x.size for col in accounting.PARAM_COLLECTIONS for x in jax.tree.leaves(variables[col]))
    counts = accounting.count_parameters(tiny_config)
    assert counts.total + counts.mtp == real
    assert counts.mtp > 0 and counts.active < counts.total


@pytest.mark.parametrize("depth", [0, 2])
def test_mtp_depth_scales_mtp_only(tiny_config, depth):
    one = accounting.count_parameters(tiny_config)
    config = make_config(f"mtp_num_layers={depth}")
    counts = accounting.count_parameters(config)
    assert (counts.total, counts.mtp) == (one.total, depth * one.mtp)
    assert accounting.train_flops(config).mtp == depth * accounting.train_flops(tiny_config).mtp


def test_unknown_parameter_path_is_an_error():
    with pytest.raises(ValueError, match="COMPONENT_RULES"):
        accounting.component_of("new_block/weight")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CLI), *args], capture_output=True, text=True, cwd=REPO, timeout=60)


def test_cli_json():
    result = _cli("model_name=deepseek3-671b", "--json", "--devices", "64")
    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stdout)
    assert (stats["total_params"], stats["active_params"], stats["mtp_params"]) == (
        671_026_419_200,
        37_552_297_472,
        11_610_068_224,
    )
    assert stats["train_flops_per_token"] == pytest.approx(260.6e9, rel=0.01)
    assert stats["components"]["attention"] == 61 * ATTENTION
    assert stats["memory_bytes_per_device"]["total"] == stats["memory_bytes"]["total"] / 64


def test_cli_bad_key_exits_2(capsys):
    from tools.model_stats import main

    with pytest.raises(SystemExit) as exit_info:
        main(["model_name=deepseek3-tiny", "no_such_key=1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "no_such_key" in err


def test_table_lists_every_section(capsys):
    from tools.model_stats import main

    main(["model_name=deepseek3-tiny", "run_name=test", "--devices", "2"])
    table = capsys.readouterr().out
    for text in ("routed_experts", "active per token", "MTP modules", "GFLOP", "per device of 2"):
        assert text in table


@pytest.mark.parametrize("model", ["deepseek3-tiny", "deepseek3-671b"])
def test_counts_of_the_train_states_shapes_equal_the_traced_counts(model):
    """The training loop counts its FLOPs from the abstract train state it already built (one trace
    of the model fewer at start-up): the same counts as ``count_parameters``' own trace."""
    from MaxText.parallel.mesh import make_mesh
    from MaxText.train.optimizer import make_optimizer
    from MaxText.train.state import abstract_train_state

    config = make_config("ici_fsdp_parallelism=8", model=model)
    abstract = abstract_train_state(DeepSeekV3(config), config, make_optimizer(config), make_mesh(config))
    counts = accounting.count_parameters_of(config, abstract.variables)
    assert counts == accounting.count_parameters(config)
    assert accounting.train_flops_per_token(config, counts) == accounting.train_flops_per_token(config)
