"""The built-in corpus: the running interpreter's standard library, as real text that needs no download.

Every Python installation carries about 1,800 ``.py`` files (about 30 MB for CPython 3.11) of
varied, human-written text, which is plenty for the tiny model to show a falling loss on real
data. On first use they are turned into a TFDS ArrayRecord dataset with the same builder as
``tools/prepare_dataset.py`` and cached under ``dataset_path`` (else
``<base_output_directory>/datasets``); later runs only open it. ``builtin_max_files`` takes an
evenly spaced subset, cached under its own name, for quick runs and tests.

Several processes on one host may start at once: a file lock lets the first build and the rest
wait and reuse its result.
"""

from __future__ import annotations

import fcntl
import sys
import sysconfig
from pathlib import Path

from MaxText.config import Config
from MaxText.data.text_dataset import VERSION, Corpus, build_text_dataset

VAL_FRACTION = 0.02  # about 36 files held out for eval_loss


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(max_files: int) -> list[Path]:
    """The standard library's .py files (without installed packages), sorted; an evenly spaced
    subset when ``max_files`` > 0."""
    root = stdlib_dir()
    files = sorted(f for f in root.rglob("*.py") if "site-packages" not in f.relative_to(root).parts)
    if 0 < max_files < len(files):
        files = [files[i * len(files) // max_files] for i in range(max_files)]
    return files


def builtin_name(max_files: int) -> str:
    name = f"python{sys.version_info.major}{sys.version_info.minor}_stdlib"
    return f"{name}_{max_files}_files" if max_files > 0 else name


def cache_dir(config: Config) -> Path:
    return Path(config.dataset_path or Path(config.base_output_directory) / "datasets").expanduser()


def builtin_dataset(config: Config) -> Path:
    """The version folder of the built-in dataset, built on first use."""
    root = cache_dir(config)
    name = builtin_name(config.builtin_max_files)
    folder = root / name / VERSION
    if (folder / "dataset_info.json").is_file():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "dataset_info.json").is_file():
            files = stdlib_files(config.builtin_max_files)
            print(f"building the built-in corpus ({len(files)} files of {stdlib_dir()}) in {root}", file=sys.stderr)
            build_text_dataset(Corpus(files, root=stdlib_dir()), root, name, VAL_FRACTION)
    return folder
