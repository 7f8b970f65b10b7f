"""`npumoe bench hvx`: the HVX kernel's instruction counts for a 4096×4096 GEMV, the cost
model's estimate from them (see :mod:`.cost`), T-MAN's reported figures beside it, and a
bit-exactness check: each format's kernel runs once under qemu-hexagon against the spec.
"""

from __future__ import annotations

import json

import click
import numpy as np
from rich.console import Console
from rich.table import Table

from npumoe.errors import BackendUnavailableError
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


def render(result: dict, console: Console) -> None:
    n, k = result["shape"]
    counts = Table(title=f"HVX instructions per {n}×{k} GEMV, group {result['group']} (compiled kernel)")
    counts.add_column("instruction")
    for name in FORMATS:
        counts.add_column(name, justify="right")
    for c in COUNTED:
        counts.add_row(c.replace("_", " "), *(f"{result[name]['counts'][c]:,}" for name in FORMATS))
    counts.add_row("bit-exact (qemu)", *("yes" if result[name]["bit_exact"] else "NO" for name in FORMATS))
    model = Table(title="Estimate from a cost model (T-MAN Tables 1–2; clocks, thread counts assumed)")
    for col in ("format", "device", "lookup cyc", "sched cyc", "HVX µs", "DMA µs", "bound",
                *(f"{m.split('-')[0]} tok/s ≤" for m in cost.MODEL_WEIGHTS)):
        model.add_column(col, justify="right")
    for name in FORMATS:
        for e in result[name]["estimate"]:
            model.add_row(name, e["device"].removeprefix("Snapdragon "), f"{e['lookup_floor_cycles']:,.0f}",
                          f"{e['schedule_cycles']:,}", f"{e['compute_us']:.1f}", f"{e['memory_us']:.1f}", e["bound"],
                          *(f"{t:.1f}" for t in e["tokens_per_s_upper_bound"].values()))
    console.print(counts)
    console.print(model)
    reported = result["tman_reported"]
    console.print("T-MAN reports: " + "; ".join(f"{what} {value} tok/s" for what, value in
                                                reported["decode_tokens_per_s"].items())
                  + f"; {reported['decode_vs_qnn']}; {reported['gemv_kernels_vs_qnn']}.")
    console.print("tok/s here are upper bounds from the linear layers' weight traffic alone (no attention, no "
                  "lm_head, no overhead), computed for every format; T-MAN runs BitNet with 2-bit weights.")


@click.command("hvx")
@click.option("--n", "n", default=4096, show_default=True, help="Output rows (a multiple of 128).")
@click.option("--k", "k", default=4096, show_default=True, help="Inputs (a multiple of the group).")
@click.option("--group", default=64, show_default=True, type=click.Choice(["32", "64", "128"]), help="Group size.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
def bench_hvx_command(n: int, k: int, group: str, as_json: bool) -> None:
    """Instruction counts and a modelled cost of the HVX LUT-GEMV, checked bit-exact under qemu-hexagon."""
    spec.check_group(int(group), k)
    result = run(n, k, int(group))
    if as_json:
        click.echo(json.dumps(result))
    else:
        render(result, Console())
