"""Each grouped GEMM of ``moe_matmul: tokamax`` alone, against a dense GEMM of the same FLOPs.

    python tools/bench_grouped_gemm.py
    python tools/bench_grouped_gemm.py --rows 32768 --d-model 7168 --ffn 2048 --experts 4 --json

The three GEMMs of one grouped matmul ``[M, D] x [E, D, F]`` with balanced groups (M / E rows per
expert), run by the kernels ``MaxText/moe/tokamax_matmul.py`` picks for this device (on a GPU its
``KERNELS`` row; elsewhere tokamax's XLA reference):

- ``forward``: ``y[M, F] = x[M, D] @ w_e``;
- ``data_grad``: ``dx[M, D] = dy[M, F] @ w_e^T``;
- ``weight_grad``: ``dw_e[D, F] = x_e^T @ dy_e`` (groups along the contracted rows).

Each takes ``2 M D F`` FLOPs, as does the dense GEMM ``x[M, D] @ w[D, F]`` timed beside them:
``dense_ratio`` = dense time / case time is the fraction of the dense GEMM's speed the grouped
kernel reaches (the figure the planner's grouped-GEMM efficiency is about). Timing: jit-compiled,
one warm-up, then the fastest of ``--repeats`` runs taken in turns.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from MaxText.moe import tokamax_matmul as tm  # noqa: E402


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rows", type=int, default=32768, help="M, rows (token copies) of the layout (default: %(default)s)."
    )
    parser.add_argument("--d-model", type=int, default=7168, help="D, model dim (default: %(default)s).")
    parser.add_argument("--ffn", type=int, default=2048, help="F, each expert's hidden dim (default: %(default)s).")
    parser.add_argument(
        "--experts",
        type=int,
        default=32,
        help="E, groups (local experts), each of --rows / --experts rows (default: %(default)s).",
    )
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="Dtype of the GEMMs' operands (default: %(default)s).",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=10,
        help="Timed runs per case after one warm-up; the fastest is reported (default: %(default)s).",
    )
    parser.add_argument("--json", action="store_true", help="Print one JSON object to stdout (the table to stderr).")
    args = parser.parse_args(argv)
    if min(args.rows, args.d_model, args.ffn, args.experts, args.repeats) < 1:
        parser.error("sizes and --repeats must be >= 1")
    if args.rows % args.experts:
        parser.error("--rows must be a multiple of --experts (balanced groups)")
    return args


def gemms(kernels: tm.GemmKernels) -> dict:
    """name -> (implementation, function of (x, w, dy, sizes)) for the three GEMMs."""
    import tokamax
    from tokamax._src.ops.ragged_dot import base

    def gemm(name: str, dims):
        op = tm.op_class(name)()
        return lambda a, b, sizes: tokamax.ragged_dot_general(a, b, sizes, dims, implementation=[op])

    forward = gemm(kernels.forward, base.DEFAULT_RAGGED_DOT_DIM_NUMS)
    data_grad = gemm(kernels.data_grad, base.TRANS_RHS_RAGGED_DOT_DIM_NUMS)
    weight_grad = gemm(kernels.weight_grad, base.RAGGED_CONTRACTING_DOT_DIM_NUMS)
    return {
        "forward": (kernels.forward, lambda x, w, dy, s: forward(x, w, s)),
        "data_grad": (kernels.data_grad, lambda x, w, dy, s: data_grad(dy, w, s)),
        "weight_grad": (kernels.weight_grad, lambda x, w, dy, s: weight_grad(x, dy, s)),
    }


def fastest(fns: dict, args: tuple, repeats: int) -> dict[str, float]:
    """name -> fastest seconds; the cases take turns so that other load slows them alike."""
    for fn in fns.values():
        jax.block_until_ready(fn(*args))
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def run(args: argparse.Namespace) -> dict:
    M, D, F, E = args.rows, args.d_model, args.ffn, args.experts
    device = jax.devices()[0]
    kernels = tm.kernels_for(device)
    dtype = jnp.dtype(args.dtype)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((M, D), np.float32), dtype)
    w = jnp.asarray(rng.standard_normal((E, D, F), np.float32) * D**-0.5, dtype)
    dy = jnp.asarray(rng.standard_normal((M, F), np.float32), dtype)
    sizes = jnp.full((E,), M // E, jnp.int32)
    cases = gemms(kernels)
    fns = {name: jax.jit(fn) for name, (_, fn) in cases.items()}
    fns["dense"] = jax.jit(lambda x, w, dy, s: x @ w[0])
    times = fastest(fns, (x, w, dy, sizes), args.repeats)
    flops = 2 * M * D * F
    rows = [
        {
            "gemm": name,
            "kernel": cases[name][0] if name in cases else "xla",
            "time_s": seconds,
            "tflops": flops / seconds / 1e12,
            "dense_ratio": times["dense"] / seconds,
        }
        for name, seconds in times.items()
    ]
    return {
        "device": f"{device.platform}: {device.device_kind}, jax {jax.__version__}",
        "shape": {"rows": M, "d_model": D, "ffn": F, "experts": E, "dtype": str(dtype), "gflop": flops / 1e9},
        "cases": rows,
    }


def render(result: dict) -> str:
    s = result["shape"]
    lines = [
        f"grouped GEMMs [{s['rows']}, {s['d_model']}] x [{s['experts']}, {s['d_model']}, {s['ffn']}], {s['dtype']}, "
        f"{s['gflop']:.1f} GFLOP each; device {result['device']}",
        f"{'gemm':<12} {'kernel':>7} {'time_ms':>9} {'TFLOP/s':>8} {'x dense':>8}",
    ]
    for c in result["cases"]:
        lines.append(
            f"{c['gemm']:<12} {c['kernel']:>7} {c['time_s'] * 1e3:9.3f} {c['tflops']:8.1f} {c['dense_ratio']:8.3f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    result = run(args)
    if args.json:
        print(render(result), file=sys.stderr)
        print(json.dumps(result))
    else:
        print(render(result))


if __name__ == "__main__":
    main()
