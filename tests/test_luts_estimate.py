"""The llvm-mca estimate behind `npumoe bench neon`: it analyses the NEON kernel's real inner loop."""

import pytest

from npumoe.core.base.errors import BackendUnavailableError
from npumoe.luts import estimate


@pytest.fixture(scope="module")
def regions():
    try:
        estimate.llvm_mca()
        return {bits: estimate.tile_region("neon", bits) for bits in (4, 2)}
    except BackendUnavailableError as err:
        pytest.skip(str(err))


def test_the_region_is_the_neon_tile_loop(regions):
    """One tile's planes: 8 one-register lookups per plane, no four-register tbl, and the plane's 64 bytes read
    with plain q-register loads (its quarters are byte positions already: no de-interleaving ld4)."""
    for bits, region in regions.items():
        ops = [line.split()[0] for line in region]
        assert ops.count("tbl") == 8 * bits and "ld4" not in ops
        quarters = set()  # 16-byte offsets into the tile (x0) that q-register loads read
        for line in region:
            op, *args = line.replace(",", " ").replace("[", " ").replace("]", " ").split()
            if op in ("ldp", "ldr") and "x0" in args:
                at = int(args[-1]) if args[-1].isdigit() else 0
                quarters |= {at + 16 * q for q in range(2 if op == "ldp" else 1)}
        assert quarters == set(range(0, 64 * bits, 16))
        assert not any("tbl" in line and "-" in line.split("}")[0] for line in region)  # tbl {v0-v3}: 4 registers


def test_cycles_scale_with_the_planes(regions):
    """On every core model: half the planes, about half the cycles, and cycles within what the core can issue."""
    for cpu in estimate.NEON_CPUS:
        four, two = estimate.estimate("neon", 4, cpu), estimate.estimate("neon", 2, cpu)
        assert four.instructions == len(regions[4]) and two.instructions == len(regions[2])
        assert 0.4 < two.cycles / four.cycles < 0.6
        assert four.instructions / 8 < four.cycles < four.instructions * 2  # 1/8 to 2 cycles an instruction


def test_the_int8_region_is_the_sdot_loop(regions):
    """The int8 GEMM's iteration is its dot products: one sdot (16 multiply-adds) per code vector and activation row,
    as many as the region's rows × 16 outputs × 32 inputs, each code vector loaded once for all the rows."""
    rows, region = estimate.int8_region("neon")
    ops = [line.split()[0] for line in region]
    assert ops.count("sdot") * 16 == rows * 16 * 32 and "fmla" not in ops
    loaded = sum(2 if op == "ldp" else 1 for op in ops if op in ("ldr", "ldp"))  # q registers
    assert loaded < rows * 32  # row by row, every row reloads the tile's 32 code vectors


def test_int8_cycles_are_within_what_the_cores_issue(regions):
    """On every core model: at most four sdots a cycle, at least one instruction every two cycles, and the
    multiply-adds per cycle the estimate reports are the region's own."""
    rows, region = estimate.int8_region("neon")
    for cpu in estimate.NEON_CPUS:
        e = estimate.int8_estimate("neon", cpu)
        assert e.rows == rows and e.instructions == len(region)
        assert rows * 32 / 4 <= e.cycles < e.instructions * 2
        assert e.macs_per_cycle == pytest.approx(rows * 16 * 32 / e.cycles)
