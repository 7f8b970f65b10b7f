"""The llvm-mca estimate behind `npumoe bench neon`: it analyses the NEON kernel's real inner loop."""

import pytest

from npumoe.errors import BackendUnavailableError
from npumoe.luts import estimate


@pytest.fixture(scope="module")
def regions():
    try:
        estimate.llvm_mca()
        return {bits: estimate.tile_region("neon", bits) for bits in (4, 2)}
    except BackendUnavailableError as err:
        pytest.skip(str(err))


def test_the_region_is_the_neon_tile_loop(regions):
    """One tile's planes: one de-interleaving ld4 and 8 one-register lookups per plane, no four-register tbl."""
    for bits, region in regions.items():
        ops = [line.split()[0] for line in region]
        assert ops.count("ld4") == bits and ops.count("tbl") == 8 * bits
        assert not any("tbl" in line and "-" in line.split("}")[0] for line in region)  # tbl {v0-v3}: 4 registers


def test_cycles_scale_with_the_planes(regions):
    """On every core model: half the planes, about half the cycles, and cycles within what the core can issue."""
    for cpu in estimate.NEON_CPUS:
        four, two = estimate.estimate("neon", 4, cpu), estimate.estimate("neon", 2, cpu)
        assert four.instructions == len(regions[4]) and two.instructions == len(regions[2])
        assert 0.4 < two.cycles / four.cycles < 0.6
        assert four.instructions / 8 < four.cycles < four.instructions * 2  # 1/8 to 2 cycles an instruction
