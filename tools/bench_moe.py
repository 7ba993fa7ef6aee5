"""Forward+backward time of one MoE layer's routed part, per backend and routing, against a dense ceiling.

    python tools/bench_moe.py
    python tools/bench_moe.py --tokens 8192 --block-rows 128 256 512 --impls dropless blocked
    python tools/bench_moe.py --json > moe.json

What is timed: router logits matmul (float32, as in the MoE block) + ``route`` + dispatch + grouped
SwiGLU experts + weighted combine, differentiated with respect to the tokens, the router gate and the
three expert weight stacks; jit-compiled, warmed up once, then the fastest of ``--repeats`` runs taken
in turns with the other cases of the routing (on a shared machine other processes only ever add
time, so the fastest run is the one closest to the code's own speed, for every case alike). The shared expert is left out: it is a dense MLP
whatever the routing.

The ceiling is the same useful work with no routing at all: one dense SwiGLU chain on M = T*K rows
(``x[M,D] @ W0[D,F]``, ``x @ W1``, ``silu * ``, ``@ Wo[F,D]``) plus the router's ``x[T,D] @ gate[D,E]``,
forward and backward, measured in the same process. Useful FLOPs are ``18*M*D*F + 6*T*D*E`` for both,
so ``ceiling_ratio`` = ceiling time / implementation time is the fraction of dense-matmul speed the
implementation reaches (1.0 = routing is free).

Routings are forced while the real router still runs: ``logits = x @ gate + offsets`` where the offsets
[T, E] (an input, not differentiated) add +30 on each token's desired experts, with one routing group
and a zero correction bias; the chosen experts are checked against the desired ones once, untimed.

- ``balanced``: each token's K experts uniformly at random (distinct).
- ``zipf``: K distinct experts drawn with probability proportional to 1 / rank^1.2 (expert 0 hottest).
- ``all_to_one``: every token's top-1 is expert 0, the other K-1 uniform among the rest.

Implementations: ``dropless`` (``moe_matmul=auto``, the training default: ``tokamax`` on GPU), every backend in
``BACKENDS`` that runs on the platform (``blocked`` once per ``--block-rows``; no backend twice: the
dropless row stands for the one it resolves to), ``capacity`` (``capacity_factor=1.25``, when the config and
``MaxText.moe.capacity`` provide it) and ``ceiling``. A case whose compiled program needs more memory
than ``--max-gb`` is skipped with its size rather than run: on XLA:CPU ``ragged_dot`` is expanded over
every expert, and the capacity baseline's one-hot [T, K, E, C] dispatch grows with (T*K)^2, so both can
pass the budget at the default shape. A case whose first run takes longer than ``--slow-s`` is
reported from that one run.

``dropped_tokens`` counts the (token, expert) copies the implementation's layout does not hold:
T*K minus the valid rows of the backend's layout (padded for ``blocked``, unpadded for ``ragged_dot``
and ``te``), or ``dropped_copies`` for capacity. ``peak_bytes`` is XLA's temp + output allocation for the compiled step.

Shape legend: T tokens, D model dim, E experts, F expert hidden dim, K experts per token, M = T*K.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from MaxText.config import Config, ConfigError, load_config  # noqa: E402
from MaxText.moe.dispatch import block_layout  # noqa: E402
from MaxText.moe.experts import BACKENDS, check_backend, config_backend, routed_experts, row_multiple  # noqa: E402
from MaxText.moe.router import route  # noqa: E402

ROUTINGS = ("balanced", "zipf", "all_to_one")
ZIPF_EXPONENT = 1.2
FORCE_OFFSET = 30.0  # added to the desired experts' logits; the rest stay around N(0, 1)
CAPACITY_FACTOR = 1.25
GB = 1e9


# ---------------------------------------------------------------- arguments


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="T, tokens in the batch (default: %(default)s).")
    parser.add_argument("--d-model", type=int, default=512, help="D, model dim (default: %(default)s).")
    parser.add_argument("--ffn", type=int, default=256, help="F, each expert's hidden dim (default: %(default)s).")
    parser.add_argument("--experts", type=int, default=64, help="E, routed experts (default: %(default)s).")
    parser.add_argument("--top-k", type=int, default=8, help="K, experts per token (default: %(default)s).")
    parser.add_argument(
        "--dtype",
        default="auto",
        help="Dtype: auto (float32 on CPU, bfloat16 on GPU), float32 or bfloat16 (default: %(default)s).",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="Timed runs per case after one warm-up; the fastest is reported (default: %(default)s).",
    )
    parser.add_argument(
        "--block-rows",
        type=int,
        nargs="+",
        default=[128, 256],
        help="Blocked backend: the largest block sizes to try, one case each; the dropless row covers the config's own "
        "(default: %(default)s).",
    )
    parser.add_argument(
        "--min-block-rows",
        type=int,
        default=32,
        help="Blocked backend: the smallest block, with --block-rows (default: %(default)s).",
    )
    impls = ["dropless", *BACKENDS, "capacity", "ceiling"]
    parser.add_argument(
        "--impls",
        nargs="+",
        default=impls,
        choices=impls,
        help="Implementations to time (default: all); the ceiling is always timed.",
    )
    parser.add_argument(
        "--routings", nargs="+", default=list(ROUTINGS), choices=ROUTINGS, help="Routings to force (default: all)."
    )
    parser.add_argument(
        "--max-gb",
        type=float,
        default=0.0,
        help="Skip cases needing more GB; 0 = 90%% of the device's memory, or half the host's on CPU "
        "(default: %(default)s).",
    )
    parser.add_argument(
        "--slow-s",
        type=float,
        default=20.0,
        help="Report a case from its first run if that takes longer, in seconds (default: %(default)s).",
    )
    parser.add_argument(
        "--model",
        default="deepseek3-671b",
        help="Model overlay for the MoE settings the flags leave: block rows, scores (default: %(default)s).",
    )
    parser.add_argument("--seed", type=int, default=0, help="Seed of the inputs and routings (default: %(default)s).")
    parser.add_argument("--json", action="store_true", help="Print one JSON object to stdout (the table to stderr).")
    args = parser.parse_args(argv)
    if (
        min(
            args.tokens,
            args.d_model,
            args.ffn,
            args.experts,
            args.top_k,
            args.repeats,
            *args.block_rows,
            args.min_block_rows,
        )
        < 1
    ):
        parser.error("sizes, --repeats and --block-rows must be >= 1")
    if args.top_k > args.experts:
        parser.error("--top-k must not exceed --experts")
    return args


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- routings


def desired_experts(routing: str, T: int, E: int, K: int, rng: np.random.Generator) -> np.ndarray:
    """[T, K] distinct expert ids per token. Sampling without replacement in proportion to p is
    the top K of ``log p + Gumbel noise``."""

    def sample(p: np.ndarray, k: int) -> np.ndarray:
        keys = np.log(p) + rng.gumbel(size=(T, p.size))
        return np.argsort(-keys, axis=1)[:, :k]

    if routing == "balanced":
        return sample(np.full(E, 1.0 / E), K)
    if routing == "zipf":
        p = 1.0 / np.arange(1, E + 1) ** ZIPF_EXPONENT
        return sample(p / p.sum(), K)
    rest = sample(np.full(E - 1, 1.0 / (E - 1)), K - 1) + 1  # all_to_one: expert 0, then K-1 of 1..E-1
    return np.concatenate([np.zeros((T, 1), np.int64), rest], axis=1)


def force_offsets(desired_TK: np.ndarray, E: int) -> np.ndarray:
    offsets_TE = np.zeros((desired_TK.shape[0], E), np.float32)
    np.put_along_axis(offsets_TE, desired_TK, FORCE_OFFSET, axis=1)
    return offsets_TE


# ---------------------------------------------------------------- implementations


class Impl(NamedTuple):
    name: str
    config: Config | None  # None: the dense ceiling
    backend: str | None  # the routed-expert backend the config resolves to
    dropped: Callable[[np.ndarray], int | None]  # chosen experts [T, K] -> copies not computed


def moe_config(args: argparse.Namespace, platform: str, *overrides: str) -> Config:
    return load_config(
        [
            f"model_name={args.model}",
            "run_name=bench-moe",
            f"num_experts={args.experts}",
            f"num_experts_per_tok={args.top_k}",
            f"base_emb_dim={args.d_model}",
            f"base_moe_mlp_dim={args.ffn}",
            "n_routing_groups=1",
            "topk_routing_group=1",
            f"dtype={args.dtype}",
            *overrides,
        ]
    ).with_platform(platform)


def rows_dropped(backend: str, config: Config) -> Callable[[np.ndarray], int | None]:
    """T*K minus the rows the backend's layout holds, computed from the layout itself."""
    E = config.num_experts

    def count(experts_TK: np.ndarray) -> int | None:
        held = block_layout(jnp.asarray(experts_TK), E, row_multiple(backend, config)).valid_P.sum()
        return experts_TK.size - int(held)

    return count


def same_case(a: Impl, b: Impl) -> bool:
    """The dropless row already times this backend (and block size): no second row for it."""
    levels = lambda c: (c.moe_block_rows, c.moe_min_block_rows)  # noqa: E731
    blocks = a.backend != "blocked" or levels(a.config) == levels(b.config)
    return a.backend == b.backend and blocks


def build_impls(args: argparse.Namespace, platform: str) -> tuple[list[Impl], list[tuple[str, str]]]:
    """The implementations to time and the (name, reason) of those skipped."""
    impls, skipped = [Impl("ceiling", None, None, lambda _: 0)], []

    def backend_impl(name: str, *overrides: str) -> Impl:
        config = moe_config(args, platform, *overrides)
        backend = config_backend(config, platform)
        return Impl(name, config, backend, rows_dropped(backend, config))

    if "dropless" in args.impls:
        impl = backend_impl("dropless", "moe_matmul=auto")
        rows = f" B{impl.config.moe_block_rows}-{impl.config.moe_min_block_rows}" if impl.backend == "blocked" else ""
        impls.append(impl._replace(name=f"dropless ({impl.backend}{rows})"))
    for backend in BACKENDS:
        if backend not in args.impls:
            continue
        if backend == "blocked":
            candidates = [
                backend_impl(
                    f"blocked B{b}-{args.min_block_rows}",
                    "moe_matmul=blocked",
                    f"moe_block_rows={b}",
                    f"moe_min_block_rows={args.min_block_rows}",
                )
                for b in args.block_rows
            ]
        else:
            try:  # a backend this platform does not run (tokamax's GPU kernels on CPU) says why
                check_backend(moe_config(args, platform, f"moe_matmul={backend}"), platform)
            except ConfigError as err:
                skipped.append((backend, f"not on {platform}: {err}"))
                continue
            candidates = [backend_impl(backend, f"moe_matmul={backend}")]
        impls += [impl for impl in candidates if not any(same_case(impl, other) for other in impls[1:])]
    if "capacity" in args.impls:
        try:
            from MaxText.moe.capacity import dropped_copies

            config = moe_config(args, platform, "moe_matmul=auto", f"capacity_factor={CAPACITY_FACTOR}")

            def capacity_dropped(experts_TK: np.ndarray) -> int:
                return int(np.sum(dropped_copies(jnp.asarray(experts_TK), args.experts, CAPACITY_FACTOR)))

            impls.append(Impl(f"capacity cf{CAPACITY_FACTOR}", config, None, capacity_dropped))
        except (ImportError, ConfigError) as err:
            skipped.append(("capacity", f"not available: {type(err).__name__}: {err}"))
    return impls, skipped


# ---------------------------------------------------------------- the timed functions


def forced_route(x_TD, gate_DE, offsets_TE, config: Config):
    """The real router (float32 logits, zero correction bias) on logits pushed towards the desired experts."""
    logits_TE = x_TD.astype(jnp.float32) @ gate_DE + offsets_TE
    return route(logits_TE, jnp.zeros((config.num_experts,), jnp.float32), config)


def routed_loss(config: Config) -> Callable[..., jax.Array]:
    """Scalar <y, dy> of the routed part; its gradient is the layer's backward pass."""

    def loss(x_TD, gate_DE, wi_0, wi_1, wo, offsets_TE, dy_TD):
        routing = forced_route(x_TD, gate_DE, offsets_TE, config)
        y_TD = routed_experts(x_TD, routing.experts_TK, routing.weights_TK, wi_0, wi_1, wo, config)
        return jnp.sum(y_TD.astype(jnp.float32) * dy_TD)

    return loss


def ceiling_loss(x_MD, x_TD, gate_DE, w0_DF, w1_DF, wo_FD, dy_MD, dlogits_TE):
    """The same useful FLOPs as dense matmuls: a SwiGLU chain on M rows plus the router matmul."""
    y_MD = (jax.nn.silu(x_MD @ w0_DF) * (x_MD @ w1_DF)) @ wo_FD
    logits_TE = x_TD.astype(jnp.float32) @ gate_DE
    return jnp.sum(y_MD.astype(jnp.float32) * dy_MD) + jnp.sum(logits_TE * dlogits_TE)


def make_inputs(args: argparse.Namespace, dtype: jnp.dtype, rng: np.random.Generator) -> dict[str, Any]:
    T, D, F, E, K = args.tokens, args.d_model, args.ffn, args.experts, args.top_k
    M = T * K

    def normal(shape, std=1.0, dt=dtype):
        return jnp.asarray(rng.standard_normal(shape, np.float32) * std, dt)

    return {
        "x_TD": normal((T, D)),
        "gate_DE": normal((D, E), D**-0.5, jnp.float32),
        "wi_0": normal((E, D, F), D**-0.5),
        "wi_1": normal((E, D, F), D**-0.5),
        "wo": normal((E, F, D), F**-0.5),
        "dy_TD": normal((T, D), 1.0, jnp.float32),
        "x_MD": normal((M, D)),
        "dy_MD": normal((M, D), 1.0, jnp.float32),
        "dlogits_TE": normal((T, E), 1.0, jnp.float32),
    }


def case_args(impl: Impl, inputs: dict[str, Any], offsets_TE: jax.Array) -> tuple:
    i = inputs
    if impl.config is None:
        return (i["x_MD"], i["x_TD"], i["gate_DE"], i["wi_0"][0], i["wi_1"][0], i["wo"][0], i["dy_MD"], i["dlogits_TE"])
    return (i["x_TD"], i["gate_DE"], i["wi_0"], i["wi_1"], i["wo"], offsets_TE, i["dy_TD"])


def compile_step(impl: Impl, args: tuple) -> jax.stages.Compiled:
    loss = ceiling_loss if impl.config is None else routed_loss(impl.config)
    argnums = (0, 1, 2, 3, 4, 5) if impl.config is None else (0, 1, 2, 3, 4)
    return jax.jit(jax.value_and_grad(loss, argnums=argnums)).lower(*args).compile()


def peak_bytes(compiled: jax.stages.Compiled) -> int | None:
    try:
        stats = compiled.memory_analysis()
        return int(stats.temp_size_in_bytes + stats.output_size_in_bytes)
    except Exception:  # not every backend reports it
        return None


def timed_call(compiled: jax.stages.Compiled, args: tuple) -> tuple[float, float]:
    """(seconds, loss value) of one run to completion."""
    start = time.perf_counter()
    loss, _ = jax.block_until_ready(compiled(*args))
    return time.perf_counter() - start, float(loss)


def time_interleaved(steps: dict[str, tuple], repeats: int, slow_s: float) -> dict[str, tuple[float, float, int]]:
    """name -> (fastest seconds, loss, runs timed) for ``steps`` (name -> (compiled, args)).

    Each case runs once to warm up; then the cases take turns for ``repeats`` rounds, so that a burst
    of load from other processes slows all of them alike and the ratios stay steadier than the times.
    A case whose warm-up is slower than ``slow_s`` is reported from that one run."""
    first = {name: timed_call(*step) for name, step in steps.items()}
    times: dict[str, list[float]] = {name: [] for name, (seconds, _) in first.items() if seconds <= slow_s}
    for _ in range(repeats):
        for name in times:
            times[name].append(timed_call(*steps[name])[0])
    return {
        name: (min(times[name]), loss, repeats) if name in times else (seconds, loss, 1)
        for name, (seconds, loss) in first.items()
    }


def memory_budget(max_gb: float) -> float:
    if max_gb > 0:
        return max_gb * GB
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return 0.9 * stats["bytes_limit"]
    return 0.5 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def prepare(impl: Impl, call_args: tuple, budget: float, platform: str) -> tuple[jax.stages.Compiled, int | None] | str:
    """The compiled step and its peak bytes, or why the case is skipped."""
    start = time.perf_counter()
    try:
        step = compile_step(impl, call_args)
    except Exception as err:  # a backend that cannot run on this platform
        return f"raises on {platform}: {type(err).__name__}: {(str(err).splitlines() or [''])[0]}"
    log(f"{impl.name}: compiled in {time.perf_counter() - start:.1f} s")
    peak = peak_bytes(step)
    if impl.config is not None and peak is not None and peak > budget:
        return f"needs {peak / GB:.1f} GB (temp + output), above the {budget / GB:.1f} GB budget (--max-gb)"
    return step, peak


# ---------------------------------------------------------------- the run


def run(args: argparse.Namespace) -> dict[str, Any]:
    platform = jax.default_backend()
    T, D, F, E, K = args.tokens, args.d_model, args.ffn, args.experts, args.top_k
    M = T * K
    useful_flops = 18 * M * D * F + 6 * T * D * E
    impls, skipped = build_impls(args, platform)
    base = moe_config(args, platform)  # one routing group, so route() takes the plain top-k
    dtype = jnp.dtype(base.dtype)
    rng = np.random.default_rng(args.seed)
    inputs = make_inputs(args, dtype, rng)
    budget = memory_budget(args.max_gb)
    check_route = jax.jit(lambda x_TD, gate_DE, offsets_TE: forced_route(x_TD, gate_DE, offsets_TE, base))

    compiled: dict[str, tuple[jax.stages.Compiled, int | None]] = {}
    cases, notes = [], []
    for routing in args.routings:
        desired_TK = desired_experts(routing, T, E, K, rng)
        offsets_TE = jnp.asarray(force_offsets(desired_TK, E))
        chosen_TK = np.asarray(check_route(inputs["x_TD"], inputs["gate_DE"], offsets_TE).experts_TK)
        if not np.array_equal(np.sort(chosen_TK, axis=1), np.sort(desired_TK, axis=1)):
            raise SystemExit(f"error: the router did not choose the forced experts for routing '{routing}'")
        steps = {}
        for impl in impls:
            if any(name == impl.name for name, _ in skipped):
                continue
            call_args = case_args(impl, inputs, offsets_TE)
            if impl.name not in compiled:
                prepared = prepare(impl, call_args, budget, platform)
                if isinstance(prepared, str):
                    skipped.append((impl.name, prepared))
                    log(f"{impl.name}: skipped, {prepared}")
                    continue
                compiled[impl.name] = prepared
            steps[impl.name] = (compiled[impl.name][0], call_args)
        log(f"[{routing}] timing {len(steps)} cases, {args.repeats} interleaved rounds")
        timings = time_interleaved(steps, args.repeats, args.slow_s)
        losses = {name: loss for name, (_, loss, _) in timings.items()}
        for impl in impls:
            if impl.name not in timings:
                continue
            seconds, _, runs = timings[impl.name]
            case = {
                "routing": routing,
                "impl": impl.name,
                "time_s": seconds,
                "ceiling_ratio": None,
                "dropped_tokens": impl.dropped(chosen_TK),
                "peak_bytes": compiled[impl.name][1],
                "gflops": useful_flops / seconds / 1e9,
                "runs": runs,
            }
            cases.append(case)
            log(f"[{routing}] {impl.name}: {seconds:.3f} s (fastest of {runs})")
        ceiling_s = next(c["time_s"] for c in cases if c["routing"] == routing and c["impl"] == "ceiling")
        for case in cases:
            if case["routing"] == routing:
                case["ceiling_ratio"] = ceiling_s / case["time_s"]
        notes += consistency_notes(routing, cases, losses, dtype)

    device = jax.devices()[0]
    return {
        "device": f"{platform}: {device.device_kind}, {os.cpu_count()} host cores, jax {jax.__version__}",
        "load_average": [round(v, 2) for v in os.getloadavg()],
        "shape": {
            "tokens": T,
            "d_model": D,
            "ffn": F,
            "experts": E,
            "top_k": K,
            "routed_rows": M,
            "dtype": str(dtype),
            "repeats": args.repeats,
            "useful_gflop": useful_flops / 1e9,
        },
        "cases": cases,
        "skipped": [{"impl": name, "reason": reason} for name, reason in skipped],
        "notes": notes,
    }


def consistency_notes(routing: str, cases: list[dict], losses: dict[str, float], dtype: jnp.dtype) -> list[str]:
    """Cross-checks from the timed runs' own losses (same inputs): every dropless backend computes the
    same layer, and a capacity run that drops copies must differ from them."""
    rtol = 1e-4 if dtype == jnp.float32 else 3e-2
    notes = []
    dropless = {name: v for name, v in losses.items() if name != "ceiling" and not name.startswith("capacity")}
    reference = next(iter(dropless.items()), None)
    for name, value in dropless.items():
        if not np.isclose(value, reference[1], rtol=rtol):
            notes.append(f"{routing}: {name} loss {value:.6g} differs from {reference[0]} loss {reference[1]:.6g}")
    for case in cases:
        if case["routing"] == routing and case["impl"].startswith("capacity") and reference is not None:
            if case["dropped_tokens"] and np.isclose(losses[case["impl"]], reference[1], rtol=1e-6):
                notes.append(f"{routing}: capacity drops {case['dropped_tokens']} copies yet its loss equals dropless")
    return notes


# ---------------------------------------------------------------- report


def render(result: dict[str, Any]) -> str:
    s = result["shape"]
    width = max([4, *(len(c["impl"]) for c in result["cases"])])
    lines = [
        f"MoE routed part, forward+backward: T {s['tokens']}, D {s['d_model']}, F {s['ffn']}, E {s['experts']}, "
        f"top-{s['top_k']}, {s['dtype']}; {s['useful_gflop']:.1f} useful GFLOP per step",
        f"device {result['device']}; load average {result['load_average']}",
        "",
        f"{'routing':<11} {'impl':<{width}} {'time_s':>8} {'x ceiling':>9} {'GFLOP/s':>8} {'dropped':>8} {'peak MB':>8}",
    ]
    for c in result["cases"]:
        peak = "-" if c["peak_bytes"] is None else f"{c['peak_bytes'] / 1e6:,.0f}"
        dropped = "?" if c["dropped_tokens"] is None else str(c["dropped_tokens"])
        once = "  (1 run)" if c["runs"] == 1 and s["repeats"] > 1 else ""
        lines.append(
            f"{c['routing']:<11} {c['impl']:<{width}} {c['time_s']:>8.3f} {c['ceiling_ratio']:>9.2f} "
            f"{c['gflops']:>8.1f} {dropped:>8} {peak:>8}{once}"
        )
    lines += [f"skipped {k['impl']}: {k['reason']}" for k in result["skipped"]]
    lines += ["", *summary_lines(result)]
    lines += [f"warning: {note}" for note in result["notes"]]
    return "\n".join(lines)


def summary_lines(result: dict[str, Any]) -> list[str]:
    lines = []
    for routing in dict.fromkeys(c["routing"] for c in result["cases"]):
        by_impl = {c["impl"]: c for c in result["cases"] if c["routing"] == routing}
        dropless = next((c for name, c in by_impl.items() if name.startswith("dropless")), None)
        capacity = next((c for name, c in by_impl.items() if name.startswith("capacity")), None)
        if dropless is None:
            continue
        text = f"{routing}: {dropless['impl']} runs at {dropless['ceiling_ratio']:.2f}x the dense ceiling"
        if capacity is not None:
            speed = capacity["time_s"] / dropless["time_s"]
            text += (
                f", {speed:.2f}x the speed of {capacity['impl']} "
                f"(which drops {capacity['dropped_tokens']} of {result['shape']['routed_rows']} copies)"
            )
        else:
            reason = next((k["reason"] for k in result["skipped"] if k["impl"].startswith("capacity")), "not asked")
            text += f"; capacity not timed ({reason})"
        lines.append(text)
    return lines


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        result = run(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.json:
        log(render(result))
        print(json.dumps(result))
    else:
        print(render(result))


if __name__ == "__main__":
    main()
