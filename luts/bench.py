"""`npumoe bench lut`: the LUT kernels against this machine's memory bandwidth and fp32.

For an N×K weight (default 4096×4096, group 64) at int4 and int2, with one thread and
with all of them:
  * streaming-read bandwidth, measured here by reading 256 MB with the kernels' own
    prefetching loop (the ceiling a GEMV can reach);
  * LUT-GEMV: median time per call with the weights rotated through 160 MB (more than
    any last-level cache), so every call reads DRAM; effective GB/s (tiles + scales + zeros
    per call / time) and its ratio to the bandwidth;
  * speedups over an fp32 GEMV (torch, rotated fp32 copies) and over dequantise-then-GEMV
    (the kernels' LUT dequantiser writing fp32 W, then the same fp32 GEMV);
  * prefill, M = 64: the fused LUT-dequant GEMM against an fp32 GEMM (torch).
Other work on the machine skews every figure, so the load average is printed with them.
"""

from __future__ import annotations

import json
import os
import time

import click
import numpy as np
import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from npumoe.luts import layout, spec
from npumoe.luts.kernels import default_threads, kernels

STREAM_BYTES = 256 * 2**20
FORMATS = {"int4": 4, "int2": 2}
PREFILL_ROWS = 64


def median_seconds(fn, calls: int, warmup: int) -> float:
    return float(np.median(timings(fn, calls, warmup)))


def timings(fn, calls: int, warmup: int) -> list[float]:
    for i in range(warmup):
        fn(i)
    times = []
    for i in range(calls):
        start = time.perf_counter()
        fn(warmup + i)
        times.append(time.perf_counter() - start)
    return times


def copies_for(nbytes: int, rotate_bytes: int) -> int:
    return max(2, -(-rotate_bytes // nbytes))


def rotated_tiles(packed: spec.Packed, rotate_bytes: int) -> list[layout.TiledWeight]:
    """Independent copies of the tiled weight, together larger than ``rotate_bytes``."""
    tiled = layout.to_tiles(packed)
    return [layout.TiledWeight(tiled.bits, tiled.group, tiled.shape, tiled.tiles.copy(), tiled.scales.copy(),
                               None if tiled.zeros is None else tiled.zeros.copy())
            for _ in range(copies_for(tiled.nbytes, rotate_bytes))]


def stream_gbs(lut, buf: np.ndarray, threads: int) -> float:
    """The best of several passes: an upper bound on what a GEMV can stream, so ratios err low."""
    return buf.nbytes / min(timings(lambda i: lut.stream_read(buf, threads), 7, 1)) / 1e9


def run(n: int, k: int, group: int, repeats: int, kernel: str | None, rotate_bytes: int, advance) -> dict:
    lut = kernels(kernel)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n, k), dtype=np.float32) * k**-0.5
    x = rng.standard_normal(k, dtype=np.float32)
    xs = rng.standard_normal((PREFILL_ROWS, k), dtype=np.float32)
    fp32 = [torch.from_numpy(w.copy()) for _ in range(copies_for(w.nbytes, rotate_bytes))]
    tiled = {name: rotated_tiles(spec.quantize_pack(w, bits, group), rotate_bytes) for name, bits in FORMATS.items()}
    dense = np.empty((tiled["int4"][0].row_blocks * layout.ROWS, k), np.float32)  # the unfused baseline's W
    stream_buf = np.ones(STREAM_BYTES // 8, np.uint64)
    x_t, xs_t = torch.from_numpy(x), torch.from_numpy(xs)
    result = {"shape": [n, k], "group": group, "kernel": lut.isa, "load_before": os.getloadavg(), "threads": {}}
    previous_threads = torch.get_num_threads()
    try:
        for threads in sorted({1, default_threads()}):
            torch.set_num_threads(threads)
            row = {"stream_gbs": stream_gbs(lut, stream_buf, threads)}
            fp32_gemv = median_seconds(lambda i: torch.mv(fp32[i % len(fp32)], x_t), max(repeats, 4 * len(fp32)), 1)
            fp32_gemm = median_seconds(lambda i: torch.mm(xs_t, fp32[i % len(fp32)].T), repeats, 1)
            row["fp32_gemv_ms"], row["fp32_gemm_ms"] = fp32_gemv * 1e3, fp32_gemm * 1e3
            advance()
            for name, copies in tiled.items():
                t = median_seconds(lambda i: lut.gemv(copies[i % len(copies)], x, threads=threads),
                                   repeats * len(copies), len(copies))
                unfused = median_seconds(lambda i: torch.mv(torch.from_numpy(
                    lut.dequantize(copies[i % len(copies)], threads, out=dense)), x_t), repeats, 1)
                prefill = median_seconds(lambda i: lut.gemm(copies[i % len(copies)], xs, threads), repeats, 1)
                row[name] = {"ms": t * 1e3, "gbs": copies[0].nbytes / t / 1e9, "speedup_vs_fp32": fp32_gemv / t,
                             "speedup_vs_dequant": unfused / t, "prefill_ms": prefill * 1e3,
                             "prefill_vs_fp32": fp32_gemm / prefill}
                advance()
            row["stream_gbs"] = max(row["stream_gbs"], stream_gbs(lut, stream_buf, threads))
            for name in FORMATS:
                row[name]["bw_ratio"] = row[name]["gbs"] / row["stream_gbs"]
            result["threads"][str(threads)] = row
    finally:
        torch.set_num_threads(previous_threads)
    result["load_after"] = os.getloadavg()
    return summarise(result)


def summarise(result: dict) -> dict:
    """Headline figures (all threads) at the top level, as `--json` promises; per-thread rows below."""
    rows = result["threads"]
    all_threads, single = rows[max(rows, key=int)], rows["1"]
    keys = ("bw_ratio", "speedup_vs_fp32", "speedup_vs_dequant", "gbs", "ms")
    for name in FORMATS:
        result[name] = {key: all_threads[name][key] for key in keys}
        result[name]["single_thread"] = {key: single[name][key] for key in keys}
    result["prefill_vs_fp32"] = all_threads["int4"]["prefill_vs_fp32"]
    result["prefill_vs_fp32_int2"] = all_threads["int2"]["prefill_vs_fp32"]
    result["stream_gbs"] = {t: row["stream_gbs"] for t, row in rows.items()}
    return result


def render(result: dict, console: Console) -> None:
    n, k = result["shape"]
    decode = Table(title=f"Decode: LUT-GEMV {n}×{k}, group {result['group']}, {result['kernel']} "
                         "(weights rotated through DRAM)")
    for col in ("threads", "format", "ms", "GB/s", "of BW", "× fp32", "× dequant+fp32"):
        decode.add_column(col, justify="right")
    prefill = Table(title=f"Prefill: fused LUT-dequant GEMM, M = {PREFILL_ROWS}")
    for col in ("threads", "format", "LUT ms", "fp32 ms", "× fp32"):
        prefill.add_column(col, justify="right")
    for threads, row in result["threads"].items():
        for name in FORMATS:
            r = row[name]
            decode.add_row(threads, name, f"{r['ms']:.3f}", f"{r['gbs']:.1f}", f"{r['bw_ratio']:.2f}",
                           f"{r['speedup_vs_fp32']:.1f}", f"{r['speedup_vs_dequant']:.1f}")
            prefill.add_row(threads, name, f"{r['prefill_ms']:.1f}", f"{row['fp32_gemm_ms']:.1f}",
                            f"{r['prefill_vs_fp32']:.2f}")
    console.print(decode)
    console.print(prefill)
    for threads, row in result["threads"].items():
        console.print(f"threads={threads}: streaming read {row['stream_gbs']:.1f} GB/s, fp32 GEMV "
                      f"{row['fp32_gemv_ms']:.2f} ms")
    console.print("goals: ≥ 0.90 of BW (int4, int2); ≥ 6.5× (int4) and ≥ 10× (int2) fp32 GEMV; prefill ≥ 1× fp32")
    console.print(f"load average {result['load_before'][0]:.2f} before, {result['load_after'][0]:.2f} after, "
                  f"on {os.cpu_count()} CPUs (other work on the machine lowers every figure)")


@click.command("lut")
@click.option("--size", default=4096, show_default=True, type=click.IntRange(32), help="N = K of the weight.")
@click.option("--group", default=64, show_default=True, type=click.Choice(["32", "64", "128"]), callback=lambda c, p, v: int(v))
@click.option("--repeats", default=20, show_default=True, type=click.IntRange(3), help="Calls per measurement (×copies for GEMV).")
@click.option("--kernel", default=None, help="Force a kernel (avx512, avx2, neon, portable); default: the best this CPU runs.")
@click.option("--rotate-mb", default=160, show_default=True, type=click.IntRange(1),
              help="Weights rotate through this much memory (keep it above the last-level cache).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
def bench_lut_command(size, group, repeats, kernel, rotate_mb, as_json):
    """LUT-GEMV / LUT-dequant GEMM vs streaming bandwidth and fp32 (4096², group 64, int4 and int2)."""
    spec.check_group(group, size)
    console = Console(stderr=as_json)
    steps = len({1, default_threads()}) * (1 + len(FORMATS))
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("benchmarking", total=steps)
        result = run(size, size, group, repeats, kernel, rotate_mb * 2**20, lambda: progress.advance(task))
    if as_json:
        click.echo(json.dumps(result, indent=1))
    else:
        render(result, console)
