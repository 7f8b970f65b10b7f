"""The measurements behind `npumoe bench hvx`: the HVX kernel's instruction counts for a 4096×4096 GEMV, the cost
model's estimate from them (see :mod:`.cost`), T-MAN's reported figures beside it, and a
bit-exactness check: each format's kernel runs once under qemu-hexagon against the spec.
"""

from __future__ import annotations

import numpy as np

from npumoe.core.base.errors import BackendUnavailableError
from npumoe.luts import spec
from npumoe.luts.hvx import build, cost, driver, layout

FORMATS = {"int4": 4, "int2": 2}
COUNTED = ("vlut16", "widening_add", "plane_combine", "shift", "vector_load", "vector_store", "other_hvx", "scalar",
           "packets")


def bit_exact(n: int, k: int, bits: int, group: int) -> bool:
    """One emulated GEMV: tables, table scales, Σx and every int32 accumulator equal to the spec."""
    rng = np.random.default_rng(bits)
    packed = spec.quantize_pack(rng.standard_normal((n, k), dtype=np.float32), bits, group)
    x = rng.standard_normal(k, dtype=np.float32)
    result = driver.gemv(layout.repack(packed), x)
    tq, t_scales = spec.quantize_tables(spec.build_tables(x), group, 16)
    return (np.array_equal(result.tables, tq) and np.array_equal(result.t_scales, t_scales)
            and np.array_equal(result.xq, spec.table_sums(tq, group))
            and np.array_equal(result.acc, spec.lut_accumulate(packed.planes, tq, group)))


def run(n: int, k: int, group: int) -> dict:
    reason = driver.missing()
    if reason:
        raise BackendUnavailableError(f"cannot build and emulate the HVX kernel: {reason}.")
    binary = build.harness()
    result = {"shape": [n, k], "group": group, "estimate_is_a_model": True, "tman_reported": cost.TMAN_REPORTED,
              "assumptions": {d.name: {"hvx_threads": d.hvx_threads, "clock_ghz": d.clock_ghz} for d in cost.DEVICES}}
    for name, bits in FORMATS.items():
        counts = cost.gemv_counts(binary, n, k, bits, group)
        result[name] = {"bit_exact": bit_exact(n, k, bits, group), "counts": counts,
                        "weight_bytes": cost.weight_bytes(n, k, bits, group),
                        "estimate": [cost.estimate(counts, n, k, bits, group, d) for d in cost.DEVICES]}
    result["bit_exact"] = all(result[name]["bit_exact"] for name in FORMATS)
    return result
