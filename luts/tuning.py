"""The LUT-GEMV's prefetch distance, measured on this machine at first use.

How far ahead the GEMV asks for weight lines (``csrc/lut.h``) depends on the machine's DRAM latency and read rate:
a distance tuned on one CPU was too far on the next. So the first process that loads a kernel build on a machine
times the int4 GEMV over a weight larger than the caches at each distance of a small grid, in interleaved rounds,
and keeps the fastest. The choice is cached beside the compiled libraries, keyed by the build and the CPU, so later
processes read it and a changed CPU (a migrated VM, a copied cache) measures again.
``NPUMOE_LUT_PREFETCH=<bytes>`` sets the distance by hand and measures nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from npumoe.core.base.errors import InputError
from npumoe.core.base.io import atomic_write_text
from npumoe.core.base.machine import available_memory

GRID = (4096, 8192, 12288, 16384, 24576, 32768)  # bytes ahead; csrc/lut.h's default is 12288
ROUNDS = 3  # each distance's best pass of this many, the rounds interleaved over the grid ...
BUDGET_S = 1.5  # ... or of as many rounds as fit in this (at least one): a first use waits for it
K, GROUP, BITS = 4096, 64, 4  # the swept weight: 4096 inputs, int4 in groups of 64 (`bench lut`'s format)
MIN_SWEEP_BYTES, MAX_SWEEP_BYTES = 64 << 20, 256 << 20


@dataclass(frozen=True)
class Tuning:
    prefetch: int  # bytes ahead of the read the GEMV prefetches into L2
    source: str  # "measured", "cached" or "NPUMOE_LUT_PREFETCH"
    ms_by_distance: dict[str, float]  # the sweep's best pass per distance (empty unless measured)
    seconds: float  # what the measurement took


def tune(isa: str, library: Path, calls, threads: int) -> Tuning:
    """Set ``calls``' library to this machine's prefetch distance: from the environment, the cache, or measured now
    (and cached)."""
    chosen = os.environ.get("NPUMOE_LUT_PREFETCH")
    if chosen is not None:
        if not chosen.isdigit() or int(chosen) < 128:
            raise InputError(f"NPUMOE_LUT_PREFETCH={chosen!r} is not a byte count of 128 or more; unset it to let "
                             "npumoe measure the distance.")
        calls.set_prefetch(int(chosen))
        return Tuning(int(chosen), "NPUMOE_LUT_PREFETCH", {}, 0.0)
    tuning = _read(cache_path(isa, library, threads))
    if tuning is None:
        return retune(isa, library, calls, threads)
    calls.set_prefetch(tuning.prefetch)
    return tuning


def retune(isa: str, library: Path, calls, threads: int) -> Tuning:
    """Measure now (``npumoe bench lut`` does, on what should be a quiet machine), cache and set the result."""
    tuning = measure(calls, threads)
    _write(cache_path(isa, library, threads), tuning)
    calls.set_prefetch(tuning.prefetch)
    return tuning


def measure(calls, threads: int) -> Tuning:
    """The grid's fastest distance for one GEMV pass over a weight of :func:`sweep_bytes` (the library is left at
    the last distance tried; :func:`retune` sets the chosen one)."""
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
    chosen = min(GRID, key=best.get)
    return Tuning(chosen, "measured", {str(d): round(best[d] * 1e3, 3) for d in GRID},
                  round(time.perf_counter() - start, 3))


def sweep_bytes() -> int:
    """1.5× the last-level cache, from 64 to 256 MB (a VM's share of a large shared cache is far smaller than the
    cache), and at most an eighth of the memory available now."""
    llc = _last_level_cache_bytes()
    size = min(max(int(1.5 * llc), MIN_SWEEP_BYTES), MAX_SWEEP_BYTES)
    available = available_memory()
    return min(size, available // 8) if available else size


def cache_path(isa: str, library: Path, threads: int) -> Path:
    """Where this build's distance for this CPU and thread count is kept: beside the library, named by both."""
    return library.with_name(f"prefetch-{isa}-{cpu_key()}-{threads}t-{library.stem.rsplit('-', 1)[-1]}.json")


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
        tuning = Tuning(int(data["prefetch"]), "cached", dict(data["ms_by_distance"]), float(data["seconds"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None  # absent or damaged: measured again
    return tuning if tuning.prefetch in GRID else None


def _write(path: Path, tuning: Tuning) -> None:
    """Atomically (a concurrent first use reads a whole file or none); a cache that cannot be written (read-only,
    full) is measured again next time."""
    try:
        atomic_write_text(path, json.dumps(asdict(tuning)))
    except (OSError, InputError):
        pass
