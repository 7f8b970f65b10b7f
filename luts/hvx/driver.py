"""Run the HVX kernels under qemu-hexagon: requests on stdin, raw arrays back on stdout.

The request format is written out in ``harness.c``. :func:`gemv` returns everything the
tests compare with the spec — the tables in the spec's order, the int32 accumulators
A[n, g] from the HVX kernel (and, on request, from the scalar C model in the same
binary) and y after finalize.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

import numpy as np

from npumoe.core.base.errors import BackendUnavailableError, InputError
from npumoe.luts.hvx import build, layout

QEMU = ("qemu-hexagon-static", "-cpu", "v67")
TOOLS = {"clang-16": "clang-16", "ld.lld-16": "lld-16", "qemu-hexagon-static": "qemu-user-static"}
OP_PROBE, OP_GEMV = 1, 2


def missing() -> str | None:
    """Why the HVX kernels cannot run here (one line naming the apt packages), or None."""
    absent = [tool for tool in TOOLS if not shutil.which(tool)]
    if absent:
        return f"{' and '.join(absent)} not found: apt-get install {' '.join(sorted(set(TOOLS.values())))}"
    return None


def _run(header: tuple[int, ...], *arrays: np.ndarray) -> bytes:
    reason = missing()
    if reason:
        raise BackendUnavailableError(f"cannot run the HVX kernels: {reason}.")
    request = np.asarray([*header, *[0] * (8 - len(header))], "<i4").tobytes()
    request += b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)
    result = subprocess.run([*QEMU, str(build.harness())], input=request, capture_output=True, check=False)
    if result.returncode:
        raise BackendUnavailableError(f"the emulated HVX harness failed (exit {result.returncode}): "
                                      f"{result.stderr.decode(errors='replace').strip()}")
    return result.stdout


def probe(indices: np.ndarray, table: np.ndarray, rt: int) -> np.ndarray:
    """One ``vlut16(indices.b, table.h, rt):nomatch``: the output pair as int16 [2, 64] (low, high)."""
    out = _run((OP_PROBE, rt), np.asarray(indices, np.uint8), np.asarray(table, "<i2"))
    return np.frombuffer(out, "<i2").reshape(2, 64)


@dataclass(frozen=True)
class GemvResult:
    tables: np.ndarray  # int16 [K/4, 16], spec order
    t_scales: np.ndarray  # float32 [G]
    xq: np.ndarray  # int32 [G]
    acc: np.ndarray  # int32 [N, G], from the HVX kernel
    reference_acc: np.ndarray | None  # int32 [N, G], from the scalar C model
    y: np.ndarray  # float32 [N]


def gemv(w: layout.HvxWeight, x: np.ndarray, reference: bool = False) -> GemvResult:
    """y = W x on the emulated Hexagon, with every intermediate the spec defines."""
    n, k = w.shape
    x = np.asarray(x, np.float32)
    if x.shape != (k,):
        raise InputError(f"activations have shape {list(x.shape)} but the weight takes {k} inputs.")
    out = _run((OP_GEMV, w.row_blocks, k, w.bits, w.group, int(reference)), x, w.tiles, w.scales, w.zeros)
    sizes = {"tables": (k // 16 * 128, "<i2"), "t_scales": (w.groups * 4, "<f4"), "xq": (w.groups * 4, "<i4"),
             "acc": (w.scales.size * 4, "<i4"), "reference_acc": (w.scales.size * 4 * reference, "<i4"),
             "y": (w.row_blocks * layout.ROWS * 4, "<f4")}
    arrays, offset = {}, 0
    for name, (nbytes, dtype) in sizes.items():
        arrays[name] = np.frombuffer(out, dtype, nbytes // np.dtype(dtype).itemsize, offset)
        offset += nbytes
    if offset != len(out):
        raise BackendUnavailableError(f"the emulated HVX harness answered {len(out)} bytes, expected {offset}.")
    return GemvResult(layout.spec_tables(arrays["tables"]), arrays["t_scales"], arrays["xq"],
                      layout.accumulators(arrays["acc"], w),
                      layout.accumulators(arrays["reference_acc"], w) if reference else None, arrays["y"][:n])
