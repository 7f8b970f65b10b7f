"""The measurements behind `npumoe bench lut`: the LUT kernels against this machine's memory bandwidth and fp32.

For an N×K weight (default 4096×4096, group 64) at int4 and int2, with one thread and
with all of them:
  * LUT-GEMV: median time per call with the weights rotated through 160 MB (more than
    any last-level cache), so every call reads DRAM; effective GB/s (tiles + scales + zeros
    per call / time);
  * streaming-read bandwidth: a plain read of the same bytes (another copy of the weight),
    timed alternately with the GEMV calls, once left to the hardware prefetchers and once
    with software prefetch; the faster read's median over the GEMV's is the GEMV's share of
    the bandwidth. Alternating matters on a shared machine: a read's bandwidth swings from
    one pass to the next, so a median GEMV compared with the best of a few separate read
    passes reads well below 1 even for a kernel that is a pure read (docs/performance.md,
    "Measuring on a shared machine"). The best 256 MB read pass is printed as the peak;
  * speedups over an fp32 GEMV (torch, rotated fp32 copies) and over dequantise-then-GEMV
    (the kernels' LUT dequantiser writing fp32 W, then the same fp32 GEMV);
  * prefill, M = 64: what npumoe::lut_linear runs for 64 rows on this build (the LUT-GEMV, the int8 GEMM or the
    dequantising GEMM: torch_op.lut_product) against an fp32 GEMM (torch).
Other work on the machine skews every figure, so the load average is printed with them.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict

import numpy as np
import torch

from npumoe.luts import build, layout, spec, tuning
from npumoe.luts.kernels import default_threads, kernels
from npumoe.luts.torch_op import lut_product

STREAM_BYTES = 256 * 2**20
FORMATS = {"int4": 4, "int2": 2}
PREFILL_ROWS = 64
READ_PREFETCHES = (0, 8192)  # the probe's two read loops: hardware prefetch only, and L2 prefetch 8 KB ahead


def median_seconds(fn, calls: int, warmup: int) -> float:
    return float(np.median(timings(fn, calls=calls, warmup=warmup)[0]))


def timings(*fns, calls: int, warmup: int) -> list[list[float]]:
    """Seconds per call of each fn(i), the fns called in turn so drift on the machine hits all alike."""
    for i in range(warmup):
        for fn in fns:
            fn(i)
    times = [[] for _ in fns]
    for i in range(calls):
        for fn, series in zip(fns, times):
            start = time.perf_counter()
            fn(warmup + i)
            series.append(time.perf_counter() - start)
    return times


def copies_for(nbytes: int, rotate_bytes: int) -> int:
    return max(3, -(-rotate_bytes // nbytes))


def rotated_tiles(packed: spec.Packed, rotate_bytes: int) -> list[tuple[layout.TiledWeight, np.ndarray]]:
    """Independent copies of the tiled weight, together larger than ``rotate_bytes``.

    Each copy's arrays are views into one buffer (returned beside it), so a plain read of
    that buffer touches exactly the bytes a GEMV of the copy reads.
    """
    tiled = layout.to_tiles(packed)
    parts = [a for a in (tiled.tiles, tiled.scales, tiled.zeros) if a is not None]
    copies = []
    for _ in range(copies_for(tiled.nbytes, rotate_bytes)):
        buffer = np.empty(tiled.nbytes, np.uint8)
        views, at = [], 0
        for a in parts:  # every part's size is a multiple of 16 bytes, so views stay aligned
            view = buffer[at:at + a.nbytes].view(a.dtype).reshape(a.shape)
            view[...] = a
            views.append(view)
            at += a.nbytes
        zeros = views[2] if tiled.zeros is not None else None
        copies.append((layout.TiledWeight(tiled.bits, tiled.group, tiled.shape, views[0], views[1], zeros), buffer))
    return copies


def peak_stream_gbs(lut, buf: np.ndarray, threads: int) -> float:
    """The best of several 256 MB read passes: what this machine reaches at its quietest."""
    reads = [lambda i, p=p: lut.stream_read(buf, threads, p) for p in READ_PREFETCHES]
    return buf.nbytes / min(min(t) for t in timings(*reads, calls=7, warmup=1)) / 1e9


def gemv_against_stream(lut, copies, x, threads: int, calls: int) -> tuple[float, float]:
    """Median seconds of a LUT-GEMV and of the faster plain read of the same bytes, alternated.

    Each call takes a copy a third of the rotation away from the others', so none finds the
    lines another call just read still in cache. The GEMV writes into one output buffer, as a
    decode step's static buffers do.
    """
    n, step = len(copies), len(copies) // 3
    y = np.empty(copies[0][0].row_blocks * layout.ROWS, np.float32)
    reads = [lambda i, j=j, p=p: lut.stream_read(copies[(i + j * step) % n][1], threads, p)
             for j, p in enumerate(READ_PREFETCHES, start=1)]
    gemv, *read = timings(lambda i: lut.gemv(copies[i % n][0], x, threads=threads, out=y), *reads,
                          calls=calls, warmup=len(copies))
    return float(np.median(gemv)), min(float(np.median(t)) for t in read)


def run(n: int, k: int, group: int, repeats: int, kernel: str | None, rotate_bytes: int, advance) -> dict:
    lut = kernels(kernel)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n, k), dtype=np.float32) * k**-0.5
    x = rng.standard_normal(k, dtype=np.float32)
    xs = rng.standard_normal((PREFILL_ROWS, k), dtype=np.float32)
    fp32 = [torch.from_numpy(w.copy()) for _ in range(copies_for(w.nbytes, rotate_bytes))]
    tiled = {name: rotated_tiles(spec.quantize_pack(w, bits, group), rotate_bytes) for name, bits in FORMATS.items()}
    dense = np.empty((tiled["int4"][0][0].row_blocks * layout.ROWS, k), np.float32)  # the unfused baseline's W
    stream_buf = np.ones(STREAM_BYTES // 8, np.uint64)
    x_t, xs_t = torch.from_numpy(x), torch.from_numpy(xs)
    y_t = torch.empty(n)  # the fp32 GEMVs' output buffer, like the LUT-GEMV's
    load_before = os.getloadavg()
    chosen = tuning.retune(lut.isa, build.library(lut.isa), lut.calls, default_threads())
    result = {"shape": [n, k], "group": group, "kernel": lut.isa, "load_before": load_before,
              "prefetch": asdict(chosen), "threads": {}}
    previous_threads = torch.get_num_threads()
    try:
        for threads in sorted({1, default_threads()}):
            torch.set_num_threads(threads)
            row = {"stream_peak_gbs": peak_stream_gbs(lut, stream_buf, threads)}
            fp32_gemv = median_seconds(lambda i: torch.mv(fp32[i % len(fp32)], x_t, out=y_t),
                                       max(repeats, 4 * len(fp32)), 1)
            fp32_gemm = median_seconds(lambda i: torch.mm(xs_t, fp32[i % len(fp32)].T), repeats, 1)
            row["fp32_gemv_ms"], row["fp32_gemm_ms"] = fp32_gemv * 1e3, fp32_gemm * 1e3
            advance()
            for name, copies in tiled.items():
                weight = copies[0][0]
                t, read = gemv_against_stream(lut, copies, x, threads, repeats * len(copies))
                unfused = median_seconds(lambda i: torch.mv(torch.from_numpy(
                    lut.dequantize(copies[i % len(copies)][0], threads, out=dense)), x_t, out=y_t), repeats, 1)
                paths = []  # the path each timed call took (one path: the rows and bits decide it)
                prefill = median_seconds(
                    lambda i: paths.append(lut_product(lut, copies[i % len(copies)][0], xs, threads)[1]), repeats, 1)
                row[name] = {"ms": t * 1e3, "gbs": weight.nbytes / t / 1e9, "stream_gbs": weight.nbytes / read / 1e9,
                             "bw_ratio": read / t, "speedup_vs_fp32": fp32_gemv / t, "speedup_vs_dequant": unfused / t,
                             "prefill_ms": prefill * 1e3, "prefill_vs_fp32": fp32_gemm / prefill,
                             "prefill_path": paths[0]}
                advance()
            result["threads"][str(threads)] = row
    finally:
        torch.set_num_threads(previous_threads)
    result["load_after"] = os.getloadavg()
    return summarise(result)


def summarise(result: dict) -> dict:
    """Headline figures (all threads) at the top level, as `--json` promises; per-thread rows below."""
    rows = result["threads"]
    all_threads, single = rows[max(rows, key=int)], rows["1"]
    keys = ("bw_ratio", "speedup_vs_fp32", "speedup_vs_dequant", "gbs", "stream_gbs", "ms")
    for name in FORMATS:
        result[name] = {key: all_threads[name][key] for key in keys}
        result[name]["single_thread"] = {key: single[name][key] for key in keys}
    result["prefill_vs_fp32"] = all_threads["int4"]["prefill_vs_fp32"]
    result["prefill_vs_fp32_int2"] = all_threads["int2"]["prefill_vs_fp32"]
    result["stream_peak_gbs"] = {t: row["stream_peak_gbs"] for t, row in rows.items()}
    return result
