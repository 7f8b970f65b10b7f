"""A static cost model of the HVX LUT-GEMV: instructions counted in the compiled kernel,
turned into cycles and tokens/s with T-MAN's published throughput and bandwidth.

Counting: each (bits, group) block in ``linear.c`` is straight-line code run once per
128 rows × one group, so its disassembly (llvm-objdump-16) times N/128 · K/group calls is
the instruction count of one GEMV — VLUT16s, widening adds, plane combines, shifts, vector
loads and stores, other HVX and scalar — and its VLIW packet count, at one packet per cycle
without stalls, is the compiler's schedule for one HVX thread.

Estimate (a model, not a measurement):
    lookup floor  = VLUT16 × 0.5 cycles (T-MAN Table 1: CPI 0.5 for 16-bit tables)
    compute time  = max(lookup floor, packets) / (HVX threads × clock)
    memory time   = bytes read (bit planes, fp16 scales, u8 zeros) / DMA bandwidth
                    (59 GB/s, T-MAN Table 2, measured on a Snapdragon 8 Gen 3 phone)
    GEMV time     = max(compute, memory): DMA overlaps compute, as in T-MAN's pipeline
    tokens/s      = 1 / (GEMV time × linear weights of the model / (N·K)): decode limited
                    by the linear layers alone, an upper bound (no attention, no overhead).
Clocks and HVX thread counts are not in the paper; the values below are assumptions,
and the GEMV is memory-bound by a wide margin, so they barely move the result.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from npumoe.core.base.errors import BackendUnavailableError

OBJDUMP = "llvm-objdump-16"
DISASSEMBLE = ("-d", "--no-show-raw-insn", "--mcpu=hexagonv73", "--mattr=+hvxv73,+hvx-length128b")
VLUT16_CPI = 0.5  # T-MAN Table 1
DMA_GBS = 59.0  # T-MAN Table 2 (DMA, 1 and 4 HVX threads)


@dataclass(frozen=True)
class Device:
    name: str
    hvx_threads: int  # assumed: the paper says "4 to 6" HVX contexts without naming the chip
    clock_ghz: float  # assumed: not published by T-MAN
    dma_gbs: float


DEVICES = (Device("Snapdragon 8 Gen 3", 4, 1.0, DMA_GBS), Device("Snapdragon 8 Elite", 6, 1.0, DMA_GBS))

# Linear-layer weights per decoded token (embeddings and lm_head excluded), from the configs.
MODEL_WEIGHTS = {
    "Llama-3.1-8B": 32 * (4096 * (4096 + 1024 + 1024 + 4096) + 3 * 4096 * 14336),
    "BitNet-2B-4T": 30 * (2560 * (2560 + 640 + 640 + 2560) + 3 * 2560 * 6912),
}

# What T-MAN reports (arXiv 2511.11248 and its README), for comparison, never for fitting.
TMAN_REPORTED = {
    "decode_tokens_per_s": {"BitNet-2B-4T, Snapdragon 8 Gen 3": 49.1},
    "decode_vs_qnn": "1.5–1.8× QNN end to end (§6.3); 1.4× QNN on Llama-3.1-8B (README)",
    "gemv_kernels_vs_qnn": "1.8–2.5× QNN for 2-bit kernels, similar for 4-bit (§6.2)",
    "vlut16_16bit": {"cpi": VLUT16_CPI, "lookups": 128},
    "dma_gbs": DMA_GBS,
}

CATEGORIES = (  # first match wins
    ("vlut16", re.compile(r"vlut16\(")),
    ("widening_add", re.compile(r"\.w \+?= vadd\(v\d+\.h,v\d+\.h\)")),
    ("plane_combine", re.compile(r"\+= vasl\(")),
    ("shift", re.compile(r"vlsr\(")),
    ("vector_load", re.compile(r"^v[\d:]+(\.\w+)?(\.(cur|tmp))? = vmem\(")),
    ("vector_store", re.compile(r"^vmem\(.*\) = v\d+")),
    ("other_hvx", re.compile(r"\bv\d+")),
    ("scalar", re.compile(r".")),
)


def _classify(instruction: str) -> str:
    return next(name for name, pattern in CATEGORIES if pattern.search(instruction))


def block_counts(binary: Path, bits: int, group: int) -> Counter:
    """Instructions by category, and VLIW packets, in one (bits, group) block of the binary."""
    if not shutil.which(OBJDUMP):
        raise BackendUnavailableError(f"{OBJDUMP} is not installed; apt-get install llvm-16 (comes with clang-16).")
    symbol = f"hvx_block_b{bits}_g{group}"
    listing = subprocess.run([OBJDUMP, *DISASSEMBLE, f"--disassemble-symbols={symbol}", str(binary)],
                             capture_output=True, text=True, check=True).stdout
    counts = Counter()
    for line in listing.splitlines():
        match = re.match(r"\s*[0-9a-f]+:\s*(\{?)\s*(.*?)\s*(\}\s*(:endloop\d)?)?\s*$", line)
        if not match or not match.group(2):
            continue
        counts["packets"] += bool(match.group(1))
        counts[_classify(match.group(2))] += 1
    if not counts["vlut16"]:
        raise BackendUnavailableError(f"no VLUT16 found in {symbol} of {binary}; the harness build is not the kernel "
                                      "this model describes.")
    return counts


def gemv_counts(binary: Path, n: int, k: int, bits: int, group: int) -> dict:
    calls = -(-n // 128) * (k // group)
    per_block = block_counts(binary, bits, group)
    return {name: per_block[name] * calls for name in (*(c for c, _ in CATEGORIES), "packets")} | {"blocks": calls}


def weight_bytes(n: int, k: int, bits: int, group: int) -> int:
    """Bytes a GEMV streams from DRAM: bit planes, fp16 scales and u8 zero points."""
    return n * k * bits // 8 + n * (k // group) * 3


def estimate(counts: dict, n: int, k: int, bits: int, group: int, device: Device) -> dict:
    lookup_cycles = counts["vlut16"] * VLUT16_CPI
    cycles = max(lookup_cycles, counts["packets"])
    compute_us = cycles / device.hvx_threads / (device.clock_ghz * 1e3)
    memory_us = weight_bytes(n, k, bits, group) / (device.dma_gbs * 1e3)
    gemv_us = max(compute_us, memory_us)
    tokens = {model: 1e6 / (gemv_us * weights / (n * k)) for model, weights in MODEL_WEIGHTS.items()}
    return {"device": device.name, "hvx_threads": device.hvx_threads, "clock_ghz": device.clock_ghz,
            "dma_gbs": device.dma_gbs, "lookup_floor_cycles": lookup_cycles, "schedule_cycles": counts["packets"],
            "compute_us": compute_us, "memory_us": memory_us, "gemv_us": gemv_us,
            "bound": "memory" if memory_us >= compute_us else "compute", "tokens_per_s_upper_bound": tokens}
