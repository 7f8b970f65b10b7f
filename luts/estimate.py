"""What a LUT-GEMV tile and the int8 GEMM's dot products cost on CPUs we cannot run here: llvm-mca over the
compiled inner loops. An estimate, not a measurement (`npumoe bench neon`).

``csrc/mca_tile.c`` is the GEMV's inner loop alone: one tile's tables loaded and its planes looked up and summed
(``tile_dots``), as ``gemv_rows`` runs it, between llvm-mca's region markers. It is compiled by the compiler the
ISA's build uses (the AArch64 cross gcc for NEON) and the region's instructions go to llvm-mca with a CPU's
scheduling model, which reports cycles per iteration. Left out: the group epilogue (fp16 scales, a few
instructions per 32-64 inputs), the table build, threads, and whether memory keeps up; a model is only as good
as LLVM's description of the core (Apple's cores are described by the old Cyclone model). On this machine the
same method can be set against a measurement (:func:`host_check`). ``csrc/mca_i8.c`` is the same for a 3-4-bit
prompt's int8 GEMM: one tile's unpacked codes dotted with a pass of activation rows (sdot on NEON).
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from npumoe.core.base.errors import BackendUnavailableError
from npumoe.luts import build, layout, spec

HARNESS = "mca_tile.c"
INT8_HARNESS = "mca_i8.c"


@dataclass(frozen=True)
class Cpu:
    name: str
    mcpu: str  # llvm-mca's -mcpu
    ghz: float  # assumed clock of one core


# Arm cores users run npumoe on (Cortex-X1 and -A710 in Snapdragon 888 and 8 Gen 1, Apple M1, Cortex-A55), each by
# the LLVM 16 model that describes it best (X1 is Neoverse V1's core, A710 Neoverse N2's; Apple's cores have only the
# old Cyclone model), at the part's top clock.
NEON_CPUS = (
    Cpu("X1 (SD 888)", "neoverse-v1", 2.84),
    Cpu("A710 (SD 8 Gen 1)", "neoverse-n2", 2.5),
    Cpu("Apple M1 P-core", "apple-m1", 3.2),
    Cpu("A55 (little)", "cortex-a55", 1.8),
)
HOST_ISAS = ("avx512", "avx2")


@dataclass(frozen=True)
class TileEstimate:
    isa: str
    bits: int
    cpu: Cpu
    instructions: int  # in one tile's iteration
    cycles: float  # per tile, llvm-mca's steady state

    @property
    def bytes_per_cycle(self) -> float:
        return self.bits * layout.TILE_BYTES / self.cycles  # a tile's planes: 16 rows × 32 inputs, a bit each

    @property
    def gb_s(self) -> float:
        """Weight bytes one core would stream at the assumed clock."""
        return self.bytes_per_cycle * self.cpu.ghz

    def to_json(self) -> dict:
        return {"isa": self.isa, "bits": self.bits, "cpu": self.cpu.name, "mcpu": self.cpu.mcpu, "ghz": self.cpu.ghz,
                "instructions": self.instructions, "cycles_per_tile": self.cycles,
                "bytes_per_cycle": self.bytes_per_cycle, "gb_s_per_core": self.gb_s}


@dataclass(frozen=True)
class Int8Estimate:
    isa: str
    cpu: Cpu
    rows: int  # activation rows an iteration dots with the tile's codes (the build's I8_ROWS)
    instructions: int
    cycles: float  # per iteration

    @property
    def macs_per_cycle(self) -> float:
        return self.rows * layout.ROWS * layout.TILE_K / self.cycles

    @property
    def gmac_s(self) -> float:
        """Multiply-adds one core would do at the assumed clock."""
        return self.macs_per_cycle * self.cpu.ghz

    def to_json(self) -> dict:
        return {"isa": self.isa, "cpu": self.cpu.name, "mcpu": self.cpu.mcpu, "ghz": self.cpu.ghz, "rows": self.rows,
                "instructions": self.instructions, "cycles_per_tile": self.cycles,
                "macs_per_cycle": self.macs_per_cycle, "gmac_s_per_core": self.gmac_s}


@functools.cache
def llvm_mca() -> str:
    for name in ("llvm-mca-18", "llvm-mca-17", "llvm-mca-16", "llvm-mca"):  # the newest: its models are the better
        if path := shutil.which(name):
            return path
    raise BackendUnavailableError("llvm-mca is not installed; apt-get install llvm-16 (or any LLVM with llvm-mca).")


def _compiler(isa: str) -> tuple[str, ...]:
    if isa != "neon":
        return build.compiler()
    cc = build.CROSS_COMPILERS["aarch64"]
    if not shutil.which(cc):
        raise BackendUnavailableError(f"{cc} is not installed; apt-get install gcc-aarch64-linux-gnu.")
    return (cc,)


@functools.cache
def _region(isa: str, harness: str, *defines: str) -> tuple[str, tuple[str, ...]]:
    """The harness's region as the ISA's build compiles it: its opening marker line and its instructions."""
    flags = (*build.COMMON_FLAGS, "-S", f"-I{build.CSRC}", f'-DNPUMOE_ISA_FILE="{isa}.c"', "-DLUT_PREFETCH_CONSTANT",
             *defines, *build.ISAS[isa][1])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "region.s"
        subprocess.run([*_compiler(isa), *flags, str(build.CSRC / harness), "-o", str(out)], check=True,
                       capture_output=True)
        text = out.read_text()
    marker, *region = text[text.index("LLVM-MCA-BEGIN"):text.index("LLVM-MCA-END")].splitlines()
    return marker, tuple(line for line in region if line.strip() and not re.match(r"\s*(//|#|\.|\S+:)", line))


def tile_region(isa: str, bits: int) -> tuple[str, ...]:
    """The instructions of one LUT-GEMV tile's iteration, as the ISA's build compiles them."""
    return _region(isa, HARNESS, f"-DBITS={bits}")[1]


def int8_region(isa: str) -> tuple[int, tuple[str, ...]]:
    """The int8 GEMM's iteration (one tile's codes × a pass of activation rows): its row count and instructions."""
    marker, region = _region(isa, INT8_HARNESS)
    return int(re.search(r"rows=(\d+)", marker).group(1)), region


def _cycles(isa: str, region: tuple[str, ...], cpu: Cpu, iterations: int) -> float:
    """llvm-mca's steady-state cycles per iteration of the region on the CPU's model."""
    triple = "aarch64-linux-gnu" if isa == "neon" else "x86_64-linux-gnu"
    comment = "//" if isa == "neon" else "#"
    source = "\n".join([f"{comment} LLVM-MCA-BEGIN", *region, f"{comment} LLVM-MCA-END"])
    run = subprocess.run([llvm_mca(), f"-mtriple={triple}", f"-mcpu={cpu.mcpu}", f"-iterations={iterations}"],
                         input=source, capture_output=True, text=True, check=True)
    return int(re.search(r"Total Cycles:\s+(\d+)", run.stdout).group(1)) / iterations


def estimate(isa: str, bits: int, cpu: Cpu, iterations: int = 200) -> TileEstimate:
    region = tile_region(isa, bits)
    return TileEstimate(isa, bits, cpu, len(region), _cycles(isa, region, cpu, iterations))


def int8_estimate(isa: str, cpu: Cpu, iterations: int = 200) -> Int8Estimate:
    rows, region = int8_region(isa)
    return Int8Estimate(isa, cpu, rows, len(region), _cycles(isa, region, cpu, iterations))


def measured_core_gb_s(isa: str, bits: int, size: int = 1024, calls: int = 200) -> float:
    """The ISA's GEMV on one thread, weights hot in cache: what the inner loop streams when memory is no limit."""
    from npumoe.luts.kernels import kernels

    rng = np.random.default_rng(0)
    weight = layout.to_tiles(spec.quantize_pack(rng.standard_normal((size, size), dtype=np.float32), bits, 64))
    x = rng.standard_normal(size, dtype=np.float32)
    lut = kernels(isa)
    return size * size * bits / 8 / _best_seconds(lambda: lut.gemv(weight, x, threads=1), calls) / 1e9


def _best_seconds(run, calls: int) -> float:
    """The fastest of ``calls`` timed runs after an untimed one: the loop's speed when nothing gets in its way."""
    run()
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def measured_int8_gmac_s(isa: str, size: int = 1024, rows: int = 64, calls: int = 50) -> float | None:
    """The ISA's int8 GEMM (int4 weights) on one thread, hot in cache, in multiply-adds a second; None where the
    build has none. It includes what the estimate leaves out: unpacking, quantising the rows, the epilogue."""
    from npumoe.luts.kernels import kernels

    rng = np.random.default_rng(0)
    weight = layout.to_tiles(spec.quantize_pack(rng.standard_normal((size, size), dtype=np.float32), 4, 64))
    x = rng.standard_normal((rows, size), dtype=np.float32)
    lut = kernels(isa)
    if lut.gemm_int8(weight, x, threads=1) is None:
        return None
    return rows * size * size / _best_seconds(lambda: lut.gemm_int8(weight, x, threads=1), calls) / 1e9


def host_check_int8(isa: str) -> dict | None:
    """:func:`host_check` for the int8 GEMM: the clock at which the estimate would give the measured rate."""
    measured = measured_int8_gmac_s(isa)
    if measured is None:
        return None
    est = int8_estimate(isa, Cpu("this machine", "native", 1.0))
    return {"isa": isa, "cycles_per_tile": est.cycles, "macs_per_cycle": est.macs_per_cycle,
            "measured_gmac_s": measured, "implied_ghz": measured / est.macs_per_cycle}


def host_check(isa: str, bits: int) -> dict:
    """The method against a measurement on this machine (llvm-mca -mcpu=native): the clock at which the estimate
    would give the measured rate. A plausible clock (2-5 GHz) says the model describes this core's loop."""
    est = estimate(isa, bits, Cpu("this machine", "native", 1.0))
    measured = measured_core_gb_s(isa, bits)
    return {"isa": isa, "bits": bits, "cycles_per_tile": est.cycles, "bytes_per_cycle": est.bytes_per_cycle,
            "measured_gb_s": measured, "implied_ghz": measured / est.bytes_per_cycle}
