"""Which loops and conditionals XLA:GPU decides on the host, read from its thunk sequence.

XLA:GPU runs a compiled program as a sequence of thunks. A ``while`` whose trip count it cannot
prove and every ``conditional`` that stands as a thunk of its own is decided on the host: it
copies the condition or predicate to host memory and waits for the stream each time. Inside a
command buffer (a CUDA graph; ``--xla_gpu_enable_command_buffer`` with ``WHILE`` and
``CONDITIONAL``) a conditional node decides on the device instead. XLA writes the sequence, after
its command-buffer conversion, to ``<module>.thunk_sequence_after_thunk_passes.txt`` under
``--xla_dump_to`` (``<module>.thunk_sequence.txt`` when no pass changed it), and each thunk's HLO
instruction to ``<module>.thunk_metadata.txt``.

A thunk line reads ``<indent><id>: <kind> [...]``; a thunk nested in another (a command buffer's
commands, a loop's body, a conditional's branches) is indented below it. Lines naming a nested
sequence (``condition:``, ``body:``, ``false_branch:``, ...) carry no thunk.
"""

from __future__ import annotations

import re
from pathlib import Path

_THUNK = re.compile(r"^(\s*)(\d+): (k\w+)")
_METADATA = re.compile(r'profile_annotation: "([^"]*)"\s*thunk_id: (\d+)')
CONTROL_FLOW = ("kWhile", "kConditional")


def host_decided(sequence: str, metadata: str) -> set[str]:
    """HLO instruction names of the ``while`` and ``conditional`` thunks outside every command
    buffer (a loop's trip count may still be known: the caller tells those apart)."""
    names = {int(i): name for name, i in _METADATA.findall(metadata)}
    found, stack = set(), []  # stack: (indent, kind) of the thunks enclosing the current line
    for line in sequence.splitlines():
        m = _THUNK.match(line)
        if not m:
            continue
        indent, thunk_id, kind = len(m.group(1)), int(m.group(2)), m.group(3)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if kind in CONTROL_FLOW and not any(k == "kCommandBuffer" for _, k in stack):
            found.add(names.get(thunk_id, f"thunk {thunk_id}"))
        stack.append((indent, kind))
    return found


def read_dump(folder: Path) -> set[str] | None:
    """``host_decided`` of the one module XLA dumped in ``folder``, None if it wrote no sequence."""
    for suffix in ("thunk_sequence_after_thunk_passes.txt", "thunk_sequence.txt"):
        sequences = sorted(folder.glob(f"*.{suffix}"))
        if sequences:
            metadata = sequences[-1].with_name(sequences[-1].name.replace(suffix, "thunk_metadata.txt"))
            return host_decided(sequences[-1].read_text(), metadata.read_text() if metadata.exists() else "")
    return None
