"""Long steps report on stderr, never stdout: a bar on a terminal, a plain line every few seconds on a pipe; library
calls stay quiet unless asked, the CLI asks."""

import os
import pty
import subprocess
import sys
import time

import pytest

from npumoe.cli import main
from npumoe.core.base import progress


@pytest.fixture
def quick(monkeypatch):
    """Steps shown, and plain lines written, within a few hundredths of a second (the defaults: 1 s and 5 s)."""
    monkeypatch.setattr(progress, "SHOW_AFTER", 0.02)
    monkeypatch.setattr(progress, "PLAIN_INTERVAL", 0.05)


def count_slowly(description: str = "counting", n: int = 6, **kwargs) -> list[int]:
    seen = []
    for i in progress.track(range(n), description, "things", **kwargs):
        time.sleep(0.1)
        seen.append(i)
    return seen


def test_a_steps_line_says_what_is_done_how_long_it_took_and_what_is_left(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    step = progress.Task("calibrating", 40, "windows")
    now[0] += 31
    step.advance(12)
    assert step.line() == "calibrating: 12/40 windows, 00:31 elapsed, ~01:12 left"
    unknown = progress.Task("validating htp", None, "")
    now[0] += 3600 + 5
    assert unknown.line() == "validating htp: 1:00:05 elapsed"
    assert progress.Task("quantising", 2.5e3, "MB").status().startswith("0/2,500 MB")


def test_on_a_pipe_a_shown_step_writes_plain_lines_to_stderr_only(quick, capsys):
    items = count_slowly(progress=True)
    out, err = capsys.readouterr()
    assert items == list(range(6)) and out == ""
    lines = err.splitlines()
    assert lines and all(line.startswith("counting: ") and "/6 things, " in line and " elapsed" in line
                         for line in lines), err


@pytest.mark.parametrize("asked, by_default, shown", [(None, False, False), (None, True, True), (False, True, False),
                                                      (True, False, True)])
def test_library_calls_are_quiet_unless_asked_or_the_cli_asks(quick, capsys, asked, by_default, shown):
    if by_default:
        with progress.shown_by_default():
            count_slowly(progress=asked)
    else:
        count_slowly(progress=asked)
    assert bool(capsys.readouterr().err) == shown


def test_nested_steps_report_the_innermost_and_a_note_stays(quick, capsys):
    with progress.task("building", progress=True):
        progress.note("compiling the kernels once", progress=True)
        count_slowly("compiling", progress=True)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "compiling the kernels once"
    assert any(line.startswith("compiling: ") for line in lines[1:]), lines


def test_the_cli_shows_calibrations_progress_on_stderr_and_its_table_on_stdout(quick, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n" * 40)
    main(["calibrate", "--text", str(text), "--chunk", "16", "--out", str(tmp_path / "profile.json")])
    out, err = capsys.readouterr()
    assert "calibrating (chunk 16): " in err and "elapsed" in err
    assert "elapsed" not in out and "wrote" in out
    assert not progress.wanted(None)  # the CLI's choice ends with the command


SCRIPT = """
import time
from npumoe.core.base import progress
progress.SHOW_AFTER = 0.02
with progress.shown_by_default():
    for _ in progress.track(range(8), "counting", "things"):
        time.sleep(0.1)
print("the result")
"""


def test_on_a_terminal_the_bar_goes_to_stderr_and_the_result_to_stdout():
    leader, follower = pty.openpty()
    child = subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, stderr=follower,
                             env={**os.environ, "TERM": "xterm", "COLUMNS": "100"})
    os.close(follower)
    shown = b""
    while True:  # read while it draws (a full terminal buffer would stall it)
        try:
            chunk = os.read(leader, 1 << 16)
        except OSError:  # the child has exited and closed the terminal
            break
        if not chunk:
            break
        shown += chunk
    os.close(leader)
    assert child.stdout.read() == b"the result\n" and child.wait(timeout=120) == 0
    assert b"counting" in shown and b"/8 things" in shown and b"\x1b[" in shown  # drawn in place with escapes
