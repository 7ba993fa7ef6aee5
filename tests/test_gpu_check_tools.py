"""The pieces of tools/gpu_check.sh that can be checked without a GPU: the FP8 GEMM check's report
and its test for an FP8 kernel in XLA:GPU's program, the attention benchmark's gradient error, and
the script itself (its syntax, and one section stopped at its time limit without stopping the rest)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import gpu_target_env

REPO = Path(__file__).resolve().parents[1]
GPU_PYTHON = os.environ.get("GPU_COMPILE_PYTHON", str(REPO / ".venv-gpu-compile" / "bin" / "python"))


def run(*command: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.slow
def test_fp8_gemm_check_on_cpu_reports_every_case():
    out = run(sys.executable, "tools/fp8_gemm_check.py", "--m", "64", "--k", "256", "--n", "128", "--json")
    report = json.loads(out.stdout)
    rows = {row["case"]: row for row in report["cases"]}
    assert len(rows) == 5
    ran = [row for row in rows.values() if row["ran"]]
    # Each recipe's first case is its own reference; the bfloat16-operand emulation is the same
    # numbers (XLA:CPU multiplies them in float32 too).
    assert [row["max_rel_diff_y_dx_dw"] for row in ran] == [[0.0, 0.0, 0.0]] * 3
    assert all(row["time_s"] > 0 and row["bf16_gemm_time_ratio"] > 0 for row in ran)
    # Against the unquantized float32 GEMMs: E4M3's rounding (at most 2^-4 of each operand element
    # in range), and the bfloat16-operand emulation moves nothing further.
    for row in ran:
        assert all(0.01 < e < 2**-4 for e in row["rms_rel_err_y_dx_dw"])
        assert all(abs(b) < 0.01 for b in row["scale_bias_y_dx_dw"])
    assert ran[1]["rms_rel_err_y_dx_dw"] == ran[2]["rms_rel_err_y_dx_dw"]
    not_run = {name: row["why"] for name, row in rows.items() if not row["ran"]}
    assert "Blackwell" in not_run["mxfp8 cudnn (E4M3 + E8M0 operands)"]
    assert "sm 8.9" in not_run["per-tensor xla (E4M3/E5M2, not a recipe)"]


@pytest.mark.slow
def test_fp8_gemm_called_sees_xla_gpus_fp8_gemms():
    """Compiled by XLA:GPU for an H200 without one: the per-tensor case's GEMMs take FP8 operands
    (Triton GEMM fusions here; cuBLASLt's FP8 matmul after autotuning on the GPU), bfloat16's do not."""
    script = """
import sys
sys.path[:0] = ["tools", "."]
import jax, jax.numpy as jnp
from jax.sharding import SingleDeviceSharding
from MaxText.aot.targets import TARGETS, compile_devices
import fp8_gemm_check as check
on = SingleDeviceSharding(compile_devices(TARGETS["h200"], 1)[0])
args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=on) for s in [(256, 512), (512, 256), (256, 256)]]
hlo = lambda fn: jax.jit(fn).lower(*args).compile().as_text()
print(check.fp8_gemm_called(hlo(check.per_tensor_fp8)), check.fp8_gemm_called(hlo(check.forward_and_gradients(None))))
"""
    env = gpu_target_env() | {"JAX_PLATFORMS": "cpu"}
    out = run(GPU_PYTHON, "-c", script, env=env)
    assert out.stdout.split()[-2:] == ["True", "False"]
    sys.path.insert(0, str(REPO / "tools"))
    import fp8_gemm_check

    on_the_gpu = '%cublas-gemm.2 = (f32[64,64]{1,0}, s8[1024]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul$f8"'
    assert fp8_gemm_check.fp8_gemm_called(on_the_gpu)
    assert not fp8_gemm_check.fp8_gemm_called(on_the_gpu.replace("$f8", ""))


@pytest.mark.slow
def test_bench_attention_gradient_error_against_dot():
    out = run(
        sys.executable, "tools/bench_attention.py", "--seq", "256", "--heads", "1", "--blocks", "64", "--repeats", "1"
    )
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines()[2:]}
    assert set(rows) == {"dot", "flash/64"}
    assert float(rows["dot"][-1]) == 0.0
    assert 0.0 < float(rows["flash/64"][-1]) < 1e-5  # float32 on CPU: another summation order


@pytest.mark.slow
def test_gpu_check_script_carries_on_past_a_failed_section(tmp_path):
    """A rehearsal of the script's machinery: a section past its limit is reported and counted,
    and the next section still runs (here a stand-in interpreter whose every call sleeps)."""
    subprocess.run(["bash", "-n", "tools/gpu_check.sh"], cwd=REPO, check=True)
    slow = tmp_path / "python"
    slow.write_text("#!/usr/bin/env bash\nsleep 600\n")
    slow.chmod(0o755)
    script = (REPO / "tools" / "gpu_check.sh").read_text()
    quick, count = re.subn(r'^(section "?[^"]*"? )\d+ ', r"\g<1>1 ", script, flags=re.M)  # every limit 1 s
    assert count >= 7, "the script's sections are not where this test looks"
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "gpu_check.sh").write_text(quick)
    env = os.environ | {"PYTHON": str(slow), "OUT": str(tmp_path / "out")}
    done = subprocess.run(
        ["bash", "tools/gpu_check.sh"], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120
    )
    sections = re.findall(r"^== (?!\d)", done.stdout, re.M)
    failed = re.findall(r"^!! .* failed \(exit 124, past 1 s\)", done.stdout, re.M)
    assert len(sections) == len(failed) >= 7, done.stdout[-3000:]
    assert done.returncode == len(failed)
    assert done.stdout.rstrip().endswith(f"== {len(failed)} section(s) failed")
