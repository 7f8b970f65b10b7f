"""Compile the C kernels on first use and cache the shared library per instruction set.

A fresh ``pip install`` ships only the sources (``csrc/``); the first call compiles them
with the system C compiler (``$CC``, else cc, gcc or clang) into the user cache
(``$NPUMOE_CACHE_DIR``, else ``$XDG_CACHE_HOME/npumoe``, else ``~/.cache/npumoe``). The
file name carries a hash of the sources, flags and compiler version, so an upgrade or a
different compiler builds afresh, and the library is written under a temporary name and
renamed, so concurrent first uses never load a half-written file; a cached library whose size or
sha256 no longer matches what was built (a truncated cache) is compiled again rather than loaded
(:func:`npumoe.core.base.native.cached_build`). The optional CPython call
module (``csrc/pycall.c``) is built the same way, against this Python's headers.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import platform
import shutil
import subprocess
import sysconfig
from pathlib import Path

from npumoe.core.base.errors import BackendUnavailableError
from npumoe.core.base.native import cache_dir as native_cache_dir
from npumoe.core.base.native import cached_build, find_compiler

CSRC = Path(__file__).parent / "csrc"
COMMON_SOURCES = ("api.c", "pool.c", "portable.c", "bf16.c", "bf16_dot.c", "decode.c")
# -ffp-contract=off: tables must be built with exactly the spec's fp32 operations (no fused multiply-add).
COMMON_FLAGS = ("-O3", "-std=c11", "-pthread", "-ffp-contract=off", "-fvisibility=hidden", "-Wall")
ISAS = {
    "portable": ((), ()),
    "avx2": (("avx2.c",), ("-mavx2", "-mfma", "-mf16c")),
    "avx512": (("avx512.c",), ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                               "-mavx512vbmi", "-mavx512vnni")),
    "neon": (("neon.c",), ()),  # NEON is part of the AArch64 baseline
}
CROSS_COMPILERS = {"aarch64": "aarch64-linux-gnu-gcc"}


def cache_dir() -> Path:
    return native_cache_dir("luts")


@functools.cache
def compiler() -> tuple[str, ...]:
    return find_compiler("CC", ("cc", "gcc", "clang"), "no C compiler found for the LUT kernels; install gcc or "
                         "clang (Debian: apt-get install gcc) or set CC.")


@functools.cache
def _compiler_version(cc: tuple[str, ...]) -> str:
    try:
        return subprocess.run([*cc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        raise BackendUnavailableError(f"the C compiler {' '.join(cc)!r} does not run ({err}); install gcc or "
                                      "clang, or point CC at a working compiler.") from err


def _sources(isa: str, extra: tuple[str, ...] = ()) -> list[Path]:
    return [CSRC / name for name in (*COMMON_SOURCES, *ISAS[isa][0], *extra)]


def _key(cc, sources, flags) -> str:
    h = hashlib.sha256(_compiler_version(cc).encode())
    h.update(" ".join(flags).encode())
    for path in sorted({*sources, *CSRC.glob("*.h")}):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def _compile(cc, sources, flags, out: Path) -> Path:
    return cached_build([*cc, *flags, *map(str, sources), "-lm"], out, "the LUT kernels")


def library(isa: str) -> Path:
    """The cached shared library for ``isa``, compiled now if needed."""
    cc = compiler()
    flags = (*COMMON_FLAGS, "-fPIC", "-shared", f"-DNPUMOE_ISA_{isa.upper()}", *ISAS[isa][1])
    sources = _sources(isa)
    suffix = ".dll" if platform.system() == "Windows" else ".so"
    return _compile(cc, sources, flags, cache_dir() / f"lut-{isa}-{_key(cc, sources, flags)}{suffix}")


def runner_object(isa: str) -> Path:
    """The kernels for ``isa`` as one relocatable object, linked into a native program (npumoe-run's custom ops)."""
    cc = compiler()
    flags = (*COMMON_FLAGS, "-r", "-nostdlib", f"-DNPUMOE_ISA_{isa.upper()}", *ISAS[isa][1])
    sources = _sources(isa)
    return cached_build([*cc, *flags, *map(str, sources)], cache_dir() / f"lut-{isa}-{_key(cc, sources, flags)}.o",
                        "the LUT kernels")


@functools.cache
def python_calls():
    """The compiled ``_lutcall`` module (csrc/pycall.c) behind LutKernels' GEMV calls, or None when this
    Python has no headers to build it against or the build fails: the ctypes path then serves."""
    include = sysconfig.get_paths().get("include")
    if not include or not (Path(include) / "Python.h").exists():
        return None
    flags = (*COMMON_FLAGS, "-fPIC", "-shared", f"-I{include}", f"-I{CSRC}")
    sources = [CSRC / "pycall.c"]
    try:
        cc = compiler()
        path = _compile(cc, sources, flags, cache_dir() / f"lutcall-{_key(cc, sources, flags)}"
                        f"{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}")
    except BackendUnavailableError:
        return None
    spec = importlib.util.spec_from_file_location("_lutcall", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def emulated_driver(arch: str, isa: str) -> Path:
    """A static executable of ``csrc/driver.c`` for another architecture (run it under qemu-user)."""
    cc = (CROSS_COMPILERS[arch],)
    if not shutil.which(cc[0]):
        raise BackendUnavailableError(f"{cc[0]} is not installed; apt-get install gcc-{arch}-linux-gnu.")
    flags = (*COMMON_FLAGS, "-static", f"-DNPUMOE_ISA_{isa.upper()}", *ISAS[isa][1])
    sources = _sources(isa, ("driver.c",))
    return _compile(cc, sources, flags, cache_dir() / f"driver-{arch}-{isa}-{_key(cc, sources, flags)}")
