"""The config contract: one file of defaults, a fixed precedence, one-line errors, no side effects.

Every case here is the user's view of ``MaxText/config.py``: what base.yml promises, what each layer
overrides, and what a bad command line prints. Loading a config must never start a runtime, so the
checks that could be fooled by the test process (which has jax imported) run in a fresh subprocess.
"""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from conftest import make_config
from pydantic import ValidationError

from MaxText.config import (
    BASE_YML,
    Config,
    ConfigError,
    available_models,
    config_to_yaml,
    load_config,
    load_config_or_exit,
)

REPO = Path(__file__).resolve().parents[1]
SHIPPED_MODELS = available_models()


def _subprocess_env(tmp_path: Path) -> dict[str, str]:
    """A clean environment for child processes: CPU only, the repo importable, no stray writes."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_", "SLURM_"))}
    env.update(
        JAX_PLATFORMS="cpu",
        PYTHONPATH=str(REPO),
        PYTHONDONTWRITEBYTECODE="1",
        HOME=str(home),
        MPLCONFIGDIR=str(home / "mpl"),
    )
    return env


# ---------------------------------------------------------------- (1) schema and base.yml in step


def test_schema_fields_are_exactly_the_base_yml_keys():
    base_keys = set(yaml.safe_load(BASE_YML.read_text()))
    fields = set(Config.model_fields)
    assert not base_keys - fields, f"base.yml keys missing from Config: {sorted(base_keys - fields)}"
    assert not fields - base_keys, f"Config fields missing from base.yml: {sorted(fields - base_keys)}"


def test_every_base_yml_key_has_a_comment():
    """A key line carries its comment inline; a key whose value is a block may carry it on the line above."""
    lines = BASE_YML.read_text().splitlines()
    uncommented = []
    for i, line in enumerate(lines):
        match = re.match(r"^([A-Za-z_][A-Za-z0-9_]*):(.*)$", line)
        if not match:
            continue
        inline = "#" in match.group(2)
        above = i > 0 and lines[i - 1].lstrip().startswith("#")
        block_value = match.group(2).strip() == ""
        if not (inline or (block_value and above)):
            uncommented.append(match.group(1))
    assert not uncommented, f"base.yml keys without a comment: {uncommented}"


# ---------------------------------------------------------------- (2) overlays and precedence


def test_models_are_shipped():
    assert {"deepseek3-671b", "deepseek3-small", "deepseek3-tiny"} <= set(SHIPPED_MODELS)


@pytest.mark.parametrize("model", SHIPPED_MODELS)
def test_shipped_overlay_loads_and_validates(model):
    overlay = yaml.safe_load((BASE_YML.parent / "models" / f"{model}.yml").read_text()) or {}
    config = make_config(model=model)
    assert config.model_name == model
    for key, value in overlay.items():
        assert getattr(config, key) == value, f"{model}.yml sets {key}={value!r}, config has {getattr(config, key)!r}"


def test_base_defaults_fill_what_the_overlay_leaves():
    base = yaml.safe_load(BASE_YML.read_text())
    config = make_config()  # deepseek3-tiny sets no Adam betas
    assert (config.adam_b1, config.adam_b2) == (base["adam_b1"], base["adam_b2"])


def test_precedence_base_overlay_extra_yml_command_line(tmp_path):
    base = yaml.safe_load(BASE_YML.read_text())
    overlay = yaml.safe_load((BASE_YML.parent / "models" / "deepseek3-tiny.yml").read_text())
    assert overlay["learning_rate"] != base["learning_rate"]
    extra = tmp_path / "extra.yml"
    extra.write_text("learning_rate: 0.125\nseed: 7\n")

    assert make_config().learning_rate == overlay["learning_rate"]  # overlay over base
    from_yml = make_config(str(extra))
    assert (from_yml.learning_rate, from_yml.seed) == (0.125, 7)  # extra yml over overlay
    from_cli = make_config(str(extra), "learning_rate=0.5")
    assert (from_cli.learning_rate, from_cli.seed) == (0.5, 7)  # key=value over extra yml


def test_model_name_from_extra_yml_selects_the_overlay_and_command_line_wins(tmp_path):
    extra = tmp_path / "small.yml"
    extra.write_text("model_name: deepseek3-small\n")
    assert load_config([str(extra), "run_name=t"]).num_experts == 64
    assert load_config([str(extra), "run_name=t", "model_name=deepseek3-tiny"]).num_experts == 16


def test_empty_run_name_defaults_to_model_and_timestamp():
    config = load_config(["model_name=deepseek3-tiny"])
    assert re.fullmatch(r"deepseek3-tiny-\d{8}-\d{6}", config.run_name)


# ---------------------------------------------------------------- (3) bad input: ConfigError, one line, names the key

BAD_INPUTS = {
    "unknown key": (["num_expert=4"], ["num_expert", "num_experts"]),
    "wrong type": (["steps=abc"], ["steps"]),
    "wrong choice": (["moe_matmul=cublas"], ["moe_matmul"]),
    "unknown model": (["model_name=deepseek3-tiniy"], ["model_name", "deepseek3-tiny"]),
    "missing extra yml": (["no/such/extra.yml"], ["no/such/extra.yml"]),
    "experts not divisible by expert parallelism": (
        ["num_experts=16", "ici_expert_parallelism=3"],
        ["ici_expert_parallelism", "num_experts"],
    ),
    "top-k above experts": (["num_experts_per_tok=17"], ["num_experts_per_tok"]),
    "groups not dividing experts": (["n_routing_groups=3"], ["n_routing_groups"]),
    "topk groups above groups": (["topk_routing_group=5"], ["topk_routing_group", "n_routing_groups"]),
    "fill in both ici and dcn": (["ici_fsdp_parallelism=-1", "dcn_data_parallelism=-1"], ["dcn_", "ici_"]),
    "capacity factor neither -1 nor positive": (["capacity_factor=0"], ["capacity_factor"]),
    "block rows": (["moe_block_rows=0"], ["moe_block_rows"]),
    "block levels": (["moe_block_rows=48", "moe_min_block_rows=8"], ["moe_block_rows", "power of two"]),
    "min block rows": (["moe_min_block_rows=0"], ["moe_min_block_rows"]),
    "MoE layers not splitting into the stages": (
        ["base_num_decoder_layers=61", "first_num_dense_layers=3", "ici_pipeline_parallelism=4"],
        ["ici_pipeline_parallelism", "58 MoE layers", "4 stages", "1, 2, 29, 58"],
    ),
    "MoE layers not splitting into the repeats": (
        ["base_num_decoder_layers=5", "dcn_pipeline_parallelism=2", "num_pipeline_repeats=3"],
        ["num_pipeline_repeats", "2 stages x 3 repeats"],
    ),
    "fewer micro-batches than stages": (
        ["base_num_decoder_layers=5", "ici_pipeline_parallelism=4", "num_pipeline_microbatches=2"],
        ["num_pipeline_microbatches", "2 micro-batches cannot fill 4 stages"],
    ),
    "the dropping baseline pipelined": (["ici_pipeline_parallelism=2", "capacity_factor=1.25"], ["capacity_factor"]),
    "a latency profile neither model nor a profile file": (["latency_profile=modle"], ["latency_profile", ".pbtxt"]),
}


@pytest.mark.parametrize("args, expected", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_input_raises_one_line_config_error_naming_the_key(args, expected):
    with pytest.raises(ConfigError) as info:
        make_config(*args)
    message = str(info.value)
    assert "\n" not in message, message
    for word in expected:
        assert word in message, f"{word!r} not in {message!r}"


def test_unknown_key_in_extra_yml_names_key_and_file(tmp_path):
    extra = tmp_path / "typo.yml"
    extra.write_text("learning_rat: 0.1\n")
    with pytest.raises(ConfigError, match=r"learning_rat.*typo\.yml.*learning_rate"):
        make_config(str(extra))


# ---------------------------------------------------------------- (3b) strict types and ranges

# Values that loaded before types were strict and ranges declared: each must now be refused.
LOADED_BEFORE = [
    "learning_rate=-1",
    "adam_b2=1.5",
    "routed_bias_update_rate=-0.01",
    "load_balance_loss_weight=-1",
    "steps=3.0",
    "enable_checkpointing=yes",
]
REFUSED = [
    *LOADED_BEFORE,
    # types: an int is an int, a bool is true/false, a float is a finite number
    "num_experts=16.0",
    "steps=1e3",
    'steps="3"',
    "log_period=true",
    "learning_rate=true",
    "routed_bias=1",
    "rope_interleave=on",
    "packing=no",
    "adam_eps=.inf",
    "learning_rate=.nan",
    # ranges
    "adam_b1=1",
    "adam_b1=-0.1",
    "adam_eps=0",
    "synthetic_noise=1.5",
    "learning_rate_final_fraction=-0.1",
    "log_period=0",
    "per_device_batch_size=0",
    "seed=-1",
    "vocab_size=0",
    "routed_scaling_factor=0",
    "normalization_layer_epsilon=0",
    "init_weights_std=-0.02",
    "rope_factor=0.5",
    "rope_max_timescale=1",
    "beta_slow=0",
    "mtp_loss_scaling_factor=-0.1",
    "gradient_clipping_threshold=-1",
    "max_num_checkpoints_to_keep=0",
    "ici_tensor_parallelism=0",
    "dcn_data_parallelism=-2",
    "learning_rate_schedule_steps=0",
    "preemption_check_period=0",
    "mtp_num_layers=-1",
    "shared_experts=-1",
    "q_lora_rank=-1",
    "max_target_length=1",
    "eval_steps=0",
    "grain_worker_count=-1",
]


@pytest.mark.parametrize("arg", REFUSED)
def test_wrong_type_or_out_of_range_is_one_line_naming_the_key(arg):
    with pytest.raises(ConfigError) as info:
        make_config(arg)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"config key '{arg.partition('=')[0]}': "), message


ACCEPTED = {
    "learning_rate=1e-4": 1e-4,  # YAML 1.1 would read a string
    "adam_eps=1E-8": 1e-8,
    "capacity_factor=2": 2.0,  # a float key takes an int
    "learning_rate=0": 0.0,
    "adam_b2=0": 0.0,
    "adam_b1=0.999": 0.999,
    "synthetic_noise=1": 1.0,
    "gradient_clipping_threshold=0": 0.0,
    "routed_bias_update_rate=0": 0.0,
    "enable_checkpointing=false": False,
    "enable_checkpointing=True": True,
    "packing=FALSE": False,
    "ici_fsdp_parallelism=-1": -1,
    "max_num_checkpoints_to_keep=-1": -1,
    "learning_rate_schedule_steps=-1": -1,
    "rope_factor=1": 1.0,
    "steps=0": 0,
    "run_name=1e-4": "1e-4",  # string keys keep the text
    "latency_profile=model": "model",
    "latency_profile=model_contended": "model_contended",
    "latency_profile=profiles/step.pbtxt": "profiles/step.pbtxt",
    'jax_cache_dir=""': "",  # as a recipe's MAXTEXT_ARGS passes it (split without a shell's quote removal)
    "run_name='my run'": "my run",
    'run_name="x': '"x',  # not a quoted whole
}


@pytest.mark.parametrize("arg, value", ACCEPTED.items(), ids=ACCEPTED.keys())
def test_values_at_the_edge_of_their_range_load(arg, value):
    got = getattr(make_config(arg), arg.partition("=")[0])
    assert got == value and type(got) is type(value)


def test_yml_files_are_strict_too(tmp_path):
    extra = tmp_path / "extra.yml"
    extra.write_text("learning_rate: 1e-4\nadam_b2: 0.999\n")
    assert make_config(str(extra)).learning_rate == 1e-4
    for line, key in (("enable_checkpointing: yes", "enable_checkpointing"), ("steps: 3.0", "steps")):
        extra.write_text(line + "\n")
        with pytest.raises(ConfigError, match=f"^config key '{key}'"):
            make_config(str(extra))


def _wrong_values(annotation) -> list:
    return {int: [3.0, True, "3"], float: [True, "0.5", float("inf")], bool: [1, "yes", "on"]}.get(annotation, [])


@pytest.mark.parametrize("model", SHIPPED_MODELS)
def test_every_scalar_key_is_strict(model):
    """Over every field of the schema as it stands, so keys added later are covered: an int,
    float or bool key refuses the wrong types, naming the key; a float key takes an int."""
    good = make_config(model=model).model_dump()
    checked = 0
    for key, field in Config.model_fields.items():
        for wrong in _wrong_values(field.annotation):
            with pytest.raises(ValidationError) as info:
                Config(**{**good, key: wrong})
            assert info.value.errors()[0]["loc"] == (key,), (key, wrong)
            checked += 1
        if field.annotation is float and float(int(good[key])) == good[key]:
            assert Config(**{**good, key: int(good[key])}) == Config(**good)
    assert checked >= 3 * 80


@pytest.mark.parametrize("model", SHIPPED_MODELS)
def test_saved_config_loads_back_unchanged(model, tmp_path):
    """config.yml as a run saves it (with its runtime section), strings that look like numbers or
    YAML 1.1 booleans included, is a valid extra yml that gives back the same config."""
    tricky = ("run_name=1e-4", "dataset_name=yes", "dataset_text_field=on", "train_split=1.5", "eval_split=true")
    config = make_config(*tricky, model=model)
    saved = tmp_path / "config.yml"
    saved.write_text(config_to_yaml(config, {"num_processes": 1, "num_devices": 8}))
    assert load_config([str(saved)]) == config


# ---------------------------------------------------------------- (4) entry-point behaviour in process


@pytest.mark.parametrize("arg", ["num_expert=4", "steps=abc", "capacity_factor=-2", *LOADED_BEFORE])
def test_load_config_or_exit_exits_2_with_one_stderr_line(arg, capsys):
    with pytest.raises(SystemExit) as info:
        load_config_or_exit(["run_name=t", arg])
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.splitlines()) == 1, captured.err
    assert arg.partition("=")[0] in captured.err


def test_load_config_or_exit_returns_the_config_when_valid():
    assert load_config_or_exit(["run_name=t", "steps=3"]).steps == 3


# ---------------------------------------------------------------- (5) the real entry point


@pytest.mark.parametrize(
    "arg, key",
    [
        ("num_expert=4", "num_expert"),
        ("steps=abc", "steps"),
        ("model_name=deepseek-v3", "model_name"),
        ("moe_matmul=te", "requirements-gpu.txt"),  # Transformer Engine does not import on a CPU install
        ("enable_checkpointing=yes", "enable_checkpointing"),
    ],
)
def test_train_entry_point_exits_2_without_traceback(arg, key, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "MaxText.train", arg],
        cwd=tmp_path,
        env=_subprocess_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert key in result.stderr


# ---------------------------------------------------------------- (6) loading has no side effects


def test_load_config_writes_nothing_and_starts_no_runtime(tmp_path):
    """In a fresh interpreter: no JAX backend, no jax.distributed client, no files, no env changes."""
    work = tmp_path / "work"
    work.mkdir()
    out = tmp_path / "out"
    script = textwrap.dedent(
        f"""
        import os, sys
        before = dict(os.environ)
        from MaxText.config import load_config
        config = load_config(["model_name=deepseek3-671b", "run_name=probe", "base_output_directory={out}"])
        assert dict(os.environ) == before, "load_config changed the environment"
        if "jax" in sys.modules:  # importing jax is allowed; initialising it is not
            from jax._src import distributed, xla_bridge
            assert not xla_bridge.backends_are_initialized(), "load_config initialised a JAX backend"
            assert distributed.global_state.client is None, "load_config started jax.distributed"
        print("ok", config.output_dir)
        """
    )
    env = _subprocess_env(tmp_path)
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=work, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok")
    assert not out.exists(), "load_config created the output directory"
    assert list(work.iterdir()) == [], "load_config wrote into the working directory"
    assert list(Path(env["HOME"]).iterdir()) == [], "load_config wrote into HOME"


def test_a_compilation_cache_folder_that_cannot_be_made_is_a_config_error(tmp_path, monkeypatch):
    """``jax_cache_dir`` under a regular file: one ConfigError naming the key, before JAX is told
    anything (JAX itself would only warn at every compile and run without a cache)."""
    from MaxText.train.compilation_cache import compilation_cache_dir, use_compilation_cache

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    config = make_config(f"jax_cache_dir={blocker / 'cache'}")
    with pytest.raises(ConfigError, match=r"^jax_cache_dir: cannot create .*a-file/cache"):
        use_compilation_cache(config)
    assert compilation_cache_dir(make_config("jax_cache_dir=")) is None
    run = make_config(f"base_output_directory={tmp_path}", "run_name=r")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/shared/jax-cache")
    assert compilation_cache_dir(run) == "/shared/jax-cache"  # `auto` keeps JAX's own setting
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    assert compilation_cache_dir(run) == str(tmp_path / "r" / "jax_cache")
