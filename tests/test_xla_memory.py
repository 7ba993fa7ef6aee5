"""The memory XLA:GPU plans the step for (``MaxText/train/xla_memory.py``): its budget worked out
by hand from XLA's rule, the slop factor that moves it to what the allocator holds, and a compile
that takes the option."""

import jax
import jax.numpy as jnp
import pytest

from MaxText.train import xla_memory

GB = 1e9


def test_budget_is_the_one_xla_logged():
    """The GB200 recipe's compile under XLA's default slop factor (186 GB of HBM; arguments 64.010 GB
    and outputs all aliased to them but 1.6 kB) has the budget XLA:GPU's rematerialisation logged
    for it: "Can't reduce memory use below 134.63GiB (144560172063 bytes)"."""
    io = 64_009_993_228 + 64_009_667_188 - 64_009_665_548
    assert xla_memory.xla_budget(186 * GB, io) == pytest.approx(144_560_172_063, rel=1e-5)
    assert xla_memory.xla_budget(80 * GB, 0, slop=100) == pytest.approx(64 * GB)


@pytest.mark.parametrize("hbm, fraction, io", [(186, 0.9, 64.01), (80, 0.9, 21.8), (80, 0.75, 10.0), (288, 0.9, 120)])
def test_slop_moves_the_budget_to_the_allocators_memory(hbm, fraction, io):
    """The slop factor gives a budget of XLA's own 95% of what the allocator leaves after the
    inputs and outputs, within one percent of slop (it is a whole percent, rounded down), and
    never past the allocator."""
    allocator = fraction * hbm * GB
    slop = xla_memory.slop_for_allocator(hbm * GB, allocator, io * GB)
    budget = xla_memory.xla_budget(hbm * GB, io * GB, slop)
    wanted = io * GB + 0.95 * (allocator - io * GB)
    assert budget <= wanted < xla_memory.xla_budget(hbm * GB, io * GB, slop + 1)
    assert budget < allocator
    # a larger allocator than XLA's 80% raises the budget above XLA's default, a smaller one lowers it
    assert (slop > xla_memory.XLA_DEFAULT_SLOP) == (fraction > xla_memory.XLA_BASE_FRACTION)


def test_inputs_past_xlas_share_keep_the_default():
    assert xla_memory.slop_for_allocator(80 * GB, 72 * GB, 70 * GB) == xla_memory.XLA_DEFAULT_SLOP


def test_a_slop_factor_in_xla_flags_is_left_as_it_is(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_latency_hiding_scheduler=true")
    assert xla_memory.slop_in_xla_flags() is None
    options = xla_memory.compiler_options(80 * GB, 72 * GB, 20 * GB)
    assert options == {xla_memory.SLOP_FLAG: 112} and xla_memory.slop_used(options) == 112
    assert xla_memory.slop_used({}) == xla_memory.XLA_DEFAULT_SLOP
    # the last mention wins, as in XLA (a recipe's flags, then the user's)
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_memory_limit_slop_factor=95 --xla_gpu_memory_limit_slop_factor=0")
    assert xla_memory.slop_in_xla_flags() == 0
    assert xla_memory.compiler_options(80 * GB, 72 * GB, 20 * GB) == {} and xla_memory.slop_used({}) == 0


class _Device:
    """What the training loop asks of a ``jax.Device``: its platform and allocator statistics."""

    def __init__(self, platform: str, stats: dict | None):
        self.platform, self.stats = platform, stats

    def memory_stats(self) -> dict | None:
        return self.stats


def test_a_gpu_plans_for_its_allocators_limit(monkeypatch):
    """72 GB of allocator at the recipes' fraction 0.9 is an 80 GB GPU: 95% of 72 - 20 GB over the
    80% of 80 less 20 that XLA assumes, a slop factor of 112; nothing without the allocator's limit
    or off a GPU."""
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.delenv("XLA_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    gpu = _Device("gpu", {"bytes_limit": 72 * GB})
    assert xla_memory.device_compiler_options(gpu, 20 * GB) == {xla_memory.SLOP_FLAG: 112}
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75")  # the same limit is a 96 GB GPU: 95 x 52 / 56.8
    assert xla_memory.device_compiler_options(gpu, 20 * GB) == {xla_memory.SLOP_FLAG: 86}
    assert xla_memory.device_compiler_options(_Device("gpu", {}), 20 * GB) == {}
    assert xla_memory.device_compiler_options(_Device("gpu", None), 20 * GB) == {}
    assert xla_memory.device_compiler_options(_Device("cpu", {"bytes_limit": 72 * GB}), 20 * GB) == {}
    assert xla_memory.device_compiler_options(jax.devices()[0], 0) == {}


def test_memory_fraction_reads_either_name():
    assert xla_memory.memory_fraction({}) == xla_memory.JAX_MEMORY_FRACTION
    assert xla_memory.memory_fraction({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"}) == 0.9
    assert xla_memory.memory_fraction({"XLA_CLIENT_MEM_FRACTION": "0.8"}) == 0.8


def test_a_compile_takes_the_option():
    """XLA accepts the option by name (a misspelt one fails the compile)."""
    lowered = jax.jit(lambda x: x * 2).lower(jnp.ones(4))
    assert lowered.compile(compiler_options={xla_memory.SLOP_FLAG: 112})(jnp.ones(4))[0] == 2
    with pytest.raises(Exception, match="slop"):
        lowered.compile(compiler_options={xla_memory.SLOP_FLAG + "_misspelt": 113})
