"""Human-readable tables of an estimate, a search and the calibration."""

from __future__ import annotations

from MaxText.planner.estimate import Estimate
from MaxText.planner.search import SearchResult, why_loses

GB = 1e9
FLOPS_NOTE = (
    "TFLOPS/GPU count model FLOPs as Megatron-LM does: 3 passes x 2 FLOPs per multiply-accumulate, "
    "causal attention halved, output head included, MTP when on; recomputation is not counted."
)


def render_estimate(e: Estimate) -> str:
    m = e.memory
    lines = [
        f"{e.layout.describe()} on {e.layout.num_gpus} x {e.system.name}, {e.precision}"
        + (f" ({e.fp8_kernels})" if e.precision != "bf16" else "")
        + f", stack {e.stack.name}",
        f"  memory per GPU   {m['total'] / GB:7.1f} GB of {e.system.hbm_bytes * e.stack.usable_hbm / GB:.0f} usable"
        f" ({'fits' if e.fits else 'DOES NOT FIT'}): state {m['state'] / GB:.1f}, activations {m['activations'] / GB:.1f},"
        f" buffers {m['buffers'] / GB:.1f}",
        f"  step time        {e.step_time:7.2f} s   TFLOPS/GPU {e.tflops:7.1f}   MFU {100 * e.mfu:5.1f}%"
        f"   tokens/s/GPU {e.tokens_per_s:7.0f}",
    ]
    if e.scaling_efficiency is not None:
        lines.append(
            f"  scaling          {100 * e.scaling_efficiency:6.1f}% of one NVLink domain with the same in-domain layout"
        )
    lines.append("  compute (s/step) " + ", ".join(f"{k} {v:.2f}" for k, v in e.math.items() if v))
    for c in e.comms:
        lines.append(
            f"  {c.name:<44} {c.seconds:7.2f} s  (NVLink {c.bytes_nvlink / GB:8.1f} GB, network {c.bytes_network / GB:7.1f} GB)"
        )
    exposed = ", ".join(f"{k} {v:.2f}" for k, v in e.exposed.items() if v > 5e-3)
    lines.append(f"  exposed (s/step) {exposed or 'none'}; pipeline bubble {100 * e.bubble:.1f}%")
    lines.append(
        f"  dominant: {e.dominant}; communication is {100 * e.comm_fraction:.0f}% of kernel time (overlapped or not)"
    )
    reason = e.not_runnable_reason()
    lines.append("  runnable here" if reason is None else f"  modelled only: {reason}")
    return "\n".join(lines)


def render_search(result: SearchResult, count: int = 5) -> str:
    if not result.ranked:
        rejects = ", ".join(f"{n} {why}" for why, n in result.rejected.items())
        return f"no legal layout fits ({rejects})"
    winner = result.ranked[0]
    lines = ["best layouts this repository can run:", ""]
    for i, e in enumerate(result.ranked[:count]):
        verdict = "winner" if i == 0 else why_loses(e, winner)
        lines.append(
            f"{i + 1}. {e.layout.describe():<52} {e.tflops:7.1f} TFLOPS/GPU  {e.memory['total'] / GB:6.1f} GB  {verdict}"
        )
    lines.append("")
    lines.append(
        f"considered {len(result.ranked)} fitting layouts; rejected "
        + (", ".join(f"{n} ({why})" for why, n in result.rejected.items()) or "none")
    )
    lines += ["", render_estimate(winner)]
    if result.pipelined is not None:
        p = result.pipelined
        gain = p.tflops / winner.tflops - 1
        lines += [
            "",
            f"with pipeline parallelism: best {p.layout.describe()}, {p.tflops:.1f} TFLOPS/GPU,"
            f" {100 * gain:+.1f}% vs the winner, {p.memory['total'] / GB:.1f} GB"
            + ("; runnable here" if p.runnable else f"; not runnable here: {p.not_runnable_reason()}"),
        ]
    lines += ["", FLOPS_NOTE]
    return "\n".join(lines)


def render_calibration(rows: list[dict], ladders: dict[str, list[tuple[str, float, float]]] | None = None) -> str:
    lines = [
        "| point | published | predicted | error | dominant | comm. share of kernel time |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["compiled"]:
            continue
        fmt = "{:.2f}" if r["metric"] == "scaling_efficiency" else "{:,.0f}"
        name = f"held out: {r['name']}" if r["held_out"] else r["name"]
        lines.append(
            f"| {name} | {fmt.format(r['published'])} | {fmt.format(r['predicted'])} | {100 * r['error']:+.1f}% "
            f"| {r['dominant']} | {100 * r['comm_fraction']:.0f}% |"
        )
    compiled = [r for r in rows if r["compiled"]]
    if compiled:
        lines += ["", "this repository's recipes as XLA:GPU compiles them: the roofline of the schedule", ""]
        lines += ["| compiled program | modelled step | planner | error |", "|---|---|---|---|"]
        lines += [
            f"| {r['name']} | {r['published']:.2f} s | {r['predicted']:.2f} s | {100 * r['error']:+.1f}% |"
            for r in compiled
        ]
    for name, steps in (ladders or {}).items():
        lines += ["", f"held out, {name}: from the exchange the fit assumed to the run's own", ""]
        lines += ["| step | predicted | error |", "|---|---|---|"]
        lines += [f"| {step} | {value:,.0f} | {100 * error:+.1f}% |" for step, value, error in steps]
    return "\n".join(lines)
