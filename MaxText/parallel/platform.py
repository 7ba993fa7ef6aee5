"""The platform a program is traced for.

Backends chosen by ``auto`` keys and the checks of what a platform can run ask which platform the
code will run on. That is JAX's default backend, except while compiling ahead of time for a GPU
target on a host without one (``MaxText/aot``): the mesh is then made of the target's compile-only
devices, JAX's default backend is still the host's CPU, and ``compiling_for("gpu")`` says where
the program will run.
"""

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import jax

GPU_PLATFORMS = ("gpu", "cuda")

_TARGET: ContextVar[str | None] = ContextVar("target_platform", default=None)


def trace_platform() -> str:
    """The platform the current trace is for: the ahead-of-time target if one is set, else JAX's backend."""
    return _TARGET.get() or jax.default_backend()


@contextlib.contextmanager
def compiling_for(platform: str) -> Iterator[None]:
    """Trace (and lower) for ``platform`` instead of JAX's default backend."""
    token = _TARGET.set(platform)
    try:
        yield
    finally:
        _TARGET.reset(token)
