"""The QNN environment ExecuTorch 1.5.1 needs here: a fake ``QNN_SDK_ROOT`` whose ``libQnnHtp.so`` is
our pass-through shim (:file:`qnn_shim.c`) over onnxruntime-qnn's QNN 2.51 libraries.

Built with the system C compiler on first use and cached under ``~/.cache/npumoe`` by the
source's hash. A user's own matching SDK (``QNN_SDK_ROOT`` already set) is used as is, no shim.
``QNN_SDK_ROOT`` must always be set before ExecuTorch's QNN code runs: without it, it tries
to download an SDK. torch must be imported before ``libQnnSystem.so`` is loaded, and the shim
before onnxruntime-qnn's own ``libQnnHtp.so`` (ORT opens that by absolute path, so with the
shim loaded first both work in one process; the other way round ExecuTorch gets the real one).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
from pathlib import Path

from npumoe.backends.qualcomm_htp.qnn import ort_qnn
from npumoe.core.base.errors import BackendUnavailableError
from npumoe.core.base.native import cache_dir, compile_atomically, verified

SOURCE = Path(__file__).with_name("qnn_shim.c")
LIB_SUBDIR = Path("lib") / "x86_64-linux-clang"
_ready: Path | None = None


def _mapped(library: Path) -> bool:
    """Whether ``library`` is already loaded: ExecuTorch dlopens ``libQnnHtp.so`` by name, and the
    dynamic loader hands back the first loaded object of that soname, so the shim must come first."""
    return any(line.rstrip().endswith(str(library)) for line in Path("/proc/self/maps").read_text().splitlines())


def _real_libs(real_dir: Path) -> list[Path]:
    """The plugin's QNN libraries and the vendored runtime they link (``onnxruntime_qnn.libs``)."""
    return sorted(real_dir.glob("*.so")) + sorted(real_dir.parent.glob("onnxruntime_qnn.libs/*.so*"))


def _build(sdk: Path, real_dir: Path) -> None:
    compiler = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
    if compiler is None:
        raise BackendUnavailableError("--via executorch needs a C compiler to build its QNN shim; install gcc "
                                      "(apt-get install gcc) or set QNN_SDK_ROOT to a QNN 2.37 SDK.")
    lib_dir = sdk / LIB_SUBDIR
    lib_dir.mkdir(parents=True, exist_ok=True)
    for lib in _real_libs(real_dir):
        if lib.name != "libQnnHtp.so" and not (lib_dir / lib.name).exists():
            (lib_dir / lib.name).symlink_to(lib)
    compile_atomically([compiler, "-shared", "-fPIC", "-O2", str(SOURCE), "-ldl", "-Wl,-soname,libQnnHtp.so",
                        "-Wl,-z,nodelete"], lib_dir / "libQnnHtp.so", "the QNN shim for ExecuTorch")


def qnn_sdk_root() -> Path:
    """Set up (once per process) the environment ExecuTorch's QNN backend loads from; return QNN_SDK_ROOT."""
    global _ready
    if _ready is not None:
        return _ready
    if "QNN_SDK_ROOT" in os.environ:  # the user's own SDK, matching ExecuTorch's API
        _ready = Path(os.environ["QNN_SDK_ROOT"])
        return _ready
    import torch  # noqa: F401 - must be loaded before libQnnSystem.so

    ort_qnn()  # onnxruntime must be imported before the plugin's vendored libc++ is loaded globally
    import onnxruntime_qnn

    real_dir = Path(onnxruntime_qnn.get_qnn_htp_path()).parent
    if _mapped(real_dir / "libQnnHtp.so"):
        raise BackendUnavailableError(
            "this process already loaded onnxruntime-qnn's libQnnHtp.so, which would shadow the shim ExecuTorch "
            "needs; run --via executorch in its own process (or call npumoe.backends.qualcomm_htp.shim.qnn_sdk_root() "
            "before any onnxruntime-qnn session)."
        )
    digest = hashlib.sha256(SOURCE.read_bytes() + str(real_dir).encode()).hexdigest()[:16]
    sdk = cache_dir("qnn_shim") / digest
    if not verified(sdk / LIB_SUBDIR / "libQnnHtp.so"):  # a damaged shim is rebuilt, never loaded
        _build(sdk, real_dir)
    os.environ["QNN_SDK_ROOT"] = str(sdk)
    os.environ["QNN_SHIM_REAL_HTP"] = str(real_dir / "libQnnHtp.so")
    os.environ["LD_LIBRARY_PATH"] = f"{sdk / LIB_SUBDIR}:{os.environ.get('LD_LIBRARY_PATH', '')}"
    for vendored in real_dir.parent.glob("onnxruntime_qnn.libs/*.so*"):  # libc++ that libQnnSystem.so links
        ctypes.CDLL(str(vendored), mode=ctypes.RTLD_GLOBAL)
    ctypes.CDLL(str(sdk / LIB_SUBDIR / "libQnnHtp.so"), mode=ctypes.RTLD_GLOBAL)
    ctypes.CDLL(str(sdk / LIB_SUBDIR / "libQnnSystem.so"), mode=ctypes.RTLD_GLOBAL)
    _ready = sdk
    return sdk
