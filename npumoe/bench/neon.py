"""`npumoe bench neon`: the NEON LUT-GEMV's and int8 GEMM's inner loops on Arm cores, estimated by llvm-mca (see
luts.estimate)."""

from __future__ import annotations

import json

import click
from rich.console import Console
from rich.table import Table

from npumoe.core.base.progress import task

READ_GB_S = 40  # a phone's or an M1's attainable read bandwidth, roughly: what "cores to stream" is counted against


def run() -> dict:
    from npumoe.bench.lut_measure import FORMATS
    from npumoe.luts import estimate
    from npumoe.luts.kernels import available

    result = {"estimate_is_a_model": True, "neon": [], "neon_int8": [], "host_check": [], "host_check_int8": []}
    for cpu in estimate.NEON_CPUS:
        for bits in FORMATS.values():
            result["neon"].append(estimate.estimate("neon", bits, cpu).to_json())
        result["neon_int8"].append(estimate.int8_estimate("neon", cpu).to_json())
    for isa in (isa for isa in estimate.HOST_ISAS if isa in available()):
        for bits in FORMATS.values():
            result["host_check"].append(estimate.host_check(isa, bits))
        if (check := estimate.host_check_int8(isa)) is not None:
            result["host_check_int8"].append(check)
    return result


def render(result: dict, console: Console) -> None:
    table = Table(title="NEON LUT-GEMV inner loop (a tile: 16 rows × 32 inputs), ESTIMATED by llvm-mca, not measured")
    for col in ("core", "LLVM model", "GHz", "bits", "instr", "cycles", "B/cycle", "GB/s", f"cores: {READ_GB_S} GB/s"):
        table.add_column(col, justify="left" if col in ("core", "LLVM model") else "right")
    for e in result["neon"]:
        table.add_row(e["cpu"], e["mcpu"], f"{e['ghz']:.2f}", str(e["bits"]), str(e["instructions"]),
                      f"{e['cycles_per_tile']:.1f}", f"{e['bytes_per_cycle']:.2f}", f"{e['gb_s_per_core']:.1f}",
                      f"{READ_GB_S / e['gb_s_per_core']:.1f}")
    console.print(table)
    dots = Table(title="NEON int8 GEMM inner loop (3-4-bit prompts: a tile's codes × a pass of activation rows, "
                       "sdot), ESTIMATED by llvm-mca")
    for col in ("core", "LLVM model", "GHz", "rows", "instr", "cycles", "MAC/cycle", "GMAC/s"):
        dots.add_column(col, justify="left" if col in ("core", "LLVM model") else "right")
    for e in result["neon_int8"]:
        dots.add_row(e["cpu"], e["mcpu"], f"{e['ghz']:.2f}", str(e["rows"]), str(e["instructions"]),
                     f"{e['cycles_per_tile']:.1f}", f"{e['macs_per_cycle']:.1f}", f"{e['gmac_s_per_core']:.1f}")
    console.print(dots)
    if result["host_check"]:
        check = Table(title="The same method on this machine (llvm-mca -mcpu=native) against a one-thread measurement")
        for col in ("kernel", "format", "cycles/tile", "B/cycle", "measured GB/s", "implied GHz"):
            check.add_column(col, justify="right")
        for c in result["host_check"]:
            check.add_row(c["isa"], f"int{c['bits']}", f"{c['cycles_per_tile']:.1f}", f"{c['bytes_per_cycle']:.2f}",
                          f"{c['measured_gb_s']:.1f}", f"{c['implied_ghz']:.2f}")
        console.print(check)
    if result["host_check_int8"]:
        check = Table(title="The int8 GEMM the same way, against one thread's int4 GEMM of 64 rows (with what the "
                            "estimate leaves out)")
        for col in ("kernel", "cycles/tile", "MAC/cycle", "measured GMAC/s", "implied GHz"):
            check.add_column(col, justify="right")
        for c in result["host_check_int8"]:
            check.add_row(c["isa"], f"{c['cycles_per_tile']:.1f}", f"{c['macs_per_cycle']:.1f}",
                          f"{c['measured_gmac_s']:.1f}", f"{c['implied_ghz']:.2f}")
        console.print(check)
    if result["host_check"] or result["host_check_int8"]:
        console.print("An implied clock near this CPU's real one says llvm-mca describes the loop; above it, the "
                      "model is pessimistic.")
    console.print("instr and cycles per tile; GB/s streamed by one core at the assumed clock (the part's top one); "
                  "apple-m1 is LLVM's Cyclone (A7) model, so the M1 rows are the roughest.")
    console.print("Left out of the estimates: the group epilogue, the table build (GEMV), the codes' unpacking and "
                  "the rows' quantisation (int8 GEMM), threads and memory. Bit-exactness of the NEON kernels is tested "
                  "under qemu (tests/test_luts_kernels.py).")


@click.command("neon")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
def bench_neon_command(as_json: bool) -> None:
    """Estimate the NEON LUT-GEMV (decode) and int8 GEMM (3-4-bit prompts) on Arm cores (Cortex-X1/A710/A55, Apple
    M1) with llvm-mca, from the inner loops the AArch64 compiler builds, and check the method against this
    machine's own kernels."""
    with task("compiling the inner loop per format and running llvm-mca per core model"):
        result = run()
    if as_json:
        click.echo(json.dumps(result, indent=1))
    else:
        render(result, Console())
