"""Hugging Face interoperability against transformers' own DeepseekV3ForCausalLM (CPU torch).

One tiny random HF model is built per module with every feature that can go wrong switched on:
group-limited routing, a positive nonzero correction bias, q-LoRA, YaRN with a magnitude
correction (mscale != mscale_all_dim) over a sequence longer than the original context, a dense
MLP whose sizes are not multiples of 128 (partial FP8 blocks). Its vocabulary holds the byte
tokenizer's 259 ids, so a run trained from it exports a tokenizer too. torch and transformers are
test dependencies only.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from MaxText.config import load_config  # noqa: E402
from MaxText.data.tokenizer import ByteTokenizer, HuggingFaceTokenizer  # noqa: E402
from MaxText.hf.checkpoint_io import LeafReader  # noqa: E402
from MaxText.hf.convert import convert, tokenizer_keys  # noqa: E402
from MaxText.hf.export import export  # noqa: E402
from MaxText.hf.safetensors_io import SafetensorsFolder, write_safetensors  # noqa: E402
from MaxText.hf.weights import abstract_variables, hf_table, leaves, to_hf  # noqa: E402
from MaxText.train.metrics import read_metrics, step_records  # noqa: E402
from tests.conftest import cpu_env  # noqa: E402
from tools.export_hf_checkpoint import main as export_tool  # noqa: E402
from tools.forward import forward_logits  # noqa: E402
from tools.train_tokenizer import save as save_tokenizer  # noqa: E402
from tools.train_tokenizer import train_bpe  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TEXT = "Grüße, 世界! naïve café — 🙂 <s> x , y .  \n"  # non-ASCII, a special token's spelling, spaces
SEQ = 40  # longer than the original context (16) that YaRN extends
HF_CONFIG = dict(
    vocab_size=320,  # >= the byte tokenizer's 259
    hidden_size=64,
    intermediate_size=200,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=16,
    n_shared_experts=1,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    q_lora_rank=48,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    max_position_embeddings=64,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 0.7,
    },
    initializer_range=0.1,
)


def hf_logits(model_dir: Path, ids: np.ndarray) -> np.ndarray:
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """(HF folder, token ids, transformers' float32 logits)."""
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**HF_CONFIG)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # not all ones, so a misplaced norm shows
                p.copy_(1 + 0.2 * torch.randn_like(p))
        for layer in model.model.layers[1:]:  # positive, and large enough to change the choice
            layer.mlp.gate.e_score_correction_bias.copy_(0.05 + 0.3 * torch.rand(16))
    directory = tmp_path_factory.mktemp("hf") / "tiny-deepseek-v3"
    model.save_pretrained(directory)
    ids = np.random.default_rng(0).integers(0, 256, (2, SEQ))
    return directory, ids, hf_logits(directory, ids)


@pytest.fixture(scope="module")
def converted(hf_model, tmp_path_factory):
    return convert(hf_model[0], tmp_path_factory.mktemp("converted") / "out", progress=False)


def checkpoint_leaves(directory: Path, config) -> dict:
    reader = LeafReader(directory)
    return {leaf: reader.read(leaf) for leaf in leaves(abstract_variables(config))}


def test_converted_logits_match_transformers(hf_model, converted):
    _, ids, reference = hf_model
    ours = forward_logits(converted, ids, "float32")
    assert ours.shape == reference.shape == (2, SEQ, 320)
    difference = np.abs(ours - reference).max()
    assert difference < 1e-4, f"max |logit difference| {difference:.3g} (logits up to {np.abs(reference).max():.3g})"
    overlay = yaml.safe_load((converted / "config.yml").read_text())
    assert overlay["n_routing_groups"] == 4 and overlay["q_lora_rank"] == 48 and overlay["mtp_num_layers"] == 0


RELEASE_CONFIG = {  # DeepSeek-V3's released config.json (its architecture fields)
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "max_position_embeddings": 163840,
    "tie_word_embeddings": False,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
}


def test_release_config_maps_to_the_671b_overlay_and_its_tensor_shapes():
    from MaxText.hf.config_map import config_from_hf, hf_config
    from MaxText.hf.convert import load_overlay, matching_model_name

    arch = config_from_hf(RELEASE_CONFIG, mtp_layers=1)
    assert matching_model_name(arch) == "deepseek3-671b"
    # The converted overlay keeps the checkpoint's YaRN over the 671B overlay's pretraining RoPE.
    converted = load_overlay({"model_name": "deepseek3-671b", **arch}, Path("release"))
    assert (converted.rope_type, converted.rope_factor, converted.model_name) == ("yarn", 40, "deepseek3-671b")
    assert load_config(["model_name=deepseek3-671b", "run_name=t"]).rope_type == "default"
    config = load_config(["model_name=deepseek3-671b", "run_name=t", "rope_type=yarn"])
    table = hf_table(config)
    # embedding, norm, head; dense layers (2 norms, 7 attention, 3 MLP); MoE layers (+ router, bias, shared, experts); MTP
    assert len(table) == 3 + 3 * 12 + 58 * (14 + 3 * 256) + (4 + 14 + 3 * 256) == 46181
    assert table["model.layers.5.self_attn.q_b_proj.weight"].hf_shape == (24576, 1536)
    assert table["model.layers.61.eh_proj.weight"].hf_shape == (7168, 14336)
    exported = hf_config(config, "bfloat16")
    assert {k: exported[k] for k in RELEASE_CONFIG if k != "quantization_config"} == {
        k: v for k, v in RELEASE_CONFIG.items() if k != "quantization_config"
    }


def test_deepseek_v2_with_greedy_softmax_routing_matches_transformers(tmp_path):
    """V2-style: softmax routing without correction bias, full-rank queries, two shared experts.
    transformers' V2 router never renormalises the chosen weights, whatever norm_topk_prob says."""
    v2 = {k: v for k, v in HF_CONFIG.items() if k not in ("n_group", "topk_group")}
    v2.update(q_lora_rank=None, n_shared_experts=2, topk_method="greedy", norm_topk_prob=True)
    v2["rope_parameters"] = {**HF_CONFIG["rope_parameters"], "mscale": 0.707, "mscale_all_dim": 0.707}
    torch.manual_seed(1)
    model = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**v2)).eval()
    model.save_pretrained(tmp_path / "hf")
    ids = np.random.default_rng(1).integers(0, 256, (2, SEQ))
    with torch.no_grad():
        reference = model(torch.tensor(ids)).logits.numpy()
    out = convert(tmp_path / "hf", tmp_path / "out", progress=False)
    assert np.abs(forward_logits(out, ids, "float32") - reference).max() < 1e-4


def test_routing_depends_on_the_converted_correction_bias(hf_model, converted, tmp_path):
    """The parity above is not blind to the bias: the same weights without it route differently."""
    directory, ids, reference = hf_model
    unbiased = tmp_path / "unbiased"
    shutil.copytree(converted, unbiased)
    reader = LeafReader(unbiased)
    bias = reader.read(("moe_bias", "moe_layers", "layers", "moe", "router"))
    assert (bias > 0).all()
    import tensorstore as ts

    store = ts.open(
        {
            "driver": "zarr",
            "kvstore": {"driver": "file", "path": str(unbiased / "state" / "moe_bias.moe_layers.layers.moe.router")},
        }
    ).result()
    store.write(np.zeros_like(bias)).result()
    assert np.abs(forward_logits(unbiased, ids, "float32") - reference).max() > 1e-3


def test_export_round_trips_bit_exactly_and_transformers_loads_it(hf_model, converted, tmp_path):
    directory, ids, reference = hf_model
    exported = export(converted, tmp_path / "exported", dtype="float32", progress=False)
    original, ours = SafetensorsFolder(directory), SafetensorsFolder(exported)
    assert set(ours.tensors) == set(original.tensors)
    for name in original.tensors:
        np.testing.assert_array_equal(ours.read(name), original.read(name), err_msg=name)

    again = convert(exported, tmp_path / "reimported", progress=False)
    config = load_config([str(converted / "config.yml"), "run_name=t"])
    first, second = checkpoint_leaves(converted, config), checkpoint_leaves(again, config)
    for leaf, value in first.items():
        np.testing.assert_array_equal(second[leaf], value, err_msg="/".join(leaf))

    assert np.abs(hf_logits(exported, ids) - reference).max() < 1e-6
    assert not (exported / "tokenizer.json").exists()  # a converted checkpoint's config names no tokenizer


def test_mtp_module_round_trips_through_the_hf_layout(tmp_path):
    """deepseek3-tiny has an MTP module: export puts it under model.layers.3.*, import brings it back."""
    import jax
    import orbax.checkpoint as ocp

    config = load_config(["model_name=deepseek3-tiny", "run_name=t", "vocab_size=256"]).with_platform("cpu")
    rng = np.random.default_rng(0)
    abstract = abstract_variables(config)
    params = jax.tree.map(lambda s: rng.standard_normal(s.shape, np.float32), abstract["params"])
    bias = jax.tree.map(lambda s: rng.random(s.shape, np.float32), abstract["moe_bias"])
    ours = tmp_path / "ours"
    ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).save(ours / "state", {"params": params, "moe_bias": bias})
    keys = ("base_emb_dim", "vocab_size", "mtp_num_layers", "first_num_dense_layers", "base_num_decoder_layers")
    (ours / "config.yml").write_text(yaml.safe_dump({k: getattr(config, k) for k in keys}))

    exported = export(ours, tmp_path / "hf", dtype="float32", progress=False)
    names = set(SafetensorsFolder(exported).tensors)
    assert {
        "model.layers.3.eh_proj.weight",
        "model.layers.3.enorm.weight",
        "model.layers.3.shared_head.head.weight",
    } <= names
    back = convert(exported, tmp_path / "back", progress=False)
    assert yaml.safe_load((back / "config.yml").read_text())["mtp_num_layers"] == 1
    restored = checkpoint_leaves(back, config)
    for leaf, value in leaves({"params": params, "moe_bias": bias}).items():
        np.testing.assert_array_equal(restored[leaf], value, err_msg="/".join(leaf))


def fp8_blocks(weight: "torch.Tensor", block: int = 128) -> tuple["torch.Tensor", "torch.Tensor"]:
    """DeepSeek's weight quantization: per 128x128 block, scale = amax / 448."""
    m, n = weight.shape
    rows, cols = -(-m // block), -(-n // block)
    scale = torch.zeros(rows, cols)
    quantized = torch.zeros(m, n, dtype=torch.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            tile = weight[i * block : (i + 1) * block, j * block : (j + 1) * block]
            scale[i, j] = tile.abs().max().clamp(min=1e-12) / 448.0
            quantized[i * block : (i + 1) * block, j * block : (j + 1) * block] = (tile / scale[i, j]).to(
                torch.float8_e4m3fn
            )
    return quantized, scale


def test_fp8_block_scaled_weights_are_dequantized(hf_model, tmp_path):
    from safetensors.torch import load_file, save_file

    directory, _, _ = hf_model
    tensors = load_file(directory / "model.safetensors")
    fp8, reference = {}, {}
    for name, value in tensors.items():
        quantize = value.ndim == 2 and "embed" not in name and "lm_head" not in name and "mlp.gate." not in name
        if quantize:
            value = value * 40  # several binades, so the per-block scales differ
            fp8[name], fp8[name + "_scale_inv"] = fp8_blocks(value)
            scale = fp8[name + "_scale_inv"].repeat_interleave(128, 0).repeat_interleave(128, 1)
            reference[name] = fp8[name].float() * scale[: value.shape[0], : value.shape[1]]
        else:
            fp8[name] = value
    assert tuple(fp8["model.layers.0.mlp.down_proj.weight_scale_inv"].shape) == (1, 2)  # 200 columns: one partial block
    assert tuple(fp8["model.layers.0.mlp.gate_proj.weight_scale_inv"].shape) == (2, 1)
    quantized = tmp_path / "fp8"
    quantized.mkdir()
    save_file(fp8, quantized / "model.safetensors")
    hf = json.loads((directory / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (quantized / "config.json").write_text(json.dumps(hf))

    out = convert(quantized, tmp_path / "converted", progress=False)
    config = load_config([str(out / "config.yml"), "run_name=t"]).with_platform("cpu")
    ours = checkpoint_leaves(out, config)
    for name, slot in hf_table(config).items():
        if name in reference:
            np.testing.assert_array_equal(
                to_hf(ours[slot.leaf][slot.index], slot.layout), reference[name].numpy(), err_msg=name
            )


def test_export_writes_deepseeks_fp8_format_and_reads_it_back(hf_model, converted, tmp_path):
    """``dtype="fp8"``: the linear layers as E4M3 with 128 x 128 ``_scale_inv`` blocks (the
    blockwise recipe's weight blocks), the rest bfloat16, ``quantization_config`` as released;
    converting it back gives every quantized weight exactly as fp8_blockwise training multiplies
    it, and the others as bfloat16 rounds them."""
    import jax.numpy as jnp
    import ml_dtypes

    from MaxText.quantization import Recipe, fake_quantize

    exported = export(converted, tmp_path / "fp8", dtype="fp8", progress=False)
    hf = json.loads((exported / "config.json").read_text())
    assert hf["quantization_config"]["weight_block_size"] == [128, 128] and hf["torch_dtype"] == "bfloat16"
    folder = SafetensorsFolder(exported)
    fp8 = {n for n, t in folder.tensors.items() if t.dtype == "F8_E4M3"}
    assert "model.layers.2.mlp.experts.7.down_proj.weight" in fp8 and "model.layers.0.self_attn.o_proj.weight" in fp8
    assert not any(("embed" in n or "lm_head" in n or "mlp.gate." in n or "norm" in n) for n in fp8)
    assert {n + "_scale_inv" for n in fp8} <= set(folder.tensors)
    assert folder.read("model.layers.0.mlp.down_proj.weight_scale_inv").shape == (1, 2)  # 200 columns

    back = convert(exported, tmp_path / "back", progress=False)
    config = load_config([str(converted / "config.yml"), "run_name=t"]).with_platform("cpu")
    original, restored = checkpoint_leaves(converted, config), checkpoint_leaves(back, config)
    blockwise = Recipe("fp8_blockwise", 128)
    for name, slot in hf_table(config).items():
        want = to_hf(original[slot.leaf][slot.index], slot.layout)
        got = to_hf(restored[slot.leaf][slot.index], slot.layout)
        if name in fp8:
            want = np.asarray(fake_quantize(jnp.asarray(want, jnp.float32), blockwise, (0, 1)))
        elif "e_score_correction_bias" not in name:
            want = want.astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(got, want, err_msg=name)


def run_convert_tool(capsys, hf_path: Path, output: Path) -> str:
    from tools.convert_hf_checkpoint import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--hf_path", str(hf_path), "--output_path", str(output)])
    assert exit_info.value.code == 2
    lines = [line for line in capsys.readouterr().err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in lines[0]
    return lines[0]


def edited_copy(source: Path, target: Path, drop: str = "", add: str = "", config: dict | None = None) -> Path:
    target.mkdir()
    folder = SafetensorsFolder(source)
    names = [n for n in folder.tensors if n != drop]
    arrays = {n: folder.read(n) for n in names}
    if add:
        arrays[add] = np.zeros((3,), np.float32)
    write_safetensors(
        target / "model.safetensors", {n: (a.shape, a.dtype) for n, a in arrays.items()}, iter(arrays.items())
    )
    hf = json.loads((source / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**hf, **(config or {})}))
    return target


def test_bad_checkpoints_exit_2_naming_the_problem(hf_model, tmp_path, capsys):
    directory, _, _ = hf_model
    out = tmp_path / "out"
    (tmp_path / "empty").mkdir()
    assert "no config.json" in run_convert_tool(capsys, tmp_path / "empty", out)

    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(directory / "config.json", no_weights)
    assert "no *.safetensors" in run_convert_tool(capsys, no_weights, out)

    llama = edited_copy(directory, tmp_path / "llama", config={"model_type": "llama"})
    assert "model_type" in run_convert_tool(capsys, llama, out)

    dropped = "model.layers.2.mlp.experts.7.up_proj.weight"
    assert dropped in run_convert_tool(capsys, edited_copy(directory, tmp_path / "missing", drop=dropped), out)

    extra = "model.layers.1.mlp.extra.weight"
    assert extra in run_convert_tool(capsys, edited_copy(directory, tmp_path / "extra", add=extra), out)

    wider = edited_copy(directory, tmp_path / "wider", config={"intermediate_size": 208})
    line = run_convert_tool(capsys, wider, out)
    assert "model.layers.0.mlp." in line and "shape" in line
    assert not out.exists()  # nothing is written before everything checks out


@pytest.mark.slow
def test_training_continues_from_a_converted_checkpoint_and_exports_back(hf_model, converted, tmp_path, capsys):
    """Convert -> train 3 steps from it -> export the run folder (its newest step) -> transformers
    matches our logits, and its tokenizer (the run's byte tokenizer) gives our ids."""
    command = [
        sys.executable,
        "-m",
        "MaxText.train",
        str(converted / "config.yml"),
        f"load_parameters_path={converted}",
        f"base_output_directory={tmp_path}",
        "run_name=finetune",
        "dataset_type=synthetic",
        "steps=3",
        "log_period=1",
        "checkpoint_period=2",
        "enable_tensorboard=false",
        "eval_interval=0",
    ]
    env = cpu_env(1)
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert f"parameters loaded from {converted}" in result.stdout
    run = tmp_path / "finetune"
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith(f"outputs in {run}: config.yml, metrics.jsonl")
    assert last.endswith(f"; newest checkpoint: {run / 'checkpoints' / '3'}")
    records = step_records(read_metrics(run))
    assert [r["step"] for r in records] == [1, 2, 3] and all(np.isfinite(r["loss"]) for r in records)

    trained = run / "checkpoints" / "3"
    ids = hf_model[1]
    ours = forward_logits(run, ids, "float32")  # the run folder: its newest step, 3
    np.testing.assert_array_equal(ours, forward_logits(trained, ids, "float32"))
    assert np.abs(ours - forward_logits(converted, ids, "float32")).max() > 1e-4  # the weights did change
    capsys.readouterr()
    export_tool(["--checkpoint", str(run), "--output_path", str(tmp_path / "exported"), "--dtype", "float32"])
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == f"checkpoint: {trained} (the newest of 2 complete steps in {run / 'checkpoints'})"
    exported = tmp_path / "exported"
    assert printed[-1].startswith(f"exported to {exported}: config.json, tokenizer.json, tokenizer_config.json")
    assert np.abs(hf_logits(exported, ids) - ours).max() < 1e-4

    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    text_ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    assert text_ids == ByteTokenizer().encode(TEXT).tolist()
    assert tokenizer(TEXT).input_ids == [ByteTokenizer.bos_id, *text_ids]  # add_bos: documents start with BOS
    assert tokenizer.decode(text_ids) == TEXT
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    model = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    assert (model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id) == (1, 2, 0)
    with torch.no_grad():
        logits = model(torch.tensor([tokenizer(TEXT).input_ids])).logits
    assert logits.shape == (1, len(text_ids) + 1, HF_CONFIG["vocab_size"]) and torch.isfinite(logits).all()


def with_tokenizer(converted: Path, target: Path, tokenizer_type: str, tokenizer_path: Path) -> Path:
    """A copy of the converted checkpoint whose config.yml names a tokenizer."""
    shutil.copytree(converted, target)
    overlay = yaml.safe_load((target / "config.yml").read_text())
    overlay.update(tokenizer_type=tokenizer_type, tokenizer_path=str(tokenizer_path))
    (target / "config.yml").write_text(yaml.safe_dump(overlay))
    return target


def test_conversion_records_the_checkpoints_tokenizer(tmp_path):
    """A folder with a tokenizer.json gives a config.yml that trains (and exports) with it."""
    assert tokenizer_keys(tmp_path) == {}
    (tmp_path / "tokenizer.json").write_text("{}")
    keys = tokenizer_keys(tmp_path)
    assert keys == {"tokenizer_type": "huggingface", "tokenizer_path": str((tmp_path / "tokenizer.json").absolute())}
    overlay = tmp_path / "config.yml"
    overlay.write_text(yaml.safe_dump(keys))
    config = load_config([str(overlay), "run_name=t"])
    assert (config.tokenizer_type, config.tokenizer_path) == ("huggingface", keys["tokenizer_path"])


def test_export_copies_a_huggingface_tokenizer(converted, tmp_path, capsys):
    """tokenizer_type=huggingface: tokenizer.json and its tokenizer_config.json copied; one without
    a tokenizer_config.json (passed as --tokenizer) gets one naming BOS and EOS. The ids are ours."""
    folder = tmp_path / "tok"
    save_tokenizer(train_bpe([TEXT * 3, "the quick brown fox jumps over the lazy dog\n" * 5] * 4, 300), folder)
    ours = HuggingFaceTokenizer(folder)
    checkpoint = with_tokenizer(converted, tmp_path / "named", "huggingface", folder)
    exported = export(checkpoint, tmp_path / "hf", dtype="float32", progress=False)
    assert (exported / "tokenizer_config.json").read_text() == (folder / "tokenizer_config.json").read_text()
    hf = json.loads((exported / "config.json").read_text())
    assert (hf["pad_token_id"], hf["bos_token_id"], hf["eos_token_id"]) == (0, ours.bos_id, ours.eos_id) == (0, 1, 2)
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    assert tokenizer(TEXT, add_special_tokens=False).input_ids == ours.encode(TEXT).tolist()
    assert tokenizer.decode(tokenizer(TEXT).input_ids) == TEXT

    (folder / "tokenizer_config.json").unlink()
    lines = []
    export(
        converted,
        tmp_path / "bare",
        dtype="float32",
        progress=False,
        tokenizer=folder / "tokenizer.json",
        log=lines.append,
    )
    assert lines == [
        f"tokenizer: {folder / 'tokenizer.json'} copied as tokenizer.json; tokenizer_config.json written naming BOS and EOS"
    ]
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "bare")
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<s>", "</s>")
    assert tokenizer(TEXT, add_special_tokens=False).input_ids == ours.encode(TEXT).tolist()


def run_export_tool(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        export_tool(list(argv))
    assert exit_info.value.code == 2
    lines = [line for line in capsys.readouterr().err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in lines[0]
    return lines[0]


def test_export_bad_input_exits_2_naming_it(converted, tmp_path, capsys):
    out = str(tmp_path / "out")
    assert "no such folder" in run_export_tool(capsys, "--checkpoint", str(tmp_path / "nothing"), "--output_path", out)
    assert "not a checkpoint" in run_export_tool(capsys, "--checkpoint", str(tmp_path), "--output_path", out)
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    line = run_export_tool(capsys, "--checkpoint", str(tmp_path / "run"), "--output_path", out)
    assert "holds no complete checkpoint step" in line
    spm = with_tokenizer(converted, tmp_path / "spm", "sentencepiece", tmp_path / "sp.model")
    line = run_export_tool(capsys, "--checkpoint", str(spm), "--output_path", out)
    assert "SentencePiece" in line and "--tokenizer" in line
    line = run_export_tool(capsys, "--checkpoint", str(converted), "--output_path", out, "--tokenizer", str(tmp_path))
    assert line.startswith(f"error: --tokenizer {tmp_path}: ") and "no tokenizer.json" in line
    assert not Path(out).exists()  # nothing is written before everything checks out
