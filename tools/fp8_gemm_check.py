"""FP8 GEMMs on this machine's accelerator against the emulation on the same inputs.

For one projection-sized GEMM (x [M, K] @ w [K, N], bfloat16 inputs) it runs the forward, input
gradient and weight gradient of ``fp8_matmul`` in each execution this platform has, and prints
each one's largest relative difference from the reference (float32 emulation: the exact FP8
numerics) and its time against the plain bfloat16 GEMM measured in the same run:

- ``emulate`` with float32 operands (the reference; ``fp8_blockwise`` on every platform);
- ``emulate`` with bfloat16 operands (``mxfp8`` on a GPU: the same values, float32 sums in
  another order);
- ``cudnn`` (``mxfp8`` on a Blackwell GPU: cuDNN's block-scaled GEMM on the same E4M3 values and
  E8M0 scales); reported as not run elsewhere;
- ``per-tensor`` (not a recipe of this repository: one scale per tensor, E4M3 forward, E5M2
  gradient, XLA's own FP8 GEMM on a GPU with FP8 tensor cores, sm 8.9 and up): the rate a fused
  FP8 GEMM reaches on this GPU, the ceiling the emulation is weighed against; its differences are
  from the bfloat16 GEMMs, and ``fp8_kernel`` says whether XLA's GEMMs (cuBLASLt or Triton) took
  the FP8 operands rather than widening them.

    python tools/fp8_gemm_check.py [--m 4096 --k 7168 --n 2048] [--channel-spread 1.0] [--json]

Each emulated case also reports how far FP8 moves the results from the unquantized float32 GEMMs
(RMS error and scale bias): the recipes' own error, where the comparison above is the execution's.
"""

import argparse
import json
import sys
import time

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from MaxText.quantization import Recipe, fp8_matmul  # noqa: E402
from MaxText.quantization.quantize import MX_GEMM_COMPUTE_CAPABILITY, gpu_compute_capability  # noqa: E402

FP8_TENSOR_CORES = (8, 9)  # Ada and Hopper onwards: XLA's per-tensor FP8 GEMMs
CPU_SHAPE, ACCELERATOR_SHAPE = (512, 1024, 256), (4096, 7168, 2048)  # M, K, N (off CPU: a 671B expert projection)


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


def quantization_error(outputs, unquantized) -> dict:
    """How far FP8 moves y, dx and dw from the unquantized float32 GEMMs: the RMS of the
    difference over the RMS of the reference, and the scale bias (the least-squares factor
    between them, minus 1: negative when FP8 shrinks the outputs)."""
    rms, bias = [], []
    for o, e in zip(outputs, unquantized, strict=True):
        rms.append(float(jnp.sqrt(jnp.mean((o - e) ** 2) / jnp.mean(e**2))))
        bias.append(float(jnp.sum(o * e) / jnp.sum(e * e) - 1))
    return {"rms_rel_err_y_dx_dw": rms, "scale_bias_y_dx_dw": bias}


def max_rel_diff(outputs, reference) -> list[float]:
    """Largest |difference| over the largest |reference|, for y, dx and dw."""
    return [float(jnp.max(jnp.abs(o - r)) / jnp.max(jnp.abs(r))) for o, r in zip(outputs, reference, strict=True)]


def capability() -> tuple[int, int]:
    """This machine's GPU compute capability ((9, 0) Hopper, (10, 0) Blackwell); (0, 0) off GPU."""
    return gpu_compute_capability(jax.devices()[0]) or (0, 0)


def per_tensor_fp8(x, w, g):
    """Forward and both gradients as per-tensor FP8 GEMMs (E4M3 x and w, E5M2 g), bfloat16 out."""

    def cast(t, dtype):
        scale = jnp.max(jnp.abs(t)).astype(jnp.float32) / float(jnp.finfo(dtype).max)
        return (t.astype(jnp.float32) / scale).astype(dtype), scale

    (xq, sx), (wq, sw), (gq, sg) = cast(x, jnp.float8_e4m3fn), cast(w, jnp.float8_e4m3fn), cast(g, jnp.float8_e5m2)

    def gemm(a, b, scale):
        return (jnp.matmul(a, b, preferred_element_type=jnp.float32) * scale).astype(jnp.bfloat16)

    return gemm(xq, wq, sx * sw), gemm(gq, wq.T, sg * sw), gemm(xq.T, gq, sx * sg)


def fp8_gemm_called(hlo: str) -> bool:
    """Whether XLA:GPU's compiled program multiplies FP8 operands: cuBLASLt's FP8 matmul (Hopper
    and later, after autotuning) or a Triton GEMM fusion whose parameters are FP8 (a compile
    without the GPU, which cannot autotune)."""
    return "__cublas$lt$matmul$f8" in hlo or any("gemm_fusion" in line and "f8e" in line for line in hlo.splitlines())


def per_tensor_row(x, w, g, bf16_outputs: list, baseline: float) -> dict:
    label = "per-tensor xla (E4M3/E5M2, not a recipe)"
    if capability() < FP8_TENSOR_CORES:
        return {"case": label, "ran": False, "why": "FP8 tensor cores need a GPU of sm 8.9 or later"}
    fn = jax.jit(per_tensor_fp8).lower(x, w, g).compile()  # compiled once: run, timed and read
    hlo = fn.as_text()
    outputs = [o.astype(jnp.float32) for o in fn(x, w, g)]
    seconds = timed(fn, x, w, g)
    return {
        "case": label,
        "ran": True,
        "max_rel_diff_y_dx_dw": max_rel_diff(outputs, bf16_outputs),
        "vs": "bfloat16 GEMMs",
        "fp8_kernel": fp8_gemm_called(hlo),
        "time_s": seconds,
        "bf16_gemm_time_ratio": baseline / seconds,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    on_cpu = jax.default_backend() == "cpu"
    shape = CPU_SHAPE if on_cpu else ACCELERATOR_SHAPE
    dims = ("M, rows of x [M, K]", "K, the contracted dim of x and w", "N, columns of w [K, N]")
    for name, text, default, cpu, accelerator in zip("mkn", dims, shape, CPU_SHAPE, ACCELERATOR_SHAPE, strict=True):
        defaults = f"default: {cpu} on CPU, {accelerator} on an accelerator"
        parser.add_argument(f"--{name}", type=int, default=default, help=f"{text} ({defaults}).")
    parser.add_argument(
        "--channel-spread",
        type=float,
        default=0.0,
        help="Scale x's columns by exp(N(0, this)) to make outlier channels; 0 = none (default: %(default)s).",
    )
    parser.add_argument("--json", action="store_true", help="Print one JSON object instead of the report.")
    args = parser.parse_args(argv)
    kx, kw, kg, kc = jax.random.split(jax.random.key(0), 4)
    channels = jnp.exp(args.channel_spread * jax.random.normal(kc, (1, args.k)))
    x = (jax.random.normal(kx, (args.m, args.k)) * channels).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (args.k, args.n)) * 0.02).astype(jnp.bfloat16)
    g = (jax.random.normal(kg, (args.m, args.n)) * 1e-3).astype(jnp.bfloat16)
    bf16_gemms = forward_and_gradients(None)
    bf16_outputs = [o.astype(jnp.float32) for o in bf16_gemms(x, w, g)]
    baseline = timed(bf16_gemms, x, w, g)

    cases = [
        ("fp8_blockwise", Recipe("fp8_blockwise", 128)),
        ("mxfp8", Recipe("mxfp8", 32)),
        ("mxfp8", Recipe("mxfp8", 32, operands="bfloat16")),
        ("mxfp8", Recipe("mxfp8", 32, gemm="cudnn")),
    ]
    with jax.default_matmul_precision("highest"):  # the unquantized float32 GEMMs of the same inputs
        unquantized = forward_and_gradients(None)(*(a.astype(jnp.float32) for a in (x, w, g)))
    references = {}
    rows = []
    for name, recipe in cases:
        how = "E4M3 + E8M0 operands" if recipe.gemm == "cudnn" else f"{recipe.operands} operands"
        label = f"{name} {recipe.gemm} ({how})"
        if recipe.gemm == "cudnn" and capability() < MX_GEMM_COMPUTE_CAPABILITY:
            rows.append({"case": label, "ran": False, "why": "cuDNN's block-scaled GEMM needs a Blackwell GPU"})
            continue
        fn = forward_and_gradients(recipe)
        outputs = [o.astype(jnp.float32) for o in fn(x, w, g)]
        reference = references.setdefault(name, outputs)  # the float32 emulation comes first: the reference
        seconds = timed(fn, x, w, g)
        rows.append(
            {
                "case": label,
                "ran": True,
                "max_rel_diff_y_dx_dw": max_rel_diff(outputs, reference),
                **quantization_error(outputs, unquantized),
                "time_s": seconds,
                "bf16_gemm_time_ratio": baseline / seconds,
            }
        )
    rows.append(per_tensor_row(x, w, g, bf16_outputs, baseline))
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
        against = r.get("vs", "emulation") + (f", FP8 kernel {r['fp8_kernel']}" if "fp8_kernel" in r else "")
        print(
            f"  {r['case']:<44} {r['time_s'] * 1e3:8.2f} ms  ratio {r['bf16_gemm_time_ratio']:.3f}  vs {against} {diffs}"
        )
        if "rms_rel_err_y_dx_dw" in r:
            rms = " ".join(f"{e:.1e}" for e in r["rms_rel_err_y_dx_dw"])
            bias = " ".join(f"{e:+.1e}" for e in r["scale_bias_y_dx_dw"])
            print(f"  {'':<44} vs the unquantized GEMMs: RMS error {rms}, scale bias {bias}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
