"""The LUT kernels' machine-dependent choices, measured on this machine at first use: the GEMV's prefetch distance
and the row counts from which a prompt's product leaves the LUT-GEMV (or a bf16 one the bf16 GEMV) for a GEMM.

How far ahead the GEMV asks for weight lines (``csrc/lut.h``) depends on the machine's DRAM latency and read rate:
a distance tuned on one CPU was too far on the next. So the first process that loads a kernel build on a machine
times the int4 GEMV over a weight larger than the caches at each distance of a small grid, in interleaved rounds,
and keeps the fastest. Where the multi-row LUT-GEMV stops winning depends on the core's lookups against its dot
products (and the bf16 GEMV's on its widening one), so the same process times a small hot product at each row
count of :data:`ROW_GRID` on each path (:class:`Crossovers`). The choices are cached beside the compiled libraries,
keyed by the build and the CPU, so later processes read them and a changed CPU (a migrated VM, a copied cache)
measures again. Timings taken while other processes held the cores are skewed (a busy first use once picked a
prefetch distance twice the quiet one), so each measurement records the share of the machine others used meanwhile,
and a choice made under load is measured again by the first process that finds the machine quiet.
``NPUMOE_LUT_PREFETCH=<bytes>`` sets the distance and ``NPUMOE_LUT_CROSSOVERS=<int8 rows>,<rows × bits>[,<bf16
rows>]`` (each a number or ``never``; ``defaults`` for the built-in ones) the crossovers by hand; with both set
nothing is measured.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from npumoe.core.base.errors import InputError
from npumoe.core.base.io import atomic_write_text
from npumoe.core.base.machine import available_memory, cpu_sample, others_cpu_share, others_cpu_share_now

GRID = (4096, 8192, 12288, 16384, 24576, 32768)  # bytes ahead; csrc/lut.h's default is 12288
ROUNDS = 3  # each distance's best pass of this many, the rounds interleaved over the grid ...
BUDGET_S = 1.2  # ... or of as many rounds as fit in this (at least one): a first use waits for it
CROSSOVER_BUDGET_S = 0.5  # the same for the crossovers' rounds
K, GROUP, BITS = 4096, 64, 4  # the swept weight: 4096 inputs, int4 in groups of 64 (`bench lut`'s format)
MIN_SWEEP_BYTES, MAX_SWEEP_BYTES = 64 << 20, 256 << 20
BUSY = 0.25  # others' share of the machine's CPU above which a measurement is provisional


ROW_GRID = (4, 8, 12, 16, 32, 64, 128, 256, 512)  # prompt rows timed on each path
CROSSOVER_N, CROSSOVER_K = 512, 1024  # the timed product's weight (hot in cache: a prompt reads it once for all rows)


@dataclass(frozen=True)
class Crossovers:
    """Where a prompt's product leaves the LUT-GEMV (whose lookups grow with rows × bits): for the int8 GEMM at 3-4
    bits from ``int8`` rows, for the dequantising GEMM at 1-4 bits from ``dequant`` rows × bits; None: never (it
    did not win up to the grid's last row count, or the build has no such path). A bf16 matrix leaves the bf16 GEMV
    for the widening bf16 GEMM (on a CPU without bf16 dot products) from ``bf16_gemm`` rows: where it overtakes the
    GEMV, and past the GEMV's rows in any case (:data:`BF16_GEMV_MAX_ROWS`: beyond them torch would widen the whole
    matrix); None on builds without that GEMM."""

    int8: int | None
    dequant: int | None
    bf16_gemm: int | None


# Rows up to which the bf16 GEMV beats widening the matrix for torch's fp32 GEMM, per ISA: the AVX-512 build wins to
# 128 rows on every shape measured; the AVX2 build loses on small matrices from 16 rows and wins on large ones to 128,
# so 16 keeps the large matrices' decode and the small ones' prefill. NEON and portable keep AVX2's rule (not
# measured). Measurements: docs/performance.md, "bf16 paths".
BF16_GEMV_MAX_ROWS = {"avx512": 128, "avx2": 16, "neon": 16, "portable": 16}

# before measuring: docs/performance.md, "Prefill paths (LUT)" and "bf16 paths" (the bf16 GEMM's: AVX2 on Zen 4,
# and the middle of the 32-64 rows over which it mostly wins on the AVX-512 build without BF16)
DEFAULT_CROSSOVERS = {"avx512": Crossovers(8, 4096, 48), "avx2": Crossovers(8, 4096, 16),
                      "neon": Crossovers(8, 64, 16), "portable": Crossovers(8, 64, None)}


@dataclass(frozen=True)
class Tuning:
    prefetch: int  # bytes ahead of the read the GEMV prefetches into L2
    crossovers: Crossovers
    source: str  # "measured", "cached" or "environment"
    ms_by_distance: dict[str, float]  # the sweep's best pass per distance (empty unless measured)
    ms_by_rows: dict[str, dict[str, float]]  # path → row count → best time (empty unless measured)
    seconds: float  # what the measurement took
    others_cpu: float | None  # the share of the machine's CPU others used while it was taken (None: unknown)

    @property
    def provisional(self) -> bool:
        """Taken on a busy machine (or one that did not say): to be measured again once it is quiet."""
        return self.others_cpu is None or self.others_cpu > BUSY


def tune(isa: str, library: Path, calls, threads: int) -> Tuning:
    """Set ``calls``' library to this machine's prefetch distance and return its choices: from the environment, the
    cache, or measured now (and cached)."""
    prefetch, crossovers = _prefetch_from_environment(), _crossovers_from_environment(isa)
    if prefetch is not None and crossovers is not None:
        tuning = Tuning(prefetch, crossovers, "environment", {}, {}, 0.0, None)
    else:
        tuning = _read(cache_path(isa, library, threads))
        if tuning is None or (tuning.provisional and not _busy(others_cpu_share_now())):
            tuning = retune(isa, library, calls, threads)
        tuning = replace(tuning, prefetch=prefetch or tuning.prefetch, crossovers=crossovers or tuning.crossovers)
    calls.set_prefetch(tuning.prefetch)
    return tuning


def _prefetch_from_environment() -> int | None:
    chosen = os.environ.get("NPUMOE_LUT_PREFETCH")
    if chosen is not None and (not chosen.isdigit() or int(chosen) < 128):
        raise InputError(f"NPUMOE_LUT_PREFETCH={chosen!r} is not a byte count of 128 or more; unset it to let "
                         "npumoe measure the distance.")
    return None if chosen is None else int(chosen)


def _crossovers_from_environment(isa: str) -> Crossovers | None:
    chosen = os.environ.get("NPUMOE_LUT_CROSSOVERS")
    if chosen is None:
        return None
    if chosen == "defaults":
        return DEFAULT_CROSSOVERS[isa]
    fields = chosen.split(",")
    if len(fields) not in (2, 3) or not all(f == "never" or (f.isdigit() and int(f) > 0) for f in fields):
        raise InputError(f"NPUMOE_LUT_CROSSOVERS={chosen!r} is not '<int8 rows>,<rows × bits>[,<bf16 rows>]' (each a "
                         "positive number or never, e.g. 8,4096) or 'defaults'; unset it to let npumoe measure them.")
    given = [None if f == "never" else int(f) for f in fields]
    return Crossovers(*given) if len(given) == 3 else Crossovers(*given, DEFAULT_CROSSOVERS[isa].bf16_gemm)


def _busy(share: float | None) -> bool:
    return share is None or share > BUSY


def retune(isa: str, library: Path, calls, threads: int) -> Tuning:
    """Measure now (``npumoe bench lut`` does, on what should be a quiet machine), cache and set the result."""
    tuning = measure(isa, calls, threads)
    _write(cache_path(isa, library, threads), tuning)
    calls.set_prefetch(tuning.prefetch)
    return tuning


def measure(isa: str, calls, threads: int) -> Tuning:
    """The prefetch sweep, then the crossovers at the chosen distance."""
    before = cpu_sample()
    prefetch, ms_by_distance = measure_prefetch(calls, threads)
    calls.set_prefetch(prefetch)
    crossovers, ms_by_rows = measure_crossovers(isa, calls, threads)
    after = cpu_sample()
    others = others_cpu_share(before, after)
    return Tuning(prefetch, crossovers, "measured", ms_by_distance, ms_by_rows, round(after.wall - before.wall, 3),
                  None if others is None else round(others, 3))


def measure_prefetch(calls, threads: int) -> tuple[int, dict[str, float]]:
    """The grid's fastest distance for one GEMV pass over a weight of :func:`sweep_bytes`, and each distance's best
    pass in ms (the library is left at the last distance tried)."""
    from npumoe.luts.layout import ROWS, TILE_BYTES, TILE_K, TiledWeight

    start = time.perf_counter()
    block_bytes = K // TILE_K * BITS * TILE_BYTES
    blocks = sweep_bytes() // block_bytes
    weight = TiledWeight(BITS, GROUP, (blocks * ROWS, K),
                         np.full((blocks, K // TILE_K, BITS, TILE_BYTES), 0x5A, np.uint8),  # written: real pages
                         np.full((blocks, K // GROUP, ROWS), 1e-3, np.float16), None)
    x = np.random.default_rng(0).standard_normal(K).astype(np.float32)
    y = np.empty(blocks * ROWS, np.float32)
    best = dict.fromkeys(GRID, float("inf"))
    calls.gemv(weight, x, 1, 8, y, None, threads)  # untimed: the pages' first touch by the kernel
    for round_ in range(ROUNDS):
        if round_ and time.perf_counter() - start > BUDGET_S:
            break
        for distance in GRID:
            calls.set_prefetch(distance)
            began = time.perf_counter()
            calls.gemv(weight, x, 1, 8, y, None, threads)
            best[distance] = min(best[distance], time.perf_counter() - began)
    return min(GRID, key=best.get), {str(d): round(best[d] * 1e3, 3) for d in GRID}


def measure_crossovers(isa: str, calls, threads: int) -> tuple[Crossovers, dict[str, dict[str, float]]]:
    """Each path's best time at each row count of :data:`ROW_GRID` (interleaved rounds) on a hot
    :data:`CROSSOVER_N` × :data:`CROSSOVER_K` weight: int4 on the LUT-GEMV and the int8 GEMM, int2 on the LUT-GEMV
    and the dequantising GEMM, bf16 on the bf16 GEMV and the widening GEMM. The LUT-GEMV of int4 also answers for
    3 bits and that of int2 for 1."""
    from npumoe.luts.layout import to_tiles
    from npumoe.luts.spec import quantize_pack

    rng = np.random.default_rng(0)
    w = rng.standard_normal((CROSSOVER_N, CROSSOVER_K), dtype=np.float32)
    weights = {bits: to_tiles(quantize_pack(w, bits, GROUP)) for bits in (2, 4)}
    x = rng.standard_normal((ROW_GRID[-1], CROSSOVER_K), dtype=np.float32)
    y = np.empty((ROW_GRID[-1], CROSSOVER_N), np.float32)
    int8 = hasattr(calls, "gemm_i8") and calls.gemm_i8(weights[4], x[:1], y[:1], threads)
    bf16 = (w.view(np.uint32) >> 16).astype(np.uint16)  # (w's bf16 bits, truncated: the timing needs no rounding)
    # the widening bf16 GEMM's start, where the build has that GEMM and the CPU no dot products (which take a bf16
    # prompt from two rows: timing it there would only thin the other paths' rounds within the budget)
    bf16_gemm = DEFAULT_CROSSOVERS[isa].bf16_gemm is not None and not getattr(calls, "bf16_dot", False)
    paths = {"lut-gemv int4": lambda r: calls.gemv(weights[4], x[:r], r, 8, y[:r], None, threads),
             "lut-gemv int2": lambda r: calls.gemv(weights[2], x[:r], r, 8, y[:r], None, threads),
             "dequant gemm int2": lambda r: calls.gemm(weights[2], x[:r], y[:r], threads)}
    if int8:
        paths["int8 gemm int4"] = lambda r: calls.gemm_i8(weights[4], x[:r], y[:r], threads)
    if bf16_gemm:
        paths["bf16 gemv"] = lambda r: calls.bf16_gemv(bf16, x[:r], y[:r], threads)
        paths["bf16 gemm"] = lambda r: calls.bf16_gemm(bf16, x[:r], y[:r], threads)
    best = {name: dict.fromkeys(ROW_GRID, float("inf")) for name in paths}
    start = time.perf_counter()
    for round_ in range(ROUNDS):
        if round_ and time.perf_counter() - start > CROSSOVER_BUDGET_S:
            break
        for rows in ROW_GRID:
            for name, run in paths.items():
                began = time.perf_counter()
                run(rows)
                best[name][rows] = min(best[name][rows], time.perf_counter() - began)
    dequant = first_win(best["lut-gemv int2"], best["dequant gemm int2"])
    gemv_past = BF16_GEMV_MAX_ROWS[isa] + 1
    bf16_from = (min(first_win(best["bf16 gemv"], best["bf16 gemm"]) or gemv_past, gemv_past) if bf16_gemm
                 else DEFAULT_CROSSOVERS[isa].bf16_gemm)
    crossovers = Crossovers(first_win(best["lut-gemv int4"], best["int8 gemm int4"]) if int8 else None,
                            None if dequant is None else dequant * 2, bf16_from)
    return crossovers, {name: {str(r): round(t * 1e3, 4) for r, t in times.items()} for name, times in best.items()}


def first_win(incumbent: dict[int, float], challenger: dict[int, float]) -> int | None:
    """The least row count from which ``challenger`` takes less time than ``incumbent`` at every larger count too."""
    won = None
    for rows in sorted(incumbent, reverse=True):
        if challenger[rows] >= incumbent[rows]:
            break
        won = rows
    return won


def sweep_bytes() -> int:
    """1.5× the last-level cache, from 64 to 256 MB (a VM's share of a large shared cache is far smaller than the
    cache), and at most an eighth of the memory available now."""
    llc = _last_level_cache_bytes()
    size = min(max(int(1.5 * llc), MIN_SWEEP_BYTES), MAX_SWEEP_BYTES)
    available = available_memory()
    return min(size, available // 8) if available else size


def cache_path(isa: str, library: Path, threads: int) -> Path:
    """Where this build's choices for this CPU and thread count are kept: beside the library, named by both."""
    return library.with_name(f"tuning-{isa}-{cpu_key()}-{threads}t-{library.stem.rsplit('-', 1)[-1]}.json")


def cpu_key() -> str:
    """This CPU as the distance depends on it: its model, features and caches."""
    text = platform.machine() + platform.processor()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        fields = ("model name", "flags", "cache size", "Features", "CPU part")
        text += "".join(line for line in cpuinfo.read_text(errors="replace").splitlines()[:40]
                        if line.split(":")[0].strip() in fields)
    text += str(_last_level_cache_bytes())
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _last_level_cache_bytes() -> int:
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
        sizes.append(int(size.rstrip("KMG") or 0) * scale)
    return max(sizes, default=32 << 20)


def _read(path: Path) -> Tuning | None:
    try:
        data = json.loads(path.read_text())
        crossovers = Crossovers(**data["crossovers"])
        others = data.get("others_cpu")  # absent: cached before it was recorded, so unknown
        tuning = Tuning(int(data["prefetch"]), crossovers, "cached", dict(data["ms_by_distance"]),
                        dict(data["ms_by_rows"]), float(data["seconds"]), None if others is None else float(others))
    except (OSError, ValueError, KeyError, TypeError):
        return None  # absent, damaged or from before the crossovers: measured again
    valid = all(c is None or (isinstance(c, int) and c > 0) for c in asdict(crossovers).values())
    return tuning if tuning.prefetch in GRID and valid else None


def _write(path: Path, tuning: Tuning) -> None:
    """Atomically (a concurrent first use reads a whole file or none); a cache that cannot be written (read-only,
    full) is measured again next time."""
    try:
        atomic_write_text(path, json.dumps(asdict(tuning)))
    except (OSError, InputError):
        pass
