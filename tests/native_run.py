"""The tests' way to build and call npumoe-run: skip with the reason where this machine cannot compile it, and run
it in an empty environment, so nothing of this Python's reaches it."""

import subprocess
from pathlib import Path

import pytest

from npumoe.core.base.errors import BackendUnavailableError


def skip_without_compiler() -> None:
    """Skip the calling fixture's tests, saying why, where npumoe-run cannot be compiled here."""
    from npumoe.core.tools import native_runner  # needs executorch, which the callers checked for

    try:
        native_runner.compiler()
    except BackendUnavailableError as err:
        pytest.skip(str(err))


def npumoe_run(directory: Path, *args: str) -> subprocess.CompletedProcess:
    """npumoe-run on the directory's program with an empty environment: what the program needs, the runner sets up."""
    return subprocess.run([str(directory / "npumoe-run"), str(directory / "model.pte"), *args], env={},
                          capture_output=True, timeout=600, check=False)
