"""Small native helpers compiled on first use: where they are cached, and how they are built.

A cache must never hold a half-written binary (a crash mid-compile would poison every later
run), so every compiler writes to a temporary name beside its target and is renamed into place.
Renaming does not protect against later damage (a full disk, a copied or truncated cache): a
truncated shared library kills the process with SIGBUS when it is loaded, before any message. So
each build records its size and sha256 in a sidecar file, and :func:`cached_build` checks them
before a cached binary is handed to dlopen or import, compiling again on any mismatch.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

from npumoe.core.base.errors import BackendUnavailableError
from npumoe.core.base.io import atomic_write_text, sha256_file
from npumoe.core.base.progress import note, task

SIDECAR = ".sha256"  # "<size> <sha256>" of the binary beside it, written when it was built


def find_compiler(variable: str, names: tuple[str, ...], missing: str) -> tuple[str, ...]:
    """``$variable`` split as a shell would (the user's choice), else the first of ``names`` on the path; none:
    :class:`BackendUnavailableError` with ``missing``, which names the install step."""
    if os.environ.get(variable):
        return tuple(shlex.split(os.environ[variable]))
    for name in names:
        if shutil.which(name):
            return (name,)
    raise BackendUnavailableError(missing)


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
    compiler's own message. The user hears why the first run waits (the CLI; a library call stays quiet)."""
    note(f"compiling {what} for this machine: once, then cached in {out.parent}")
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=out.name + ".", suffix=".tmp")
    os.close(fd)
    try:
        with task(f"compiling {what}"):
            result = subprocess.run([*cmd, "-o", tmp], capture_output=True, text=True)
        if result.returncode:
            raise BackendUnavailableError(f"compiling {what} failed ({' '.join(cmd)}):\n{result.stderr.strip()}")
        os.chmod(tmp, 0o755)
        atomic_write_text(_sidecar(out), f"{os.path.getsize(tmp)} {sha256_file(Path(tmp))}\n")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def cached_build(cmd: list[str], out: Path, what: str) -> Path:
    """``out`` if it holds exactly the bytes recorded when it was built, else compiled (again) with ``cmd``."""
    return out if verified(out) else compile_atomically(cmd, out, what)


def verified(path: Path) -> bool:
    """Whether ``path`` matches its sidecar's size and sha256 (the size first: a truncated file fails unread).
    A binary without a sidecar (built before sidecars, or its build was interrupted) does not verify."""
    try:
        size, digest = _sidecar(path).read_text().split()
        return path.stat().st_size == int(size) and sha256_file(path) == digest
    except (OSError, ValueError):
        return False


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + SIDECAR)


@contextmanager
def native_output_silenced(*fds: int):
    """File descriptors ``fds`` (1: stdout, 2: stderr) go to /dev/null for the block: native libraries that
    print from C (QNN's HTP "# LIBNATIVE" notice, llama.cpp's quantiser) put third-party noise in npumoe's
    output, and a corrupt document after ``--json``. Their errors still arrive as exceptions or return codes."""
    sys.stdout.flush()
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    saved = {fd: os.dup(fd) for fd in fds}
    try:
        for fd in fds:
            os.dup2(devnull, fd)
        yield
    finally:
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)
        os.close(devnull)
