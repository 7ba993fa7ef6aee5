"""The images install exactly the locked versions, the locks agree with the requirement files, and
the CPU image runs what the README runs.

No Docker engine is needed here (``tests/docker/`` builds and runs the images): the Dockerfiles are
read as text. Every ``pip install`` in them may only name lock files (``-r``, with
``--require-hashes``), never a package, so the requirement files stay the one source of versions
and the locks (``make lock``) the one source of what is installed; the files they name are the
repository's (``COPY``'d into the image). Every lock entry pins one version with its hashes, and
every version a requirement file pins is the one its lock holds.
"""

import json
import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCKERFILES = sorted((REPO / "docker").glob("Dockerfile.*"))
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


LOCKS = {  # lock -> the requirement files it is compiled from (the Makefile's `lock` target)
    "requirements.lock": ["requirements.txt"],
    "requirements-test.lock": ["requirements.txt", "requirements-test.txt"],
    "requirements-gpu.lock": ["requirements-gpu.txt", "docker/requirements-te-build.txt"],
    "docker/requirements-gpu-pass1.lock": ["requirements-gpu.txt", "docker/requirements-te-build.txt"],
}
PASS1_LEAVES_OUT = "transformer-engine-jax"  # compiled in the GPU image's second pass


def requirement_lines(path: Path) -> list[str]:
    """The requirement specifiers a file installs, following ``-r`` includes (relative to the file)."""
    specs = []
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if not line:
            continue
        if line.startswith("-r "):
            specs += requirement_lines(path.parent / line[3:].strip())
        else:
            specs.append(line)
    return specs


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_entries(path: Path) -> dict[str, tuple[str, int]]:
    """Package -> (pinned version, number of hashes) of a lock written by ``uv pip compile``."""
    entries: dict[str, tuple[str, int]] = {}
    name = None
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.startswith("--hash=sha256:"):
            version, hashes = entries[name]
            entries[name] = (version, hashes + 1)
            continue
        spec = stripped.rstrip("\\").split(";")[0].strip()
        match = PIN.match(spec)
        assert match, f"{path.name}: {stripped!r} does not pin one version"
        name, version = spec.split("==")
        entries[normalized(name.split("[")[0])] = (version, 0)
    return entries


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


def pip_installs(dockerfile: Path) -> list[list[Path]]:
    """The repository files each ``pip install`` of the file installs, checking that it names only
    copied lock files and requires their hashes."""
    copies = copied_files(dockerfile)
    installs = []
    for name, args in instructions(dockerfile):
        if name != "RUN":
            continue
        for words in shell_commands(args):
            if "pip" not in words or "install" not in words:
                continue
            options = words[words.index("install") + 1 :]
            files = [options[i + 1] for i, w in enumerate(options) if w == "-r"]
            packages = [w for w in options if not w.startswith("-") and w not in files]
            assert not packages, f"{dockerfile.name}: pip install names {packages}, not a lock file"
            assert "--require-hashes" in options, f"{dockerfile.name}: pip install without --require-hashes"
            sources = [copies.get(file) for file in files]
            assert None not in sources, f"{dockerfile.name}: {files} not all copied from the repository"
            assert all(p.suffix == ".lock" for p in sources), f"{dockerfile.name}: {files} are not lock files"
            installs.append(sources)
    return installs


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_images_install_only_locks_with_hashes(dockerfile):
    installs = pip_installs(dockerfile)
    assert installs, f"{dockerfile.name} installs nothing with pip"
    for files in installs:
        for lock in files:
            assert all(hashes for _, hashes in lock_entries(lock).values()), f"{lock.name}: an entry has no hash"


def test_the_images_install_their_locks():
    """The CPU image: the runtime lock, and the test lock in its ``test`` target; the GPU image: the
    lock without Transformer Engine's JAX extension, then the whole lock (which compiles it)."""
    cpu = [p.relative_to(REPO).as_posix() for files in pip_installs(REPO / "docker" / "Dockerfile.cpu") for p in files]
    assert cpu == ["requirements.lock", "requirements-test.lock"]
    gpu = [p.relative_to(REPO).as_posix() for files in pip_installs(REPO / "docker" / "Dockerfile.gpu") for p in files]
    assert gpu == ["docker/requirements-gpu-pass1.lock", "requirements-gpu.lock"]


@pytest.mark.parametrize("lock", sorted(LOCKS), ids=str)
def test_the_locks_agree_with_the_requirement_files(lock):
    """Every version a requirement file pins is the locked one (refresh with `make lock`)."""
    entries = lock_entries(REPO / lock)
    for source in LOCKS[lock]:
        for spec in requirement_lines(REPO / source):
            name, version = spec.split("==")
            name = normalized(name.split("[")[0])
            if lock.endswith("pass1.lock") and name == PASS1_LEAVES_OUT:
                assert name not in entries
                continue
            assert name in entries, f"{lock} lacks {name} ({source})"
            assert entries[name][0] == version, f"{lock} has {name} {entries[name][0]}, {source} pins {version}"
    if lock.endswith("pass1.lock"):
        full = lock_entries(REPO / "requirements-gpu.lock")
        assert entries == {k: v for k, v in full.items() if k != PASS1_LEAVES_OUT}


def test_pip_install_check_rejects_an_inline_version(tmp_path):
    """The check above can fail: a version written into the Dockerfile is refused."""
    dockerfile = tmp_path / "Dockerfile.test"
    dockerfile.write_text('FROM python:3.11-slim\nRUN pip install --require-hashes "pybind11[global]==3.1.0"\n')
    with pytest.raises(AssertionError, match="names"):
        pip_installs(dockerfile)


def test_the_lock_check_rejects_a_version_the_requirements_do_not_pin(tmp_path):
    (tmp_path / "requirements.lock").write_text("numpy==1.0.0 \\\n    --hash=sha256:00\n")
    assert lock_entries(tmp_path / "requirements.lock") == {"numpy": ("1.0.0", 1)}
    pinned = dict(spec.split("==") for spec in requirement_lines(REPO / "requirements.txt"))
    assert pinned["numpy"] != "1.0.0"


def test_cpu_image_runs_the_readme_quick_start():
    """`make train` (the README's quick start) runs the Makefile's train command with empty ARGS;
    the CPU image's CMD is that command, from the repository's root."""
    readme = (REPO / "README.md").read_text()
    assert re.search(r"^\s*make train\b", readme, re.M)
    recipe = re.search(r"^train:.*\n\t(.+)$", (REPO / "Makefile").read_text(), re.M).group(1)
    make_train = [w for w in recipe.replace("$(PY)", "python").split() if w != "$(ARGS)"]
    instrs = instructions(REPO / "docker" / "Dockerfile.cpu")
    (cmd,) = [args for name, args in instrs if name == "CMD"]
    assert json.loads(cmd) == make_train
    workdir = [args for name, args in instrs if name == "WORKDIR"][-1]
    assert ("COPY", f". {workdir}") in instrs
