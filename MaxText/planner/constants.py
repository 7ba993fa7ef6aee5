"""Every efficiency constant of the planner, and the software stacks it models, in one place.

How they were set. The seven shared constants (the GEMM efficiencies, ``ELEMENTWISE_PASSES``, and
the ``megatron`` stack's dispatch overlap) were fitted together, by least squares on the log error
with a weak pull towards round priors (GEMMs 0.65/0.55 BF16, 0.45/0.40 FP8, attention 0.4, 8 HBM
passes, 80% overlap), to the six optimised Megatron points in ``calibration.py`` (GB200 and GB300,
BF16 and MXFP8, and the Qwen3 control on H100), then rounded. Each baseline stack then got the one
or two constants that describe what it lacks, fitted to its own published figure (named below).
The fit is in-sample: 10 published numbers, 11 fitted constants in all; the "Calibration" table of
docs/performance.md shows the residuals and which point the model misses. Constants marked "set" were not fitted.

A stack is a named option (``--stack``), not a per-point fudge: it says which kernels and which
overlap a software stack has, and every point that used the stack gets the same values.
"""

from __future__ import annotations

from dataclasses import dataclass

# Fraction of dense peak a GEMM class reaches, by precision (mxfp8 and fp8 share the FP8 row).
# Fitted: BF16 rows on Megatron-Bridge GB200 782 / GB300 961 and Qwen3-235B H100 245 TFLOPS/GPU;
# FP8 rows on Megatron-Core GB200 970, Megatron-Bridge GB200 1,003 / GB300 1,088 (MXFP8): the
# quantisation kernels and scale handling keep FP8 GEMMs further from their doubled peak.
# Attention cores run in BF16 at every precision (the fp8 column repeats the bf16 value).
GEMM_EFFICIENCY: dict[str, dict[str, float]] = {
    "dense": {"bf16": 0.55, "fp8": 0.37},
    "grouped": {"bf16": 0.43, "fp8": 0.29},
    "attention": {"bf16": 0.32, "fp8": 0.32},
}
# Fitted with GEMM_EFFICIENCY: non-GEMM kernels (norms, activations, permutation, router, casts)
# stream the per-layer activations through HBM this many times per pass.
ELEMENTWISE_PASSES = 10.0
# Set: all-gather, reduce-scatter and pipeline sends reach this fraction of link bandwidth (NCCL
# bus bandwidth for large messages on NVLink and InfiniBand).
COLLECTIVE_EFFICIENCY = 0.8
# Set: bytes per element of kept activations and exchanged tokens (bf16).
ACTIVATION_BYTES = 2
# Set: HBM bytes per element one emulated FP8 quantization moves (quantization/quantize.py): read
# bf16 for the block's amax, read it again and write the dequantized bf16 operand.
QUANTIZE_BYTES = 6


@dataclass(frozen=True)
class Stack:
    name: str
    summary: str
    runs_here: bool  # this repository's code path (else: modelled for calibration only)
    state: str  # "sharded": every weight and its state split over the mesh (FSDP, this repository);
    #             "distributed_optimizer": bf16 weights replicated over data parallelism, fp32 main
    #             gradients, fp32 master weights and Adam split over data parallelism (Megatron)
    exchange: str  # "all_to_all" (each token copy sent once) | "allgather" (every token to every EP rank)
    #               | "hierarchical" (once per remote domain, forwarded over NVLink there: comms.py)
    dispatch_efficiency: float  # fraction of link bandwidth the dispatch/combine reaches
    dispatch_overlap: float  # fraction of dispatch/combine (and pipeline sends) hidden behind compute
    #                    (the exchange's: ``exchange_overlap``)
    fsdp_overlap: float  # fraction of compute time that can hide weight gathers and gradient scatters
    dp_overlap: float  # fraction of the last micro-batch's compute that hides the once-per-step gradient sync
    grouped_scale: float  # grouped GEMM speed relative to a fused grouped GEMM kernel
    host_s_per_layer: float  # host launch / synchronisation seconds per layer per micro-batch
    fp8_dispatch: bool  # with FP8, the dispatch moves FP8 values + scales (XLA's collectives, this
    #                     repository's exchange); False where the exchange kernel moves bf16
    usable_hbm: float  # fraction of HBM the framework can use: JAX preallocates 0.9
    #                    (XLA_PYTHON_CLIENT_MEM_FRACTION in the recipes); PyTorch's caching allocator
    #                    leaves about 3% to the CUDA context and NCCL
    exchange_compute_overlap: float = 0.0  # fraction of compute time that hides whatever of the
    #                    exchange and the pipeline sends ``dispatch_overlap`` leaves (a schedule that
    #                    runs one chunk's exchange under another chunk's computation: DualPipe 1.0)
    # Shares of a kind's link time a compiled schedule hides (XLA:GPU's, read from the compiled
    # program by tools/aot_compile.py): where set, they replace the compute-fraction terms above.
    fsdp_hidden: float | None = None  # FSDP weight gathers and gradient scatters together
    dp_hidden: float | None = None  # the data-parallel gradient all-reduces
    vocab_hidden: float = 0.0  # the vocabulary split's token traffic
    hierarchical_overlap: float | None = None  # the two-hop exchange's share, read from its own compiles
    # HBM passes per step over each MoE layer's exchange and expert-layout buffers
    # (``moe_ep_buffer_factor`` x K rows of D per token): the gathers, scatters, weighting and
    # copies of a sort-based dispatch that fused kernels (TE's permutation, DeepEP) do not make.
    moe_buffer_passes: float = 0.0
    # ``minimal`` remat reruns the routed experts' input projections (their GEMMs run inside the
    # exchange's rematerialised rounds, and the kernels' outputs are not the dots it keeps; the
    # down-projection's output no gradient needs): +2/9 of their training FLOPs.
    routed_recompute: bool = False
    # How a compiled program's roofline times computation (tools/aot_compile.py --target): every
    # GEMM class, attention cores included, at the dense GEMM rate (the part's faster exponentials
    # are not in it). False: the fitted ``GEMM_EFFICIENCY`` rows and the system's attention speedup.
    gemms_at_dense_rate: bool = False
    elementwise_passes: float = ELEMENTWISE_PASSES  # the non-GEMM kernels' HBM passes (see above)

    @property
    def exchange_overlap(self) -> float:
        """The share of the dispatch and combine hidden: ``hierarchical_overlap`` for the two-hop
        exchange where the stack reads one from its own compiles, else ``dispatch_overlap``."""
        if self.exchange == "hierarchical" and self.hierarchical_overlap is not None:
            return self.hierarchical_overlap
        return self.dispatch_overlap


STACKS: dict[str, Stack] = {
    s.name: s
    for s in (
        Stack(
            name="megatron",
            summary="Megatron-Core optimised: DeepEP/HybridEP dispatch overlapped with compute (1F1B "
            "all-to-all overlap), CUDA graphs, distributed optimizer",
            runs_here=False,
            state="distributed_optimizer",
            exchange="all_to_all",
            dispatch_efficiency=0.70,  # set, not fitted: in a training step dispatch shares SMs and links
            dispatch_overlap=0.68,  # fitted with GEMM_EFFICIENCY
            fsdp_overlap=0.0,  # no FSDP
            dp_overlap=0.5,  # set
            grouped_scale=1.0,
            host_s_per_layer=0.0,  # CUDA graphs
            fp8_dispatch=False,  # modelled in bf16, as the calibration was fitted
            usable_hbm=0.97,
        ),
        Stack(
            name="megatron-baseline",
            summary="Megatron-Core without the optimisations: NCCL all-to-all, no dispatch overlap, "
            "no CUDA graphs (host launches and a token-count sync per MoE layer)",
            runs_here=False,
            state="distributed_optimizer",
            exchange="all_to_all",
            dispatch_efficiency=0.35,  # set: NCCL all-to-all at about half DeepEP's bandwidth
            dispatch_overlap=0.0,
            fsdp_overlap=0.0,
            dp_overlap=0.5,
            grouped_scale=1.0,
            host_s_per_layer=0.011,  # fitted: Megatron-Core GB200 MXFP8 baseline, 494 TFLOPS/GPU
            fp8_dispatch=False,
            usable_hbm=0.97,
        ),
        Stack(
            name="te-jax",
            summary="this repository on the GPU image: Transformer Engine's NCCL EP dispatch on XLA's "
            "collective stream, tokamax's grouped GEMMs, FSDP gathers overlapped by the latency-hiding scheduler",
            runs_here=True,
            state="sharded",
            exchange="all_to_all",
            dispatch_efficiency=0.70,  # set: the same NCCL EP kernels as Megatron's
            dispatch_overlap=0.60,  # set, a little below Megatron's fitted 0.68 (no 1F1B interleave)
            fsdp_overlap=0.8,  # set; checked by the 97% scaling at 1,024 GB300 (predicted 100%)
            dp_overlap=0.5,
            # set: tokamax's grouped GEMM kernels (moe_matmul=auto on GPU) taken at a fused grouped
            # GEMM's rate. Not yet measured here; the published figure for a Pallas Mosaic GPU
            # grouped GEMM of the same kind (JAX's Blackwell ragged_dot kernel, third party: 1,457
            # TFLOP/s on one GB200, about 65% of peak) is above the fitted in-step 0.43 of peak.
            # tools/bench_grouped_gemm.py measures the kernels against the dense GEMM on a GPU.
            grouped_scale=1.0,
            host_s_per_layer=0.0,  # XLA command buffers; the overflow decisions' reads are ~1e-4 s a layer
            fp8_dispatch=False,  # TE's NCCL EP moves the quantized tokens in bf16
            usable_hbm=0.9,
        ),
        Stack(
            name="jax-baseline",
            summary="this repository without Transformer Engine: all-gather token exchange, "
            "ragged_dot experts, little overlap",
            runs_here=True,
            state="sharded",
            exchange="allgather",
            dispatch_efficiency=0.145,  # fitted with grouped_scale: TE-JAX baseline, 103 TFLOPS/GPU
            dispatch_overlap=0.0,  # and communication 84% of kernel time
            fsdp_overlap=0.3,  # set
            dp_overlap=0.5,
            grouped_scale=0.75,  # fitted (see dispatch_efficiency)
            host_s_per_layer=0.0,
            fp8_dispatch=True,
            usable_hbm=0.9,
        ),
        Stack(
            name="xla",
            summary="this repository without Transformer Engine, as XLA:GPU compiles it: tokamax's grouped "
            "GEMMs, the ragged_all_to_all exchange, the latency-hiding scheduler's overlap (the recipes' XLA flags)",
            runs_here=True,
            state="sharded",
            exchange="all_to_all",
            # The overlap terms below are read from XLA:GPU's compiles of the two shipped recipes as
            # of 2026-12-07 (GB200: 256 GPUs, 4 sequences per GPU, remat full, 4 chained exchange
            # chunks; GB300: 1,024 GPUs, 2 per GPU, remat names, 2 chained chunks; both with up to
            # eight collectives in flight and the scheduler given the cost model's times;
            # docs/planner.md has the table), each pooled over the two by link time: the part of
            # each kind's modelled link time the schedule places computation against. The
            # schedule's shares move with the program and its flags (docs/planner.md).
            dispatch_efficiency=0.80,  # XLA's collectives at the planner's COLLECTIVE_EFFICIENCY, as the AOT model
            dispatch_overlap=0.75,  # the exchange's ragged-all-to-alls: 70% hidden on GB200, 84% on GB300
            # the two-hop exchange across 8-GPU nodes, from the H100 recipe's compile (2 chained
            # chunks, up to eight collectives in flight, the cost model's times, only the rows in
            # use moving on either hop): 35% hidden
            hierarchical_overlap=0.35,
            # FSDP as a capacity, not a share: the gathers and scatters a step hides are 0.194 of its
            # computation time (GB200 0.90 s of 5.02, GB300 0.51 of 2.27; 97-99% of their link
            # time in both), where their share of the link time once ran from 31% (GB200 at 1
            # sequence per GPU) to 83% (4 per GPU): the same bytes per step, and a layer's
            # traffic hides behind that layer's work
            fsdp_overlap=0.194,
            dp_overlap=0.0,  # replaced by dp_hidden
            grouped_scale=1.0,  # tokamax's kernels, as te-jax
            # command buffers hold every loop; the exchange's overflow conditionals (about 3 per MoE
            # layer and step) read a predicate on the host, some 1e-4 s a layer: left out, as te-jax
            host_s_per_layer=0.0,
            fp8_dispatch=True,
            usable_hbm=0.9,
            # the gradient all-reduces over data, issued inside the layers' backward loop: 96% hidden on
            # GB200, 97% on GB300 (3% on GB200 when XLA planned for 80% of the HBM)
            dp_hidden=0.96,
            vocab_hidden=0.58,  # the vocabulary split: 56% hidden on GB200, 63% on GB300
            # The computation terms below were read before XLA planned for the allocator's memory
            # (they moved by under 4%: its recomputation, 0.2 s on GB200, is gone).
            # The bytes-bound time in the routed experts' scopes and the exchange's buffer copies
            # (1.07 s of GB200's step, 0.55 s of GB300's), over 59 MoE layers of ``moe_ep_buffer_factor``
            # x K x D x 2 bytes per token: 39 passes over those buffers per step
            moe_buffer_passes=39.0,
            # the roofline's GEMM time is the compiled program's, and its other bytes-bound kernels
            # (norms, activations, router, casts: 0.30 s on GB200, 0.19 s on GB300) stream the
            # activations 3.5 times per pass, where the fitted stacks' unfused kernels take 10
            gemms_at_dense_rate=True,
            elementwise_passes=3.5,
            routed_recompute=True,  # the compile's routed-expert HLO FLOPs: the accounting's x 11/9
        ),
        # DeepSeek-V3's own, from its technical report (section 3.2), fitted to nothing: the
        # held-out check of the communication model (calibration.held_out_points)
        Stack(
            name="deepseek",
            summary="DeepSeek-V3's own: DualPipe (each chunk's dispatch, combine and pipeline sends under "
            "another chunk's computation), node-limited routing with a hierarchical dispatch (InfiniBand "
            "once per node, NVLink inside it), FP8 dispatch, ZeRO-1",
            runs_here=False,
            state="distributed_optimizer",
            exchange="hierarchical",
            dispatch_efficiency=0.70,  # set: the same kernels (DeepEP) as Megatron's optimised stack
            dispatch_overlap=0.0,  # nothing hidden by a fixed share: the schedule hides it behind compute
            fsdp_overlap=0.0,
            dp_overlap=0.5,
            grouped_scale=1.0,
            host_s_per_layer=0.0,
            fp8_dispatch=True,
            usable_hbm=0.97,
            exchange_compute_overlap=1.0,  # the report: "computation and communication fully overlapped"
        ),
    )
}


def default_stack() -> str:
    """The stack to plan with by default: ``te-jax`` where Transformer Engine's JAX package is
    installed (``moe_ep_comm: auto`` then takes its exchange on a GPU), else ``xla``, the
    XLA-native path the GPU-target compile measures. Only the package's presence is asked:
    nothing of it is imported."""
    import importlib.util

    try:
        found = importlib.util.find_spec("transformer_engine") is not None
    except Exception:  # a broken install: plan as without it
        found = False
    return "te-jax" if found else "xla"


DEFAULT_STACK = default_stack()
