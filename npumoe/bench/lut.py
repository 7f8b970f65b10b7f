"""`npumoe bench lut`: the LUT kernels against streaming bandwidth and fp32 (measured by
:mod:`npumoe.bench.lut_measure`)."""

from __future__ import annotations

import json
import os

import click
from rich.console import Console
from rich.table import Table

from npumoe.core.base.progress import task


def render(result: dict, console: Console) -> None:
    from npumoe.bench.lut_measure import FORMATS, PREFILL_ROWS
    from npumoe.luts.tuning import BUSY

    n, k = result["shape"]
    decode = Table(title=f"Decode: LUT-GEMV {n}×{k}, group {result['group']}, {result['kernel']} "
                         "(weights rotated through DRAM)")
    for col in ("threads", "format", "ms", "GB/s", "read GB/s", "of BW", "× fp32", "× dequant+fp32"):
        decode.add_column(col, justify="right")
    prefill = Table(title=f"Prefill: {PREFILL_ROWS} rows, the path npumoe::lut_linear takes")
    for col in ("threads", "format", "path", "ms", "fp32 ms", "× fp32"):
        prefill.add_column(col, justify="right")
    for threads, row in result["threads"].items():
        for name in FORMATS:
            r = row[name]
            decode.add_row(threads, name, f"{r['ms']:.3f}", f"{r['gbs']:.1f}", f"{r['stream_gbs']:.1f}",
                           f"{r['bw_ratio']:.2f}", f"{r['speedup_vs_fp32']:.1f}", f"{r['speedup_vs_dequant']:.1f}")
            prefill.add_row(threads, name, r["prefill_path"], f"{r['prefill_ms']:.1f}", f"{row['fp32_gemm_ms']:.1f}",
                            f"{r['prefill_vs_fp32']:.2f}")
    console.print(decode)
    console.print(prefill)
    for threads, row in result["threads"].items():
        console.print(f"threads={threads}: peak streaming read {row['stream_peak_gbs']:.1f} GB/s, fp32 GEMV "
                      f"{row['fp32_gemv_ms']:.2f} ms")
    chosen = result["prefetch"]
    swept = ", ".join(f"{int(d) // 1024} KB {ms:.1f} ms" for d, ms in chosen["ms_by_distance"].items())
    others = chosen["others_cpu"]
    contention = ("" if others is None else f"; other processes used {others:.0%} of the CPU meanwhile"
                  + (", so a quiet process measures again" if others > BUSY else ""))
    console.print(f"prefetch distance {chosen['prefetch'] // 1024} KB, measured now in {chosen['seconds']:.1f} s with "
                  f"the crossovers and cached for later processes (one GEMV pass a distance, best of rounds: {swept})"
                  + contention)
    crossing = Table(title="Prompt paths: ms a product at each row count (hot 512×1024); where each path takes over")
    crossing.add_column("path")
    rows = list(next(iter(chosen["ms_by_rows"].values()), {}))
    for r in rows:
        crossing.add_column(r, justify="right")
    for path, by_rows in chosen["ms_by_rows"].items():
        crossing.add_row(path, *(f"{by_rows[r]:.3f}" for r in rows))
    console.print(crossing)
    int8, dequant, bf16 = (chosen["crossovers"][name] for name in ("int8", "dequant", "bf16_gemm"))
    console.print(f"int8 GEMM (3-4 bits) from {int8 or 'never'} rows; dequantising GEMM (1-4 bits) from "
                  f"{dequant or 'never'} rows × bits; the LUT-GEMV below. bf16 (no dot products): the widening GEMM "
                  f"from {bf16 or 'never'} rows, the bf16 GEMV below")
    console.print("goals: ≥ 0.92 of BW (int4, int2; issue 34); ≥ 6.5× (int4) and ≥ 10× (int2) fp32 GEMV; "
                  "prefill ≥ 1× fp32")
    console.print(f"load average {result['load_before'][0]:.2f} before, {result['load_after'][0]:.2f} after, "
                  f"on {os.cpu_count()} CPUs (other work on the machine lowers every figure)")


@click.command("lut")
@click.option("--size", default=4096, show_default=True, type=click.IntRange(32), help="N = K of the weight.")
@click.option("--group", default=64, show_default=True, type=click.Choice(["32", "64", "128"]),
              callback=lambda c, p, v: int(v))
@click.option("--repeats", default=20, show_default=True, type=click.IntRange(3),
              help="Calls per measurement (×copies for GEMV).")
@click.option("--kernel", default=None,
              help="Force a kernel (avx512, avx2, neon, portable); default: the best this CPU runs.")
@click.option("--rotate-mb", default=160, show_default=True, type=click.IntRange(1),
              help="Weights rotate through this much memory (keep it above the last-level cache).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
def bench_lut_command(size, group, repeats, kernel, rotate_mb, as_json):
    """LUT-GEMV / LUT-dequant GEMM vs streaming bandwidth and fp32 (4096², group 64, int4 and int2)."""
    from npumoe.bench.lut_measure import FORMATS, run
    from npumoe.luts import spec
    from npumoe.luts.kernels import default_threads

    spec.check_group(group, size)
    steps = len({1, default_threads()}) * (1 + len(FORMATS))
    with task("benchmarking the LUT kernels", steps, "measurements") as step:
        result = run(size, size, group, repeats, kernel, rotate_mb * 2**20, step.advance)
    if as_json:
        click.echo(json.dumps(result, indent=1))
    else:
        render(result, Console())
