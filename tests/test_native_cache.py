"""Native code compiled on first use: a cached binary that no longer matches what was built (truncated,
emptied, altered, or built before sizes and hashes were recorded) is compiled again, never loaded."""

import ctypes
import os
import shutil
import subprocess
import sys

import pytest

from npumoe.core.base.native import SIDECAR, cached_build, verified

pytestmark = pytest.mark.skipif(not shutil.which("cc"), reason="needs a C compiler")


def damages(out, good: bytes):
    """Each way a cache file goes bad, as a function that does it."""
    return {
        "truncated": lambda: out.write_bytes(good[: len(good) // 2]),
        "empty": lambda: out.write_bytes(b""),
        "altered": lambda: out.write_bytes(good[:-1] + bytes([good[-1] ^ 1])),
        "unrecorded": lambda: out.with_name(out.name + SIDECAR).unlink(),
    }


def test_a_damaged_cached_library_is_compiled_again(tmp_path):
    (tmp_path / "f.c").write_text("int f(void) { return 7; }\n")
    out, cmd = tmp_path / "libf.so", ["cc", "-shared", "-fPIC", str(tmp_path / "f.c")]
    good = cached_build(cmd, out, "a test library").read_bytes()
    for name, damage in damages(out, good).items():
        damage()
        assert not verified(out), name
        assert verified(cached_build(cmd, out, "a test library")), name
    assert ctypes.CDLL(str(out)).f() == 7


GEMV = """
import numpy as np
from npumoe.luts import build, kernels, layout, spec
tiled = layout.to_tiles(spec.quantize_pack(np.ones((16, 64), np.float32), 2, 64, False))
print(kernels.kernels().gemv(tiled, np.ones((1, 64), np.float32)).shape, build.python_calls() is not None)
"""


def test_truncated_lut_kernels_and_call_module_are_rebuilt_not_loaded(tmp_path):
    """A truncated kernel library or CPython call module used to kill the process with SIGBUS when loaded."""
    env = {**os.environ, "NPUMOE_CACHE_DIR": str(tmp_path), "NPUMOE_LUT_KERNEL": "portable"}  # one library to build
    first = subprocess.run([sys.executable, "-c", GEMV], env=env, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    libraries = sorted((tmp_path / "luts").glob("*.so"))
    assert libraries
    for i, lib in enumerate(libraries):
        lib.write_bytes(b"" if i == 0 else lib.read_bytes()[:4096])
    again = subprocess.run([sys.executable, "-c", GEMV], env=env, capture_output=True, text=True)
    assert again.returncode == 0 and again.stdout == first.stdout, again.stderr
    assert all(verified(lib) for lib in libraries)


SHIM = "from npumoe.backends.qualcomm_htp.shim import qnn_sdk_root; print(qnn_sdk_root())"


def test_a_truncated_qnn_shim_is_rebuilt(tmp_path):
    pytest.importorskip("onnxruntime_qnn")
    env = {**os.environ, "NPUMOE_CACHE_DIR": str(tmp_path)}
    env.pop("QNN_SDK_ROOT", None)
    first = subprocess.run([sys.executable, "-c", SHIM], env=env, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    (shim,) = (tmp_path / "qnn_shim").rglob("libQnnHtp.so")
    shim.write_bytes(shim.read_bytes()[:1000])
    again = subprocess.run([sys.executable, "-c", SHIM], env=env, capture_output=True, text=True)
    assert again.returncode == 0 and again.stdout == first.stdout and verified(shim), again.stderr
