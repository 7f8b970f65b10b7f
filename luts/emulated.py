"""Another architecture's kernels under qemu-user: how the NEON build is checked on x86.

The kernels are cross-compiled, with ``csrc/driver.c`` as a front end, into a static
executable (:func:`npumoe.luts.build.emulated_driver`) and run as
``qemu-aarch64-static driver REQUEST RESPONSE``; :class:`EmulatedCalls` has the same
methods as :class:`npumoe.luts.kernels.NativeCalls`, so the same :class:`LutKernels`
front end and the same tests drive it.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from npumoe.core.base.errors import BackendUnavailableError
from npumoe.luts import build
from npumoe.luts.kernels import LutKernels

ARCH = {"neon": "aarch64"}
QEMU = {"aarch64": "qemu-aarch64-static"}
PACKAGES = {"aarch64": ("gcc-aarch64-linux-gnu", "qemu-user-static")}
OPS = {"tables": 1, "gemv": 2, "dequantize": 3, "gemm": 4, "bf16_gemv": 5, "bf16_gemm": 6, "gemm_i8": 7}
DECLINED = 3  # the driver's exit status where the build or the emulated CPU has no kernel for the op


def missing(isa: str) -> str | None:
    """Why ``isa`` cannot be emulated here (one line naming the apt packages), or None."""
    arch = ARCH[isa]
    tools = (build.CROSS_COMPILERS[arch], QEMU[arch])
    absent = [tool for tool in tools if not shutil.which(tool)]
    if absent:
        return f"{' and '.join(absent)} not found: apt-get install {' '.join(PACKAGES[arch])}"
    return None


def emulated_kernels(isa: str = "neon") -> LutKernels:
    reason = missing(isa)
    if reason:
        raise BackendUnavailableError(f"cannot emulate the {isa} kernels: {reason}.")
    return LutKernels(isa, EmulatedCalls(ARCH[isa], build.emulated_driver(ARCH[isa], isa)))


class EmulatedCalls:
    def __init__(self, arch: str, driver: Path):
        self.command = (QEMU[arch], str(driver))

    def _run(self, op: str, header: tuple[int, ...], inputs: list, outputs: list) -> bool:
        """Run ``op``, filling ``outputs``; False where the driver declines it (DECLINED)."""
        with tempfile.TemporaryDirectory() as tmp:
            request, response = Path(tmp) / "request", Path(tmp) / "response"
            with open(request, "wb") as f:
                f.write(np.asarray([OPS[op], *header], dtype="<i4").tobytes())
                for a in inputs:
                    f.write(np.ascontiguousarray(a).tobytes())
            result = subprocess.run([*self.command, str(request), str(response)], capture_output=True, text=True)
            if result.returncode == DECLINED:
                return False
            if result.returncode:
                raise RuntimeError(f"emulated {op} failed: {result.stderr.strip()}")
            data = response.read_bytes()
        offset = 0
        for out in outputs:
            out.reshape(-1).view(np.uint8)[:] = np.frombuffer(data, np.uint8, out.nbytes, offset)
            offset += out.nbytes
        return True

    @staticmethod
    def _weight(w, m: int, table_bits: int = 8) -> tuple[tuple[int, ...], list]:
        w.check()
        header = (m, w.row_blocks, w.shape[1], w.bits, w.group, table_bits, int(w.zeros is not None))
        return header, [w.tiles, w.scales] + ([] if w.zeros is None else [w.zeros])

    def tables(self, x, group, table_bits, tq, t_scales, xq):
        self._run("tables", (1, 0, x.shape[0], 0, group, table_bits, 0), [x], [tq, t_scales, xq])

    def gemv_if_fits(self, w, x, y, table_bits, threads) -> bool:
        return False  # every call goes through the checked path

    def gemv(self, w, x, rows, table_bits, y, acc, threads):
        header, arrays = self._weight(w, rows, table_bits)
        acc = np.empty((*y.shape, w.groups), np.int32) if acc is None else acc
        self._run("gemv", header, [x, *arrays], [y, acc])

    def dequantize(self, w, out, threads):
        header, arrays = self._weight(w, 0)
        self._run("dequantize", header, arrays, [out])

    def gemm(self, w, x, y, threads):
        header, arrays = self._weight(w, x.shape[0])
        self._run("gemm", header, [x, *arrays], [y])

    def gemm_i8(self, w, x, y, threads) -> bool:
        header, arrays = self._weight(w, x.shape[0])
        return self._run("gemm_i8", header, [x, *arrays], [y])

    def bf16_gemv(self, w, x, y, threads):
        self._run("bf16_gemv", (x.shape[0], w.shape[0], w.shape[1], 0, 0, 0, 0), [x, w], [y])

    def bf16_gemm(self, w, x, y, threads):
        self._run("bf16_gemm", (x.shape[0], w.shape[0], w.shape[1], 0, 0, 0, 0), [x, w], [y])
