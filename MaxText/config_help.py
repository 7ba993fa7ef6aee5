"""``--help`` and ``--help-keys`` of ``python -m MaxText.train``: read from base.yml itself, so
the help can never disagree with the defaults (base.yml is the one place each default lives)."""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

from MaxText.config import BASE_YML, available_models

USAGE = """\
usage: python -m MaxText.train [extra.yml ...] [key=value ...]
       python -m MaxText.train --help-keys [PATTERN]

Trains the DeepSeek-V3 model that the config describes and writes everything under
<base_output_directory>/<run_name>/: config.yml, metrics.jsonl, loss.png, TensorBoard events and
checkpoints/<step>/. A run given the run_name of an earlier one resumes from its newest checkpoint.

The config is built in this order, each layer overriding the one before it:
  1. MaxText/configs/base.yml, which holds every key, its default and a one-line comment;
  2. MaxText/configs/models/<model_name>.yml, the model overlay ({models});
  3. extra .yml files given on the command line, in the order given;
  4. key=value arguments, which always win.

Examples:
  python -m MaxText.train                                   # deepseek3-tiny, 60 steps, CPU or GPU
  python -m MaxText.train model_name=deepseek3-small steps=200
  python -m MaxText.train plan.yml run_name=my-run          # a layout overlay, then overrides
  python -m MaxText.train --help-keys checkpoint            # the keys whose name contains "checkpoint"

--help-keys [PATTERN] lists the keys whose name contains PATTERN (or matches it as a shell
pattern such as 'ici_*'), with their defaults and comments; with no PATTERN it lists every key.
Bad input (an unknown key, a wrong type, an impossible combination) prints one line and exits
with code 2. docs/configuration.md explains the config in depth."""


@dataclass(frozen=True)
class KeyHelp:
    key: str
    default: str  # as written in base.yml
    comment: str
    section: str  # the "# ---- name ----" heading above it


_KEY_LINE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*):\s*(.*?)\s*(?:#\s?(.*))?$")
_SECTION = re.compile(r"^#\s*-+\s*(.*?)\s*-+\s*$")


def base_keys() -> list[KeyHelp]:
    """Every top-level key of base.yml with its default and comment (a block value's comment is
    the comment line above the key)."""
    keys, section, previous_comment = [], "", ""
    for line in BASE_YML.read_text().splitlines():
        if heading := _SECTION.match(line):
            section, previous_comment = heading.group(1), ""
            continue
        if line.startswith("#"):
            previous_comment = line.lstrip("# ").strip()
            continue
        if match := _KEY_LINE.match(line):
            key, default, comment = match.groups()
            if not default:  # a block value (a list below the key)
                default, comment = "(a list; see base.yml)", comment or previous_comment
            keys.append(KeyHelp(key, default, comment or "", section))
        previous_comment = ""
    return keys


def matching_keys(pattern: str | None) -> list[KeyHelp]:
    """Keys whose name contains ``pattern`` (case-insensitive), or match it where it has * ? or [."""
    keys = base_keys()
    if not pattern:
        return keys
    pattern = pattern.lower()
    if any(c in pattern for c in "*?["):
        return [k for k in keys if fnmatch.fnmatchcase(k.key.lower(), pattern)]
    return [k for k in keys if pattern in k.key.lower()]


def render_keys(keys: list[KeyHelp]) -> str:
    width = max(len(f"{k.key}: {k.default}") for k in keys)
    lines, section = [], None
    for k in keys:
        if k.section != section:
            section = k.section
            lines.append(f"\n# {section}" if lines else f"# {section}")
        lines.append(f"{k.key}: {k.default}".ljust(width) + f"  # {k.comment}")
    return "\n".join(lines)


def usage() -> str:
    return USAGE.format(models=", ".join(available_models()))


def help_keys(pattern: str | None) -> tuple[str, int]:
    """The ``--help-keys`` text and exit code (2 when nothing matches, naming the pattern)."""
    keys = matching_keys(pattern)
    if not keys:
        return f"error: no config key matches '{pattern}' (python -m MaxText.train --help-keys lists them all)", 2
    return render_keys(keys), 0
