"""Open one split of a prepared TFDS dataset as a random-access ArrayRecord data source.

The dataset is read from its folder, ``<data dir>/<dataset_name>/<version>/``, through
``tfds.builder_from_directory``: nothing is downloaded or generated here (``tfds.data_source``
by name would start downloading a catalogue dataset that is not prepared), and a dataset made by
``tools/prepare_dataset.py`` needs no builder code to be read. ``dataset_name`` may pin a
version (``name:1.0.0``) or a config (``name/config``); without a version the newest is used.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from MaxText.config import Config, ConfigError


def data_dir(config: Config) -> Path:
    """``dataset_path``, else TFDS's default data dir (``$TFDS_DATA_DIR`` or ~/tensorflow_datasets)."""
    if config.dataset_path:
        return Path(config.dataset_path).expanduser()
    return Path(os.environ.get("TFDS_DATA_DIR", "~/tensorflow_datasets")).expanduser()


def _version_key(name: str) -> tuple[int, ...]:
    return tuple(int(p) if p.isdigit() else -1 for p in name.split("."))


def dataset_dir(root: Path, dataset_name: str) -> Path:
    """The version folder of ``dataset_name`` under ``root``, or a ConfigError naming what is there."""
    if not dataset_name:
        raise ConfigError("config key 'dataset_name': required for dataset_type=tfds")
    if not root.is_dir():
        raise ConfigError(f"config key 'dataset_path': no such directory: {root}")
    name, _, version = dataset_name.partition(":")
    folder = root / name
    versions = sorted(
        (v for v in (folder.iterdir() if folder.is_dir() else []) if (v / "dataset_info.json").is_file()),
        key=lambda v: _version_key(v.name),
    )
    if version:
        versions = [v for v in versions if v.name == version]
    if not versions:
        found = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith((".", "downloads")))
        listed = ", ".join(found) if found else "none"
        raise ConfigError(
            f"config key 'dataset_name': no prepared dataset '{dataset_name}' in {root} (found: {listed}); "
            "make one with tools/prepare_dataset.py"
        )
    return versions[-1]


def open_split(config: Config, split: str, folder: Path | None = None) -> Any:
    """The ArrayRecord data source of ``split``; checks that it exists, is non-empty and holds
    the text field. ``folder`` overrides the lookup by name (the built-in corpus knows its own)."""
    import tensorflow_datasets as tfds

    folder = folder or dataset_dir(data_dir(config), config.dataset_name)
    builder = tfds.builder_from_directory(str(folder))
    name = f"{builder.name} ({folder})"
    split_key = "train_split" if split == config.train_split else "eval_split"
    hint = "; set eval_interval=0 to train without evaluation" if split_key == "eval_split" else ""
    if split not in builder.info.splits:
        raise ConfigError(
            f"config key '{split_key}': {name} has no split '{split}' (splits: {', '.join(builder.info.splits)}){hint}"
        )
    if builder.info.splits[split].num_examples == 0:
        raise ConfigError(f"config key '{split_key}': split '{split}' of {name} is empty")
    features = list(builder.info.features.keys())
    if config.dataset_text_field not in features:
        raise ConfigError(
            f"config key 'dataset_text_field': '{config.dataset_text_field}' is not a feature of {name} "
            f"(features: {', '.join(features)})"
        )
    try:
        return builder.as_data_source(split)
    except (NotImplementedError, ValueError, FileNotFoundError) as err:
        raise ConfigError(
            f"config key 'dataset_name': {name} cannot be read by index ({str(err).splitlines()[0]}); "
            "prepare it with file_format='array_record'"
        ) from None
