"""FP8 GEMMs on this machine's accelerator against the emulation on the same inputs.

For one projection-sized GEMM (x [M, K] @ w [K, N], bfloat16 inputs) it runs the forward, input
gradient and weight gradient of ``fp8_matmul`` in each execution this platform has, and prints
each one's largest relative difference from the reference (float32 emulation: the exact FP8
numerics) and its time against the plain bfloat16 GEMM measured in the same run:

- ``emulate`` with float32 operands (the reference; ``fp8_blockwise`` on every platform);
- ``emulate`` with bfloat16 operands (``mxfp8`` on a GPU: the same values, float32 sums in
  another order);
- ``cudnn`` (``mxfp8`` on a Blackwell GPU: cuDNN's block-scaled GEMM on the same E4M3 values and
  E8M0 scales); reported as not run elsewhere.

    python tools/fp8_gemm_check.py [--m 4096 --k 7168 --n 2048] [--json]
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable as a script from anywhere

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from MaxText.quantization import Recipe, fp8_matmul  # noqa: E402


def timed(fn, *args, repeats: int = 5) -> float:
    """Median seconds of a compiled call (after one warm-up)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def forward_and_gradients(recipe: Recipe | None):
    def run(x, w, g):
        matmul = (lambda x, w: x @ w) if recipe is None else (lambda x, w: fp8_matmul(x, w, recipe))
        y, vjp = jax.vjp(matmul, x, w)
        return (y, *vjp(g))

    return jax.jit(run)


def blackwell() -> bool:
    device = jax.devices()[0]
    return device.platform == "gpu" and float(getattr(device, "compute_capability", "0")) >= 10.0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    on_cpu = jax.default_backend() == "cpu"
    parser.add_argument("--m", type=int, default=512 if on_cpu else 4096)
    parser.add_argument("--k", type=int, default=1024 if on_cpu else 7168)
    parser.add_argument("--n", type=int, default=256 if on_cpu else 2048)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (args.m, args.k), jnp.bfloat16)
    w = (jax.random.normal(kw, (args.k, args.n)) * 0.02).astype(jnp.bfloat16)
    g = (jax.random.normal(kg, (args.m, args.n)) * 1e-3).astype(jnp.bfloat16)
    baseline = timed(forward_and_gradients(None), x, w, g)

    cases = [
        ("fp8_blockwise", Recipe("fp8_blockwise", 128)),
        ("mxfp8", Recipe("mxfp8", 32)),
        ("mxfp8", Recipe("mxfp8", 32, operands="bfloat16")),
        ("mxfp8", Recipe("mxfp8", 32, gemm="cudnn")),
    ]
    references = {}
    rows = []
    for name, recipe in cases:
        how = "E4M3 + E8M0 operands" if recipe.gemm == "cudnn" else f"{recipe.operands} operands"
        label = f"{name} {recipe.gemm} ({how})"
        if recipe.gemm == "cudnn" and not blackwell():
            rows.append({"case": label, "ran": False, "why": "cuDNN's block-scaled GEMM needs a Blackwell GPU"})
            continue
        fn = forward_and_gradients(recipe)
        outputs = [o.astype(jnp.float32) for o in fn(x, w, g)]
        reference = references.setdefault(name, outputs)  # the float32 emulation comes first: the reference
        errors = [float(jnp.max(jnp.abs(o - r)) / jnp.max(jnp.abs(r))) for o, r in zip(outputs, reference, strict=True)]
        seconds = timed(fn, x, w, g)
        rows.append(
            {
                "case": label,
                "ran": True,
                "max_rel_diff_y_dx_dw": errors,
                "time_s": seconds,
                "bf16_gemm_time_ratio": baseline / seconds,
            }
        )
    report = {"device": str(jax.devices()[0]), "shape": [args.m, args.k, args.n], "bf16_s": baseline, "cases": rows}
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{report['device']}: x [{args.m}, {args.k}] @ w [{args.k}, {args.n}], forward + both gradients")
    print(f"bfloat16 GEMMs: {baseline * 1e3:.2f} ms (ratio = that time / the case's)")
    for r in rows:
        if not r["ran"]:
            print(f"  {r['case']:<44} not run: {r['why']}")
            continue
        diffs = " ".join(f"{e:.1e}" for e in r["max_rel_diff_y_dx_dw"]) if "float32" not in r["case"] else "(reference)"
        print(
            f"  {r['case']:<44} {r['time_s'] * 1e3:8.2f} ms  ratio {r['bf16_gemm_time_ratio']:.3f}  vs emulation {diffs}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
