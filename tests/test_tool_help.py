"""Every tool's ``--help`` reads as documentation: a description and a whole sentence per argument.

``--help`` is often the first thing a newcomer reads of a tool, and fragments ("devices to compile
for") or arguments with no help at all leave them guessing what a flag does and what it defaults to.
Two checks, over every ``tools/*.py``:

- One process runs each tool with ``argparse`` patched to capture its parser instead of parsing
  (the tools build their parsers in ``main``, after their imports), and every description and
  argument help must be a whole sentence: it starts with a capital letter (or a backtick, quote,
  parenthesis or digit, where it names code) and ends with a period. The failure lists them all.
- ``python tools/<tool>.py --help`` exits 0 and prints a ``usage:`` line, which also expands every
  ``%(default)s`` the way a user sees it. One process per tool is mostly imports (seconds each), so
  they run a few at a time and the test is marked slow.
"""

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOOLS = sorted((REPO / "tools").glob("*.py"))

# Run in the repository root with the tools' paths as arguments: prints {tool: {"description": ...,
# "help": [[option, help], ...]}} or {tool: {"error": ...}} for a tool that never builds a parser.
COLLECTOR = """
import argparse, json, runpy, sys

class Captured(Exception):
    pass

def capture(parser, args=None, namespace=None):
    found[current] = {
        "description": parser.description,
        "help": [
            [(action.option_strings or [action.dest])[-1], action.help]
            for action in parser._actions
            if action.help is not argparse.SUPPRESS and not isinstance(action, argparse._HelpAction)
        ],
    }
    raise Captured

argparse.ArgumentParser.parse_args = capture
argparse.ArgumentParser.parse_known_args = capture
found = {}
for current in sys.argv[1:]:
    sys.argv = [current, "--help"]
    try:
        runpy.run_path(current, run_name="__main__")
    except Captured:
        continue
    except BaseException as err:  # SystemExit included: the tool stopped before parsing
        found[current] = {"error": f"{type(err).__name__}: {err}"}
        continue
    found[current] = {"error": "ran to the end without parsing arguments"}
print(json.dumps(found))
"""


def sentence_problem(text: str | None) -> str | None:
    """Why ``text`` is not a whole sentence, or None."""
    text = (text or "").strip()
    if not text:
        return "no text"
    if not (text[0].isupper() or text[0].isdigit() or text[0] in "`'\"("):
        return "does not start with a capital letter"
    if not text.endswith("."):
        return "does not end with a period"
    return None


def test_descriptions_and_help_texts_are_whole_sentences():
    paths = [str(path.relative_to(REPO)) for path in TOOLS]
    result = subprocess.run(
        [sys.executable, "-c", COLLECTOR, *paths], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    parsers = json.loads(result.stdout.splitlines()[-1])
    violations = []
    for path in paths:
        parser = parsers.get(path, {"error": "not collected"})
        if "error" in parser:
            violations.append(f"{path}: no parser captured ({parser['error']})")
            continue
        texts = [("description", parser["description"]), *parser["help"]]
        for name, text in texts:
            if problem := sentence_problem(text):
                violations.append(f"{path} {name}: {problem}: {text!r}")
    assert not violations, f"{len(violations)} help texts are not whole sentences:\n" + "\n".join(violations)


@pytest.mark.slow
def test_every_tool_prints_its_usage():
    def run_help(path: Path) -> str | None:
        result = subprocess.run(
            [sys.executable, str(path), "--help"], cwd=REPO, capture_output=True, text=True, timeout=300
        )
        if result.returncode == 0 and result.stdout.startswith("usage:"):
            return None
        return f"{path.name}: exit {result.returncode}\n{(result.stdout + result.stderr)[-1500:]}"

    with ThreadPoolExecutor(4) as pool:
        failures = [failure for failure in pool.map(run_help, TOOLS) if failure]
    assert not failures, "\n\n".join(failures)
