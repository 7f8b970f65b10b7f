"""Faults while writing: a kill at any point, two writers, a full disk, a killed parent of build workers.

Whatever happens, an output is absent, the earlier complete one, or the new complete one, and never half-written
and accepted by the next command (docs/reliability.md).
"""

import itertools
import json
import os

from npumoe.core.base.io import atomic_write_text
from npumoe.core.base.outputs import OutputKind, claim, json_kind, remove_stale_staging, staged_directory

OUTPUT = OutputKind("a test output", directory=True, recognise=lambda path: json_kind("test")(path / "manifest.json"))
FILE_CHANGES = ("rename", "replace", "unlink", "rmdir")  # what a write does to the file system, step by step


def write_output(out, version: int, files: int = 3) -> None:
    """An output of ``files`` files, its manifest written last, as every npumoe directory output is."""
    claim(out, OUTPUT)
    with staged_directory(out) as staging:
        for i in range(files):
            (staging / f"part{i}.bin").write_bytes(bytes([version]) * 1000)
        atomic_write_text(staging / "manifest.json", json.dumps({"kind": "test", "version": version}))


def contents(out) -> dict:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())} if out.exists() else {}


def killed_at(step: int, write) -> bool:
    """Run ``write()`` in a forked child that dies at its ``step``-th file-system change (os._exit: no handler,
    no cleanup, as SIGKILL); whether it was killed before finishing."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        count = [0]

        def dying(real):
            def change(*args, **kwargs):
                count[0] += 1
                if count[0] == step:
                    os._exit(9)
                return real(*args, **kwargs)
            return change

        for name in FILE_CHANGES:
            setattr(os, name, dying(getattr(os, name)))
        try:
            write()
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 9


def test_a_kill_at_any_step_of_a_replace_leaves_the_old_or_the_new_output_whole(tmp_path):
    """Killed at each rename and unlink of replacing an earlier output, the next run finds the earlier output or
    the new one, complete (never nothing, never a mix), and its own write then lands whole with no leftovers."""
    write_output(tmp_path / "reference", 2)
    new = contents(tmp_path / "reference")
    (tmp_path / "work").mkdir()
    out = tmp_path / "work" / "out"
    write_output(out, 1)
    old = contents(out)
    seen = []
    for step in itertools.count(1):
        if not killed_at(step, lambda: write_output(out, 2)):
            break
        remove_stale_staging(out)  # what the next run's claim does first
        found = contents(out)
        assert found in (old, new), f"killed at step {step}, the next run finds {sorted(found) or 'no output'}"
        seen.append("old" if found == old else "new")
        write_output(out, 1)
        assert os.listdir(out.parent) == ["out"] and contents(out) == old
    assert "old" in seen[1:] and "new" in seen, f"the kills never fell between the swap's renames: {seen}"
    assert contents(out) == new
