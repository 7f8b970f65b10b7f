"""README.md's quick starts run as written: every fenced block after a ``<!-- readme-check -->`` marker, in order, in
one fresh directory holding the README they calibrate on; shell lines through the installed CLI, Python blocks
through the interpreter. A README command that breaks fails here, before a newcomer types it."""

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
README = ROOT / "README.md"
MARKER = "<!-- readme-check -->"
CHECKED_BLOCK = re.compile(re.escape(MARKER) + r"\n```(\w+)\n(.*?)\n```", re.S)


def checked_blocks() -> list[tuple[str, str]]:
    """(language, code) of each block a marker introduces; a marker not directly followed by a block fails."""
    text = README.read_text(encoding="utf-8")
    blocks = CHECKED_BLOCK.findall(text)
    assert len(blocks) == text.count(MARKER), f"each {MARKER} must be followed directly by a fenced code block"
    return blocks


def npumoe_commands(code: str) -> list[list[str]]:
    """A shell block's command lines as argument lists, comments dropped; each must be an npumoe command."""
    commands = [argv for line in code.splitlines() if (argv := shlex.split(line, comments=True))]
    for argv in commands:
        assert argv[0] == "npumoe", f"a checked shell block holds npumoe commands only, not: {shlex.join(argv)}"
    return commands


def run(argv: list[str], cwd: Path, what: str) -> None:
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"README {what} exited {done.returncode}:\n{done.stderr[-3000:]}"


def test_the_readme_checks_a_cli_and_a_python_quick_start():
    languages = [language for language, _ in checked_blocks()]
    assert "bash" in languages and "python" in languages, languages


@pytest.mark.parametrize("marker, script", [("demo-command", "ci/demo.sh"), ("test-command", "ci/test.sh")])
def test_the_two_commands_follow_their_markers(marker, script):
    """.ci/run executes the 4-space-indented line after ``<!-- test-command -->``: keep both in that form."""
    lines = README.read_text(encoding="utf-8").splitlines()
    assert lines[lines.index(f"<!-- {marker} -->") + 1] == f"    bash {script}"
    assert (ROOT / script).is_file()


@pytest.mark.slow
def test_the_quick_starts_run_as_written(tmp_path):
    shutil.copy(README, tmp_path / README.name)
    for language, code in checked_blocks():
        if language == "python":
            run([sys.executable, "-c", code], tmp_path, "Python quick start")
            continue
        assert language == "bash", f"a checked block in {language}: the test runs bash and python blocks only"
        for argv in npumoe_commands(code):
            run([sys.executable, "-m", "npumoe.cli", *argv[1:]], tmp_path, f"command `{shlex.join(argv)}`")
