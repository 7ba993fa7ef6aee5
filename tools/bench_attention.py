"""Forward+backward time and compiled memory of the attention backends, as ratios to ``dot``.

    python tools/bench_attention.py
    python tools/bench_attention.py --seq 4096 --heads 8 --blocks 256 512 1024
    python tools/bench_attention.py --backends dot flash cudnn --dtype bfloat16   # on a GPU

What is measured: ``attend`` (MLA's head dims from the config: qk 192, v 128 by default) on packed
rows of several documents with padding at the end, differentiated with respect to q, k and v;
jit-compiled, warmed up once, then the fastest of ``--repeats`` runs taken in turns (on a shared
machine other processes only ever add time). ``mem`` is XLA's compiled memory analysis (temp +
output bytes) of the same forward+backward program; nothing is allocated to read it, so ``dot``'s
O(S^2) figure is printed even where it would not fit. ``flash`` runs once per ``--blocks`` size
(square blocks). Every ratio is against ``dot`` measured in the same run; ``dot`` is only compiled,
not run, above ``--max-dot-gb``; ``--repeats 0`` compiles only (the memory of the 671B shape,
``--heads 128 --seq 4096``, on a laptop). ``grad_err`` is the largest difference of dq, dk, dv
from ``dot``'s over the largest of ``dot``'s, from the warm-up run (how a GPU kernel such as cuDNN's
is checked against plain XLA on the same inputs).

Shape legend: B batch, S positions, H heads, K qk head dim, V value head dim.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from MaxText.config import Config, load_config  # noqa: E402
from MaxText.layers.attention_ops import attend  # noqa: E402


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=1024, help="S, positions per row (default: %(default)s).")
    parser.add_argument("--heads", type=int, default=2, help="H, attention heads (default: %(default)s).")
    parser.add_argument("--batch", type=int, default=1, help="B, rows (default: %(default)s).")
    parser.add_argument(
        "--documents", type=int, default=3, help="Documents packed in each row, then padding (default: %(default)s)."
    )
    parser.add_argument(
        "--blocks",
        type=int,
        nargs="+",
        default=[256, 512],
        help="Flash block sizes to time, square, one case each (default: %(default)s).",
    )
    parser.add_argument(
        "--backends",
        nargs="+",
        default=["dot", "flash"],
        choices=["dot", "flash", "cudnn", "te"],
        help="Attention backends to measure; the ratios and gradient errors are against dot (default: dot flash).",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        help="Dtype: auto (float32 on CPU, bfloat16 on GPU), float32 or bfloat16 (default: %(default)s).",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="Timed runs per case after a warm-up; 0 = memory only (default: %(default)s).",
    )
    parser.add_argument(
        "--max-dot-gb",
        type=float,
        default=8.0,
        help="Only compile dot, not run it, when it needs more GiB than this (default: %(default)s).",
    )
    parser.add_argument(
        "--model", default="deepseek3-671b", help="Model overlay giving the head dims (default: %(default)s)."
    )
    return parser.parse_args(argv)


def make_inputs(args: argparse.Namespace, config: Config):
    """q, k, v [B, S, H, *] and segment ids [B, S]: ``--documents`` equal documents, the last 1/8 padding."""
    rng = np.random.default_rng(0)
    B, S, H = args.batch, args.seq, args.heads
    dtype = jnp.dtype(config.dtype)
    q, k = (jnp.asarray(rng.standard_normal((B, S, H, config.qk_head_dim)), dtype) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((B, S, H, config.v_head_dim)), dtype)
    used = S - S // 8
    seg = np.zeros((B, S), np.int32)
    seg[:, :used] = 1 + np.arange(used) * args.documents // used
    return q, k, v, jnp.asarray(seg)


def compile_case(config: Config, inputs):
    """The jitted forward+backward and its temp + output bytes."""
    q, k, v, seg = inputs

    def loss(q, k, v):
        return jnp.sum(attend(q, k, v, seg, config).astype(jnp.float32) ** 2)

    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
    memory = compiled.memory_analysis()
    return compiled, memory.temp_size_in_bytes + memory.output_size_in_bytes


def largest_gradient_error(outputs, reference) -> float:
    """Largest |dq, dk, dv - dot's| over the largest |dot's| of that gradient: how far a backend's
    gradients are from the plain XLA attention on the same inputs."""
    (_, grads), (_, ref_grads) = outputs, reference
    return max(
        float(jnp.max(jnp.abs(g.astype(jnp.float32) - r.astype(jnp.float32))) / jnp.max(jnp.abs(r.astype(jnp.float32))))
        for g, r in zip(grads, ref_grads, strict=True)
    )


def run_cases(compiled: dict, inputs, repeats: int) -> tuple[dict[str, float], dict[str, float]]:
    """Fastest seconds per case, and each case's gradient error against ``dot`` (when dot ran)."""
    q, k, v, _ = inputs
    outputs = {name: jax.block_until_ready(fn(q, k, v)) for name, fn in compiled.items()}  # the warm-up
    errors = {name: largest_gradient_error(out, outputs["dot"]) for name, out in outputs.items() if "dot" in outputs}
    best = dict.fromkeys(compiled, float("inf"))
    for _ in range(repeats):
        for name, fn in compiled.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(q, k, v))
            best[name] = min(best[name], time.perf_counter() - start)
    return best, errors


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    platform = jax.default_backend()
    base = load_config([f"model_name={args.model}", "run_name=bench", f"dtype={args.dtype}"])
    base = base.with_platform("gpu" if platform in ("gpu", "cuda") else "cpu")
    inputs = make_inputs(args, base)
    cases = {}
    for backend in args.backends:
        blocks = args.blocks if backend == "flash" else [None]
        for block in blocks:
            overrides = {"attention": backend}
            if block:
                overrides |= {"attention_block_q": block, "attention_block_kv": block}
            name = f"flash/{block}" if block else backend
            cases[name] = compile_case(base.model_copy(update=overrides), inputs)
    mem = {name: bytes_ for name, (_, bytes_) in cases.items()}
    runnable = {n: fn for n, (fn, b) in cases.items() if n != "dot" or b <= args.max_dot_gb * 2**30}
    seconds, errors = run_cases(runnable, inputs, args.repeats) if args.repeats > 0 else ({}, {})
    print(
        f"attention fwd+bwd on {platform}: B {args.batch}, S {args.seq}, H {args.heads}, "
        f"qk {base.qk_head_dim}, v {base.v_head_dim}, {base.dtype}, {args.documents} documents per row"
    )
    print(f"{'backend':<12} {'time_ms':>9} {'vs_dot':>7} {'mem_MB':>10} {'vs_dot':>7} {'grad_err':>9}")
    for name in cases:
        error = f"{errors[name]:.1e}" if name in errors else "-"
        t = seconds.get(name)
        t_ratio = f"{t / seconds['dot']:.2f}" if t is not None and "dot" in seconds else "-"
        m_ratio = f"{mem[name] / mem['dot']:.3f}" if "dot" in mem else "-"
        t_text = f"{t * 1e3:.1f}" if t is not None else "-"
        print(f"{name:<12} {t_text:>9} {t_ratio:>7} {mem[name] / 2**20:>10.1f} {m_ratio:>7} {error:>9}")


if __name__ == "__main__":
    main(sys.argv[1:])
