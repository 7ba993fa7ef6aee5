"""The docs cannot drift from the code: every command they show is run or checked.

Every line of a ```bash, ```sh, ```shell or ```console block in README.md and docs/*.md (docs/LOG.md
aside: a dated history keeps the commands of its day) is split into simple commands, as a shell
would, and each one is

- **run**, where that is cheap and needs no cluster: ``python -m MaxText.train --help`` and
  ``--help-keys``, ``tools/model_stats.py``, ``tools/plan.py`` (in a temporary folder, so that
  ``--emit-config`` writes there) and the ``--help`` of every tool a command names (the README's
  quick-start ``make train`` runs in ``test_default_run.py``);
- **parsed**, everything else (sbatch, kubectl, docker, GPU-only tools, long runs): ``make`` targets
  and variables exist in the Makefile; every ``key=value`` (on a python command line, in ``ARGS`` or in
  ``MAXTEXT_ARGS``) names a key of ``MaxText/configs/base.yml`` and every ``model_name`` an overlay;
  every ``--flag`` given to a tool appears in that tool's ``--help`` (``MaxText.train``'s too); every
  repository path named (``tools/``, ``recipes/``, ``docker/``, ``tests/``, requirement files, ...)
  exists, and sbatch, kubectl and docker name files that exist.

Placeholders (``<run>``, ``<job id>``) stand for anything and are not checked. Besides the commands,
every relative link resolves (to a file, and to a heading where it names one), the README maps every
docs page, and the README stays a front page (at most about 200 lines).
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
import yaml

from tests.conftest import cpu_env

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOC_FILES = [
    README,
    *sorted(p for p in (REPO / "docs").glob("*.md") if p.name != "LOG.md"),
    REPO / "recipes" / "README.md",
    REPO / "docker" / "README.md",
]
BASE_KEYS = set(yaml.safe_load((REPO / "MaxText/configs/base.yml").read_text()))
MODELS = {p.stem for p in (REPO / "MaxText/configs/models").glob("*.yml")}
MAKEFILE = (REPO / "Makefile").read_text()
README_MAX_LINES = 220
TIMEOUT_S = 300

FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)
COMMAND_FENCES = {"bash", "sh", "shell", "console"}
PLACEHOLDER = re.compile(r"<[^<>\s][^<>]*>")  # <run>, <job id>, <choice>
KEY_VALUE = re.compile(r"^([a-z_][a-z0-9_]*)=(.*)$", re.S)
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
OPERATORS = {";", "&", "&&", "|", "||", "(", ")"}
SKIPPED_WORDS = {"for", "while", "if", "done", "fi", "wait", "cd", "export", "source", "echo", "grep", "cat", "ls"}
PYTHONS = {"python", "python3", ".venv/bin/python", ".venv-gpu-compile/bin/python"}
GPU_ONLY_PYTHON = ".venv-gpu-compile/bin/python"
REPO_PATH_PREFIXES = ("tools/", "recipes/", "docker/", "MaxText/", "tests/", "docs/", ".ci/", "requirements")
CHEAP_TOOLS = {"tools/model_stats.py", "tools/plan.py", "tools/checkpoint_cost.py"}


@dataclass(frozen=True)
class Command:
    """One simple command of a docs code block: ``env words...``, with where it was written."""

    where: str  # file:line
    env: tuple[tuple[str, str], ...]
    words: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.where}: {shlex.join([f'{k}={v}' for k, v in self.env] + list(self.words))}"


# ---------------------------------------------------------------- reading the docs


def strip_comment(line: str) -> str:
    """The line without a shell comment: a ``#`` that starts a word outside quotes."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def logical_lines(block: str, console: bool) -> list[tuple[int, str]]:
    """(line offset, command line) of a code block, continuations joined; a console block's
    commands are its ``$ `` lines."""
    lines, current, start = [], "", 0
    for offset, raw in enumerate(block.splitlines()):
        if not current:
            if console:
                if not raw.startswith("$ "):
                    continue
                raw = raw[2:]
            start = offset
        text = strip_comment(raw).rstrip()
        if text.endswith("\\"):
            current += text[:-1] + " "
            continue
        current += text
        if current.strip():
            lines.append((start, current.strip()))
        current = ""
    return lines


def split_commands(line: str) -> list[tuple[tuple[tuple[str, str], ...], tuple[str, ...]]]:
    """A command line as a shell splits it: simple commands of (env assignments, words)."""
    lexer = shlex.shlex(PLACEHOLDER.sub("PLACEHOLDER", line), posix=True, punctuation_chars=";&|()<>")
    lexer.whitespace_split = True
    lexer.commenters = ""
    commands, words = [], []
    tokens = list(lexer)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token in OPERATORS:
            commands.append(words)
            words = []
        elif set(token) <= set("<>&") and any(c in token for c in "<>"):  # a redirection and its target
            if words and words[-1].isdigit():
                words.pop()
            i += 1
        else:
            words.append(token)
        i += 1
    commands.append(words)
    result = []
    for words in commands:
        while words and words[0] in ("do", "then", "else"):
            words = words[1:]
        env = []
        while words and ENV_ASSIGNMENT.match(words[0]):
            name, _, value = words[0].partition("=")
            env.append((name, value))
            words = words[1:]
        if words and words[0] not in SKIPPED_WORDS:
            result.append((tuple(env), tuple(words)))
    return result


def doc_commands() -> list[Command]:
    commands = []
    for path in DOC_FILES:
        text = path.read_text()
        for match in FENCE.finditer(text):
            if match.group(1) not in COMMAND_FENCES:
                continue
            first_line = text[: match.start(2)].count("\n") + 1
            for offset, line in logical_lines(match.group(2), console=match.group(1) == "console"):
                where = f"{path.relative_to(REPO)}:{first_line + offset}"
                commands += [Command(where, env, words) for env, words in split_commands(line)]
    return commands


COMMANDS = doc_commands()


# ---------------------------------------------------------------- what a command is


def python_parts(command: Command) -> tuple[str, str, list[str]] | None:
    """("module" or "script", its name, its arguments) of a python command; None otherwise."""
    words = command.words
    if words[0] not in PYTHONS and not words[0].endswith("/python"):
        return None
    if len(words) > 2 and words[1] == "-m":
        return "module", words[2], list(words[3:])
    if len(words) > 1 and words[1].endswith(".py"):
        return "script", words[1], list(words[2:])
    return None


def is_help(args: list[str]) -> bool:
    return bool(args) and args[0] in ("--help", "-h", "--help-keys")


def runs_here(command: Command) -> bool:
    """Cheap commands that need no cluster, no GPU and no long run: they are run, not only parsed."""
    parts = python_parts(command)
    if parts is None or command.words[0] == GPU_ONLY_PYTHON or "PLACEHOLDER" in " ".join(command.words):
        return False
    kind, name, args = parts
    if kind == "module":
        return name == "MaxText.train" and is_help(args)
    return name in CHEAP_TOOLS or is_help(args)


def run_argv(command: Command) -> list[str]:
    _, name, args = python_parts(command)
    head = ["-m", name] if name == "MaxText.train" else [str(REPO / name)]
    return [sys.executable, *head, *args]


def named_tools() -> list[str]:
    tools = set()
    for command in COMMANDS:
        parts = python_parts(command)
        if parts and parts[0] == "script" and parts[1].startswith("tools/"):
            tools.add(parts[1])
    return sorted(tools)


def config_arguments(command: Command) -> list[str]:
    """The key=value words that go to the config loader: a python command's, make's ARGS,
    the environment's MAXTEXT_ARGS."""
    found = []
    parts = python_parts(command)
    if parts is not None:
        found += [word for word in parts[2] if KEY_VALUE.match(word)]
    if command.words[0] == "make":
        for word in command.words[1:]:
            if word.startswith("ARGS="):
                found += shlex.split(word[len("ARGS=") :])
    for name, value in command.env:
        if name == "MAXTEXT_ARGS":
            found += shlex.split(value)
    return found


def repo_paths(command: Command) -> list[str]:
    """Words that name a file or folder of this repository."""
    paths = []
    for word in command.words:
        word = word.split("=", 1)[1] if word.startswith("--") and "=" in word else word
        if word.startswith(REPO_PATH_PREFIXES) and "PLACEHOLDER" not in word and not any(c in word for c in "*?["):
            paths.append(word.split("::")[0])
    return paths


# ---------------------------------------------------------------- running the cheap ones, once


@pytest.fixture(scope="module")
def executions(tmp_path_factory) -> dict[tuple[str, ...], subprocess.CompletedProcess]:
    """Every runnable docs command and every named tool's ``--help``, each run once, two at a time
    (the same command written in two places runs once). Keyed by the argv after the interpreter;
    plan.py runs in a folder of its own, where ``--emit-config`` writes."""
    jobs: dict[tuple[str, ...], tuple[list[str], Path]] = {}
    for command in COMMANDS:
        if runs_here(command):
            argv = run_argv(command)
            jobs.setdefault(tuple(argv[1:]), (argv, tmp_path_factory.mktemp("cwd")))
    for tool in named_tools():
        argv = [sys.executable, str(REPO / tool), "--help"]
        jobs.setdefault(tuple(argv[1:]), (argv, REPO))
    argv = [sys.executable, "-m", "MaxText.train", "--help"]
    jobs.setdefault(tuple(argv[1:]), (argv, REPO))
    env = cpu_env(1)

    def run(job: tuple[list[str], Path]) -> subprocess.CompletedProcess:
        argv, cwd = job
        return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(zip(jobs, pool.map(run, jobs.values()), strict=True))
    for key, (_, cwd) in jobs.items():
        results[key].cwd = cwd
    return results


def help_text(executions, target: str) -> str:
    argv = ("-m", "MaxText.train", "--help") if target == "MaxText.train" else (str(REPO / target), "--help")
    result = executions[argv]
    assert result.returncode == 0, f"{target} --help: {(result.stdout + result.stderr)[-2000:]}"
    return result.stdout


# ---------------------------------------------------------------- the tests


def test_the_docs_have_commands_to_check():
    assert len(COMMANDS) > 40, "the command blocks were not found: were the fences changed?"
    assert any(runs_here(c) for c in COMMANDS)


@pytest.mark.parametrize("command", [c for c in COMMANDS if runs_here(c)], ids=str)
def test_cheap_command_runs(command: Command, executions):
    argv = run_argv(command)
    result = executions[tuple(argv[1:])]
    assert result.returncode == 0, f"{command}\nexit {result.returncode}:\n{(result.stdout + result.stderr)[-3000:]}"
    assert result.stdout.strip(), f"{command}: printed nothing"
    args = python_parts(command)[2]
    if "--emit-config" in args:
        written = result.cwd / args[args.index("--emit-config") + 1]
        keys = set(yaml.safe_load(written.read_text()))
        assert keys and keys <= BASE_KEYS, f"{command}: --emit-config wrote keys base.yml lacks: {keys - BASE_KEYS}"


@pytest.mark.parametrize("command", COMMANDS, ids=str)
def test_command_matches_the_code(command: Command, executions):
    for path in repo_paths(command):
        assert (REPO / path).exists(), f"{command}: {path} does not exist"
    for word in config_arguments(command):
        match = KEY_VALUE.match(word)
        assert match, f"{command}: '{word}' is not key=value"
        key, value = match.groups()
        assert key in BASE_KEYS, f"{command}: '{key}' is not a key of MaxText/configs/base.yml"
        if key == "model_name" and "PLACEHOLDER" not in value:
            assert value in MODELS, f"{command}: no overlay MaxText/configs/models/{value}.yml"

    program = command.words[0]
    parts = python_parts(command)
    if parts is not None:
        kind, name, args = parts
        if kind == "script":
            assert (REPO / name).is_file(), f"{command}: no {name}"
        flags = [arg.split("=", 1)[0] for arg in args if arg.startswith("--") and arg != "--help"]
        if (kind == "script" and name.startswith("tools/")) or (kind == "module" and name == "MaxText.train"):
            text = help_text(executions, name)
            for flag in flags:
                assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text), (
                    f"{command}: {flag} is not in `{name} --help`"
                )
        elif kind == "module":
            assert importlib.util.find_spec(name) is not None, f"{command}: no module {name}"
    elif program == "make":
        targets = set(re.findall(r"^([A-Za-z][\w-]*):", MAKEFILE, re.M))
        for word in command.words[1:]:
            if "=" in word:
                variable = word.split("=", 1)[0]
                assert re.search(rf"\$\({variable}\)", MAKEFILE), f"{command}: the Makefile does not use {variable}"
            elif not word.startswith("-"):
                assert word in targets, f"{command}: no make target '{word}'"
        for name, _ in command.env:
            assert re.search(rf"\b{name}\b", MAKEFILE), f"{command}: the Makefile does not use {name}"
    elif program == "sbatch":
        scripts = [w for w in command.words if w.endswith(".sbatch")]
        assert scripts, f"{command}: names no .sbatch file"
        if "CONFIG" in dict(command.env):  # the recipe reads it (docs/clusters.md)
            assert all("CONFIG" in (REPO / s).read_text() for s in scripts), f"{command}: a recipe ignores CONFIG"
    elif program == "kubectl" and command.words[1] in ("apply", "create", "delete") and "-f" in command.words:
        manifest = command.words[command.words.index("-f") + 1]
        page = (REPO / command.where.rsplit(":", 1)[0]).read_text()
        written_on_the_page = f"```yaml\n# {manifest}\n" in page  # a manifest the page itself gives
        assert (REPO / manifest).is_file() or written_on_the_page, f"{command}: no {manifest}"
    elif program == "docker" and "-f" in command.words:
        dockerfile = command.words[command.words.index("-f") + 1]
        assert (REPO / dockerfile).is_file(), f"{command}: no {dockerfile}"
    elif program == "bash":
        assert (REPO / command.words[1]).is_file(), f"{command}: no {command.words[1]}"


def quick_start() -> tuple[Command, str]:
    """The README's first `make train` command, and its Quick start section."""
    section = README.read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    first = next(c for c in COMMANDS if c.where.startswith("README.md") and c.words[:2] == ("make", "train"))
    return first, section


# ---------------------------------------------------------------- links, the map, the length

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def links() -> list[tuple[Path, str]]:
    found = []
    for path in DOC_FILES:
        text = FENCE.sub("", path.read_text())
        text = re.sub(r"`[^`\n]*`", "", text)
        found += [(path, target) for target in LINK.findall(text) if not re.match(r"^[a-z]+:", target)]
    return found


@pytest.mark.parametrize("path,target", links(), ids=lambda x: x if isinstance(x, str) else x.name)
def test_relative_links_resolve(path: Path, target: str):
    file, _, anchor = target.partition("#")
    resolved = (path.parent / file).resolve() if file else path
    assert resolved.exists(), f"{path.relative_to(REPO)}: link to {target}: no such file"
    if anchor and resolved.suffix == ".md":
        assert anchor in anchors(resolved), f"{path.relative_to(REPO)}: link to {target}: no such heading"


def test_the_readme_maps_every_docs_page():
    readme = README.read_text()
    missing = [p.name for p in sorted((REPO / "docs").glob("*.md")) if f"](docs/{p.name})" not in readme]
    assert not missing, f"README.md's documentation map lacks {missing}"


def test_the_readme_stays_a_front_page():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move the detail to a docs/ page"
