"""tools/bench_moe.py end to end at a tiny shape: the JSON report's structure and its invariants."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CLI = REPO / "tools" / "bench_moe.py"
TINY = ["--tokens", "256", "--d-model", "32", "--ffn", "16", "--experts", "8", "--top-k", "2"]


@pytest.mark.slow
def test_bench_moe_json_report():
    cmd = [sys.executable, str(CLI), *TINY, "--repeats", "1", "--block-rows", "128", "--json"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)

    assert report["device"]
    assert report["shape"]["tokens"] == 256 and report["shape"]["top_k"] == 2
    assert report["shape"]["routed_rows"] == 512
    cases = report["cases"]
    keys = {"routing", "impl", "time_s", "ceiling_ratio", "dropped_tokens", "peak_bytes", "gflops"}
    assert all(keys <= case.keys() for case in cases)
    assert {case["routing"] for case in cases} == {"balanced", "zipf", "all_to_one"}
    for routing in ("balanced", "zipf", "all_to_one"):
        impls = {case["impl"] for case in cases if case["routing"] == routing}
        assert "ceiling" in impls and any(name.startswith("dropless") for name in impls)
    for case in cases:
        assert case["time_s"] > 0 and case["ceiling_ratio"] > 0 and case["gflops"] > 0
        if case["impl"].startswith("dropless"):
            assert case["dropped_tokens"] == 0
        if case["impl"] == "ceiling":
            assert case["ceiling_ratio"] == 1.0
    # Every token's top-1 on expert 0 overflows a 1.25 capacity: the baseline must drop copies.
    capacity = [c for c in cases if c["impl"].startswith("capacity") and c["routing"] == "all_to_one"]
    assert all(c["dropped_tokens"] > 0 for c in capacity)
    assert report["notes"] == []
    # tokamax's GPU kernels are not timed on CPU, and the report says why
    assert any(k["impl"] == "tokamax" and "not on cpu" in k["reason"] for k in report["skipped"])


def test_bench_grouped_gemm_json_report():
    """tools/bench_grouped_gemm.py at a tiny shape: the three GEMMs of tokamax's grouped matmul (its
    XLA reference on CPU) and the dense GEMM they are measured against."""
    cli = REPO / "tools" / "bench_grouped_gemm.py"
    cmd = [sys.executable, str(cli), "--rows", "512", "--d-model", "128", "--ffn", "64", "--experts", "4"]
    done = subprocess.run([*cmd, "--repeats", "1", "--json"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    cases = {c["gemm"]: c for c in report["cases"]}
    assert set(cases) == {"forward", "data_grad", "weight_grad", "dense"}
    assert {c["kernel"] for c in cases.values()} == {"xla"}  # off a GPU: the reference
    assert cases["dense"]["dense_ratio"] == 1.0
    assert all(c["time_s"] > 0 and c["tflops"] > 0 for c in cases.values())
    assert report["shape"]["gflop"] == 2 * 512 * 128 * 64 / 1e9
