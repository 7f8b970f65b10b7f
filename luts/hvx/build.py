"""Compile the harness for Hexagon with clang-16, cached by a hash of sources, flags and compiler.

Freestanding (Debian has no Hexagon libc): our own ``_start`` and syscalls (``rt.c``), lld,
no libraries. ``-mcpu=hexagonv73`` is the instruction set of the phones the cost model
describes; the kernel uses only integer HVX from v62 and earlier, which qemu's ``-cpu v67``
model executes (its HVX stops at v66; a v68+ instruction would abort the emulator, so the
emulated tests also guard against the compiler picking one).
"""

from __future__ import annotations

import functools
import hashlib
import shutil
import subprocess
from pathlib import Path

from npumoe.core.base.errors import BackendUnavailableError
from npumoe.core.base.native import cached_build
from npumoe.luts.build import cache_dir

SOURCE_DIR = Path(__file__).parent
SOURCES = ("rt.c", "precompute.c", "linear.c", "reference.c", "finalize.c", "harness.c")
CLANG = "clang-16"
FLAGS = ("--target=hexagon-unknown-linux-musl", "-mcpu=hexagonv73", "-mhvx", "-mhvx-length=128b", "-O2",
         "-ffreestanding", "-nostdlib", "-static", "-fuse-ld=lld", "-std=c11", "-ffp-contract=off", "-Wall",
         "-Wextra", "-Werror")


@functools.cache
def _key() -> str:
    try:
        version = subprocess.run([CLANG, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        raise BackendUnavailableError(f"{CLANG} does not run ({err}); apt-get install clang-16 lld-16.") from err
    h = hashlib.sha256(version.encode() + " ".join(FLAGS).encode())
    for path in sorted([*SOURCE_DIR.glob("*.c"), *SOURCE_DIR.glob("*.h")]):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def harness() -> Path:
    """The cached harness executable, compiled now if needed."""
    if not shutil.which(CLANG):
        raise BackendUnavailableError(f"{CLANG} is not installed; apt-get install clang-16 lld-16.")
    out = cache_dir() / f"hvx-harness-{_key()}"
    return cached_build([CLANG, *FLAGS, *(str(SOURCE_DIR / name) for name in SOURCES)], out, "the HVX harness")
