"""JAX's persistent compilation cache for training runs (``jax_cache_dir``).

A restarted run (a job requeued after a lost node, a run resumed with the same command) compiles
the same programs again: at the 671B's size that is minutes on every restart, while the cluster
waits. With a persistent cache the restart reads the compiled step instead. JAX writes entries from
process 0 only and, on GPU, keys them without the device assignment so that every process of a
multi-host job finds what process 0 wrote (on CPU the keys differ by process): the folder must be
one that every process sees (by default the run's own output folder, on the shared filesystem in
the recipes).
"""

import os
from pathlib import Path

import jax

from MaxText.config import Config, ConfigError

ENV_CACHE_DIR = "JAX_COMPILATION_CACHE_DIR"  # JAX's own setting, which ``auto`` keeps


def compilation_cache_dir(config: Config) -> str | None:
    """The folder ``jax_cache_dir`` names: ``auto`` is JAX's own setting where the environment
    gives one, else ``<run>/jax_cache``; "" is none."""
    if config.jax_cache_dir == "auto":
        return os.environ.get(ENV_CACHE_DIR) or str(config.output_dir / "jax_cache")
    return config.jax_cache_dir or None


def use_compilation_cache(config: Config) -> None:
    """Point JAX at the run's compilation cache (or turn it off); before the first compile, since
    JAX decides once per process whether it uses one. A local folder that cannot be made is a
    ``ConfigError`` (JAX would only warn at each compile and run without it)."""
    folder = compilation_cache_dir(config)
    if folder is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return
    if "://" not in folder:  # remote storage (gs://...) is JAX's to open
        try:
            Path(folder).mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ConfigError(f"jax_cache_dir: cannot create {folder}: {err.strerror}") from None
    jax.config.update("jax_compilation_cache_dir", folder)
