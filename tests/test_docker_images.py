"""The images install exactly the pinned versions, and the CPU image runs what the README runs.

No Docker engine is needed: the Dockerfiles are read as text. Every ``pip install`` in them may
only name requirement files (``-r``), never a package, so the requirement files stay the one source
of versions; the files they name are the repository's (``COPY``'d into the image), or made in
the same ``RUN`` from one of them by ``grep -v`` (the GPU image's first pass, which leaves
Transformer Engine for a second pass). Following ``-r`` includes, every line those files install
must pin one exact version (``name==version``).
"""

import json
import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCKERFILES = sorted(p for p in (REPO / "docker").glob("Dockerfile.*") if p.suffix != ".dockerignore")
PIN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9_,.-]+\])?==[A-Za-z0-9.+!-]+$")


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines = [line for line in dockerfile.read_text().splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(m[1].upper(), m[2].strip()) for m in re.finditer(r"^\s*([A-Za-z]+)\s+(.*)$", joined, re.M)]


def copied_files(dockerfile: Path) -> dict[str, Path]:
    """Image path -> repository file, for each ``COPY <files...> <folder>/`` from the build context."""
    copies = {}
    for name, args in instructions(dockerfile):
        words = args.split()
        if name != "COPY" or any(w.startswith("--") for w in words) or not words[-1].endswith("/"):
            continue
        for source in words[:-1]:
            copies[words[-1] + Path(source).name] = REPO / source
    return copies


def requirement_lines(path: Path, drop: str | None = None) -> list[str]:
    """The requirement specifiers a file installs, following ``-r`` includes (relative to the file)."""
    specs = []
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if not line or (drop and re.match(drop, line)):
            continue
        if line.startswith("-r "):
            specs += requirement_lines(path.parent / line[3:].strip())
        else:
            specs.append(line)
    return specs


def shell_commands(script: str) -> list[list[str]]:
    """The words of each command of a RUN line, split at ``&&``, ``;`` and ``|`` outside quotes."""
    lexer = shlex.shlex(script, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands, words = [], []
    for token in lexer:
        if token in ("&&", ";", "|", "||"):
            commands.append(words)
            words = []
        else:
            words.append(token)
    return [*commands, words]


def pip_installs(dockerfile: Path) -> list[list[str]]:
    """The requirement specifiers of each ``pip install`` in the file (the files it names, resolved)."""
    copies = copied_files(dockerfile)
    installs = []
    for name, args in instructions(dockerfile):
        if name != "RUN":
            continue
        cwd, derived = "/", {}
        for words in shell_commands(args):
            if words[:1] == ["cd"]:
                cwd = words[1]
            elif words[:2] == ["grep", "-v"]:  # grep -v 'PATTERN' SOURCE > TARGET
                pattern, source, _, target = words[2:6]
                derived[str(Path(cwd, target))] = (copies[str(Path(cwd, source))], pattern)
            elif "pip" in words and "install" in words:
                options = words[words.index("install") + 1 :]
                files = [options[i + 1] for i, w in enumerate(options) if w == "-r"]
                packages = [w for w in options if not w.startswith("-") and w not in files]
                assert not packages, f"{dockerfile.name}: pip install names {packages}, not a requirement file"
                specs = []
                for file in files:
                    path = str(Path(cwd, file))
                    source, drop = derived.get(path, (copies.get(path), None))
                    assert source is not None, f"{dockerfile.name}: {path} is neither copied nor derived"
                    specs += requirement_lines(source, drop)
                installs.append(specs)
    return installs


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_images_install_only_pinned_requirement_files(dockerfile):
    installs = pip_installs(dockerfile)
    assert installs, f"{dockerfile.name} installs nothing with pip"
    for specs in installs:
        assert specs
        unpinned = [s for s in specs if not PIN.match(s)]
        assert not unpinned, f"{dockerfile.name} installs versions that are not pinned: {unpinned}"


def test_the_images_cover_their_requirement_sets():
    """The CPU image: the CPU set and the test set; the GPU image: the GPU set (TE in its own pass)
    and Transformer Engine's build requirements."""
    cpu = {s for specs in pip_installs(REPO / "docker" / "Dockerfile.cpu") for s in specs}
    assert cpu == set(requirement_lines(REPO / "requirements.txt") + requirement_lines(REPO / "requirements-test.txt"))
    gpu_passes = pip_installs(REPO / "docker" / "Dockerfile.gpu")
    gpu = {s for specs in gpu_passes for s in specs}
    expected = requirement_lines(REPO / "requirements-gpu.txt") + requirement_lines(
        REPO / "docker" / "requirements-te-build.txt"
    )
    assert gpu == set(expected)
    first, last = gpu_passes[0], gpu_passes[-1]
    assert not any(s.startswith("transformer-engine") for s in first), "TE compiles after jax is installed"
    assert any(s.startswith("transformer-engine") for s in last)


def test_pip_install_check_rejects_an_inline_version(tmp_path):
    """The check above can fail: a version written into the Dockerfile is refused."""
    dockerfile = tmp_path / "Dockerfile.test"
    dockerfile.write_text('FROM python:3.11-slim\nRUN pip install "pybind11[global]==3.1.0"\n')
    with pytest.raises(AssertionError, match="names"):
        pip_installs(dockerfile)


def test_cpu_image_runs_the_readme_quick_start():
    """`make train` (the README's quick start) runs the Makefile's train command with empty ARGS;
    the CPU image's CMD is that command, from the repository's root."""
    readme = (REPO / "README.md").read_text()
    assert re.search(r"^\s+make train\s", readme, re.M)
    recipe = re.search(r"^train:.*\n\t(.+)$", (REPO / "Makefile").read_text(), re.M).group(1)
    make_train = [w for w in recipe.replace("$(PY)", "python").split() if w != "$(ARGS)"]
    instrs = instructions(REPO / "docker" / "Dockerfile.cpu")
    (cmd,) = [args for name, args in instrs if name == "CMD"]
    assert json.loads(cmd) == make_train
    workdir = [args for name, args in instrs if name == "WORKDIR"][-1]
    assert ("COPY", f". {workdir}") in instrs
