"""Test set-up: CPU only, 8 simulated devices (set before jax is imported anywhere).

Every JAX process of the suite, this one and the runs it starts, compiles with ``TEST_XLA_FLAGS``,
because the suite compiles far more than it runs: no LLVM optimisation (it cut the compile-bound
tests by a third here, with the same losses) and XLA:CPU's classic elemental emitters instead of
its MLIR fusion emitters (a sharded step of the tiny model compiled in 8.0-8.5 s instead of
11.1-13.4, with the same loss).

Every JAX process of the suite also shares one persistent compilation cache, kept between runs of
the suite in a user-level folder as pip keeps its downloads (``MAXTEXT_TEST_CACHE`` moves it):
entries are keyed by the program, its XLA flags, devices and jaxlib, so a changed program compiles
again, and the oldest entries go beyond ``CACHE_MAX_BYTES``. Compiles for GPU targets stay out of
it (a GPU target's train step got a new key on every run); ``tools/aot_compile.py --target`` keeps
XLA:GPU's kernel cache instead (``gpu_kernel_cache``, as test_aot_gpu.py passes it). A cached
executable brings no compile-time warnings and the metadata of whichever compile stored it, so
what reads those compiles past the cache (``compile_train_step`` in MaxText/aot/compile.py, for
the AOT report).
"""

import hashlib
import os
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
TEST_CACHE = Path(os.environ.get("MAXTEXT_TEST_CACHE", Path.home() / ".cache" / "maxtext-tests"))


def _make_cache_folders(root: Path) -> None:
    for name in ("jax", "xla-gpu-kernels"):
        (root / name).mkdir(parents=True, exist_ok=True)


try:
    _make_cache_folders(TEST_CACHE)
except OSError:  # a home folder that cannot be written (an image's user): a temporary folder
    TEST_CACHE = Path(tempfile.gettempdir()) / "maxtext-tests"
    _make_cache_folders(TEST_CACHE)
JAX_CACHE = TEST_CACHE / "jax"
GPU_KERNEL_CACHE = TEST_CACHE / "xla-gpu-kernels"
CACHE_MAX_BYTES = 4 << 30  # JAX's own bound (its LRU eviction) races between processes: pruned here
KERNEL_CACHE_MAX_BYTES = 256 << 20

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "").split()
_flags += [f for f in ("--xla_force_host_platform_device_count=8", *TEST_XLA_FLAGS) if f not in _flags]
os.environ["XLA_FLAGS"] = " ".join(_flags)
CACHE_ENV = {
    "JAX_COMPILATION_CACHE_DIR": str(JAX_CACHE),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",  # with no LLVM optimisation most compiles are short
}
os.environ.update(CACHE_ENV)

import pytest  # noqa: E402

from MaxText.config import Config, load_config  # noqa: E402


def make_config(*overrides: str, model: str = "deepseek3-tiny") -> Config:
    """A resolved config for tests: ``make_config("num_experts=8", "dtype=float64")``."""
    return load_config([f"model_name={model}", "run_name=test", *overrides]).with_platform("cpu")


# The slowest files first (worker-seconds of a full run, docs/LOG.md), so that two workers
# (``--dist loadfile``) finish together. pytest-xdist orders files by their number of tests unless
# told not to: ``make test`` passes ``--no-loadscope-reorder``.
SLOW_FILES_FIRST = (
    "test_aot_gpu.py",
    "test_train.py",
    "test_slurm_cluster.py",
    "test_expert_parallel.py",
    "test_pipeline.py",
    "test_health.py",
    "test_docs_commands.py",
    "test_default_run.py",
    "test_tokamax_matmul.py",
    "test_k8s_jobset.py",
    "test_train_parts.py",
    "test_data_train.py",
    "test_hf_interop.py",
    "test_resume.py",
    "test_quantization.py",
    "test_aot_compile.py",
    "test_checkpointing.py",
    "test_tool_help.py",
    "test_data_pipeline.py",
    "test_gradients.py",
)


def pytest_sessionstart(session) -> None:
    """The caches kept within ``CACHE_MAX_BYTES``: the oldest entries go first (once per run,
    before any worker starts)."""
    if hasattr(session.config, "workerinput"):
        return
    entries = []
    for path in (*JAX_CACHE.iterdir(), *GPU_KERNEL_CACHE.iterdir()):
        try:
            stat = path.stat()
            if not path.is_file():  # a folder a library keeps inside the cache: left alone
                continue
            if path.parent == GPU_KERNEL_CACHE and stat.st_size > KERNEL_CACHE_MAX_BYTES:
                path.unlink()  # XLA appends to a kernel cache and never drops a kernel
                continue
            entries.append((path, stat))
        except OSError:  # gone meanwhile (another run pruning)
            continue
    entries.sort(key=lambda entry: entry[1].st_mtime)
    total = sum(stat.st_size for _, stat in entries)
    for path, stat in entries:
        if total <= CACHE_MAX_BYTES:
            break
        total -= stat.st_size
        path.unlink(missing_ok=True)


def pytest_collection_modifyitems(items: list) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order kept otherwise


@pytest.fixture
def tiny_config() -> Config:
    return make_config()


def cpu_env(devices: int, **extra: str) -> dict[str, str]:
    """The environment of a JAX process the suite starts: CPU, ``devices`` simulated devices, the
    suite's XLA flags and its shared compilation cache."""
    return {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": " ".join((f"--xla_force_host_platform_device_count={devices}", *TEST_XLA_FLAGS)),
        **CACHE_ENV,
        **extra,
    }


def gpu_kernel_cache(target: str) -> Path:
    """XLA:GPU's kernel cache file for ``target`` (``--xla_gpu_kernel_cache_file``), kept between
    runs: kernels are found by a fingerprint of their fused computation, which leaves out the GPU
    and the compiler, so one file per target and per pinned compiler stack. Only a speed-up for a
    compile-only target: the HLO, its schedule, buffers and thunks are decided before any kernel is
    generated, and the kernels themselves never run."""
    stack = hashlib.sha256((REPO / "requirements-gpu-compile.txt").read_bytes()).hexdigest()[:12]
    return GPU_KERNEL_CACHE / f"{target}-{stack}.bin"


def gpu_target_env() -> dict[str, str]:
    """The environment of a process that compiles for GPU targets (with JAX's CUDA plugin): without
    the suite's XLA:CPU flags and without its compilation cache (a GPU target's train step got a
    new cache key on every run)."""
    return {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and k not in CACHE_ENV}


def scan_bodies(jaxpr):
    """The bodies of the scans in ``jaxpr`` and in the jaxprs it calls (a trace's loops)."""
    import jax.extend

    for e in jaxpr.eqns:
        if e.primitive.name == "scan":
            yield e.params["jaxpr"].jaxpr
        for sub in jax.extend.core.jaxprs_in_params(e.params):
            yield from scan_bodies(sub)
