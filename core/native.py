"""Small native helpers compiled on first use: where they are cached, and how they are built.

A cache must never hold a half-written binary (a crash mid-compile would poison every later
run), so every compiler writes to a temporary name beside its target and is renamed into place.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

from npumoe.errors import BackendUnavailableError


def cache_dir(name: str) -> Path:
    """``$NPUMOE_CACHE_DIR/<name>`` (default ``~/.cache/npumoe/<name>``), or a private temp dir when
    home is read-only."""
    if os.environ.get("NPUMOE_CACHE_DIR"):
        root = Path(os.environ["NPUMOE_CACHE_DIR"])
    else:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "npumoe"
    try:
        (root / name).mkdir(parents=True, exist_ok=True)
        return root / name
    except OSError:
        path = Path(tempfile.gettempdir()) / f"npumoe-{os.getuid() if hasattr(os, 'getuid') else 'user'}" / name
        path.mkdir(parents=True, exist_ok=True)
        return path


def compile_atomically(cmd: list[str], out: Path, what: str) -> Path:
    """Run ``cmd -o <temp>`` and rename the result to ``out``; a failure names ``what`` and shows the
    compiler's own message."""
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=out.name + ".", suffix=".tmp")
    os.close(fd)
    try:
        result = subprocess.run([*cmd, "-o", tmp], capture_output=True, text=True)
        if result.returncode:
            raise BackendUnavailableError(f"compiling {what} failed ({' '.join(cmd)}):\n{result.stderr.strip()}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out
