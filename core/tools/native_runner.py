"""npumoe-run, the native runner of exported programs: its C++ source (``npumoe_run/``) compiled once per machine
against the executorch wheel's headers and libraries, and cached like the LUT kernels (:mod:`npumoe.core.base.native`).

The binary carries the npumoe version and the export target it runs, so a program exported by another version or for
another target is refused. It links the wheel's runtime, its optimized kernels and the target's backend libraries
with ``--no-as-needed`` (kernels and backends register from static initialisers, which the linker would otherwise drop
as unused) and finds them through an rpath to the wheel's ``lib``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from npumoe.core.base.errors import BackendUnavailableError
from npumoe.core.base.native import cache_dir, cached_build, find_compiler
from npumoe.core.ir.backend import RunnerSetup
from npumoe.luts import build, kernels

SOURCE = Path(__file__).parent / "npumoe_run" / "npumoe_run.cpp"
LUT_OPS = SOURCE.with_name("lut_ops.cpp")  # npumoe's LUT kernels as ExecuTorch kernels, linked with luts/csrc
RUNTIME_LIBRARIES = ("executorch", "executorch_kernels_optimized")
INSTALL_EXECUTORCH = "pip install executorch==1.5.1"


def npumoe_version() -> str:
    return version("npumoe")


def executorch_root() -> Path:
    """The executorch wheel's directory, checked to hold the C++ runtime (headers and shared libraries)."""
    spec = importlib.util.find_spec("executorch")
    if spec is None or not spec.submodule_search_locations:
        raise BackendUnavailableError(f"npumoe export needs the executorch wheel; install it with "
                                      f"{INSTALL_EXECUTORCH}.")
    root = Path(next(iter(spec.submodule_search_locations)))
    for part in ("include/executorch/extension/module/module.h", "lib/libexecutorch.so"):
        if not (root / part).exists():
            raise BackendUnavailableError(f"the executorch package at {root} has no C++ runtime ({part} is missing); "
                                          f"install the wheel with {INSTALL_EXECUTORCH}.")
    return root


def compiler() -> tuple[str, ...]:
    """``$CXX``, else the first of c++, g++ and clang++ on the path."""
    return find_compiler("CXX", ("c++", "g++", "clang++"), "npumoe export compiles its native runner with a C++17 "
                         "compiler and found none; install one (Debian: apt-get install g++) or set CXX.")


def _executorch_version() -> str:
    try:
        return version("executorch")
    except PackageNotFoundError:  # (a source checkout on the path)
        return "unknown"


def _compiler_version(cxx: tuple[str, ...]) -> str:
    try:
        return subprocess.run([*cxx, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        raise BackendUnavailableError(f"the C++ compiler {' '.join(cxx)!r} does not run ({err}); install g++ or "
                                      "clang++, or point CXX at a working compiler.") from err


def _quoted(text: str) -> str:
    """``text`` as a C string literal in a -D flag (the compiler runs without a shell)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def runner(target: str, libraries: tuple[str, ...], setup: RunnerSetup = RunnerSetup(), elsewhere: str = "") -> Path:
    """The runner for programs exported for ``target``, linking its backend ``libraries`` and doing ``setup`` before it
    loads a program (a delegate it lacks: one line naming ``elsewhere``, where the program runs); compiled now if this
    machine has no verified build of this source, npumoe, executorch, compiler and setup."""
    root, cxx = executorch_root(), compiler()
    flags = ["-std=c++17", "-O2", "-Wno-deprecated-declarations", f"-I{root / 'include'}",
             f"-I{root / 'include/executorch/runtime/core/portable_type/c10'}", "-DC10_USING_CUSTOM_GENERATED_MACROS",
             f'-DNPUMOE_VERSION="{npumoe_version()}"', f'-DNPUMOE_TARGET="{target}"',
             f"-DNPUMOE_SETENV={_quoted(chr(10).join(f'{k}={v}' for k, v in setup.env.items()))}",
             f"-DNPUMOE_PRELOAD={_quoted(chr(10).join(setup.preload))}",
             f"-DNPUMOE_ELSEWHERE={_quoted(elsewhere)}"]
    lut_object = build.runner_object(kernels.kernels().isa)
    links = [f"-L{root / 'lib'}", "-Wl,--no-as-needed", *(f"-l{lib}" for lib in (*RUNTIME_LIBRARIES, *libraries)),
             "-Wl,--as-needed", "-ldl", "-lm", "-pthread", f"-Wl,-rpath,{root / 'lib'}"]
    key = hashlib.sha256("\0".join([_compiler_version(cxx), _executorch_version(), *flags, *links]).encode()
                         + SOURCE.read_bytes() + LUT_OPS.read_bytes() + lut_object.read_bytes()).hexdigest()[:16]
    out = cache_dir("runner") / f"npumoe-run-{target}-{key}"
    return cached_build([*cxx, *flags, str(SOURCE), str(LUT_OPS), str(lut_object), *links], out,
                        "the native runner npumoe-run")
