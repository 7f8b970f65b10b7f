"""The HVX LUT-GEMV under qemu-hexagon against luts/spec.py (int16-table variant), plus the
repack round trip, VLUT16's lane layout and the instruction counts the cost model uses."""

import numpy as np
import pytest

from npumoe.luts import spec
from npumoe.luts.hvx import build, cost, driver, layout

MISSING = driver.missing()
emulated = pytest.mark.skipif(MISSING is not None, reason=f"HVX emulation: {MISSING}")

# (bits, group, N, K, symmetric): int2/int4 × group 64/128 on 1024×1024, then random shapes.
rng_shapes = np.random.default_rng(6)
GEMV_CASES = [(bits, group, 1024, 1024, False) for bits in (2, 4) for group in (64, 128)] + [
    (int(rng_shapes.choice([2, 4])), group, 128 * int(rng_shapes.integers(1, 6)),
     group * int(rng_shapes.integers(1, 9)), bool(rng_shapes.integers(2))) for group in (64, 128, 64, 128)] + [
    (1, 32, 256, 96, False), (3, 64, 200, 192, True), (5, 32, 130, 160, True),  # other widths, padded rows
    (6, 64, 140, 128, False), (8, 128, 128, 256, False)]


def make(bits, group, n, k, symmetric, seed=0):
    rng = np.random.default_rng(seed)
    return spec.quantize_pack(rng.standard_normal((n, k), dtype=np.float32), bits, group, symmetric), rng


@pytest.mark.parametrize("case", [(4, 64, 256, 128), (2, 128, 130, 384), (3, 32, 1, 64), (5, 32, 200, 96),
                                  (8, 64, 129, 64)], ids=str)
def test_repack_round_trips_and_is_a_gather_of_canonical_bytes(case):
    bits, group, n, k = case
    packed, _ = make(bits, group, n, k, False)
    w = layout.repack(packed)
    assert np.array_equal(layout.planes(w), packed.planes)
    nb, g, i, p, j = 1 if n > 128 else 0, k // group - 1, bits - 1, group // 8 - 1, 5
    row = nb * 128 + layout.ROW_OF_BYTE[j]
    if row < n:
        assert w.tiles[nb, g, i, p, j] == packed.planes[i, row, g * group // 8 + p]
    assert np.array_equal(layout.accumulators(w.scales.reshape(-1), w), packed.scales.astype(np.float32))


def test_row_of_byte_is_a_permutation_and_tables_round_trip():
    assert sorted(layout.ROW_OF_BYTE) == list(range(128))
    tq = np.random.default_rng(1).integers(-32767, 32768, (32, 16)).astype(np.int16)
    assert np.array_equal(layout.spec_tables(layout.hvx_tables(tq)), tq)


def vlut16_nomatch_model(indices, table, rt):
    """The ISA's pseudo-code for Vdd.h = vlut16(Vu.b, Vv.h, Rt):nomatch with 128-byte vectors."""
    out = np.empty((2, 64), np.int16)
    for i in range(64):
        for half in (0, 1):  # byte 2i feeds the low vector, byte 2i + 1 the high one
            idx = (indices[2 * i + half] & 0x0F) | ((rt & 0x0F) << 4)
            out[half, i] = table[2 * (idx % 32) + ((rt >> 1) & 1)]  # word idx % 32, halfword (Rt >> 1) & 1
    return out


@emulated
@pytest.mark.parametrize("rt", [0, 1, 2, 3, 5, 14])
def test_vlut16_layout_matches_the_isa_and_the_table_slots(rt):
    rng = np.random.default_rng(rt)
    indices = rng.integers(0, 256, 128, dtype=np.uint8)  # upper nibbles set: :nomatch must ignore them
    table = rng.integers(-32768, 32768, 64).astype(np.int16)
    out = driver.probe(indices, table, rt)
    assert np.array_equal(out, vlut16_nomatch_model(indices, table, rt))
    slots = layout.TABLE_SLOT[rt & 3][indices & 15]  # the layout the kernel's tables are written in
    assert np.array_equal(out[0], table[slots[0::2]]) and np.array_equal(out[1], table[slots[1::2]])


def check_gemv(packed, x, result):
    group = packed.meta.group
    tq, t_scales = spec.quantize_tables(spec.build_tables(x), group, 16)
    assert np.array_equal(result.tables, tq) and np.array_equal(result.t_scales, t_scales)
    assert np.array_equal(result.xq, spec.table_sums(tq, group))
    acc = spec.lut_accumulate(packed.planes, tq, group)
    assert np.array_equal(result.reference_acc, acc), "the scalar C model disagrees with the spec"
    assert np.array_equal(result.acc, acc), "the HVX kernel disagrees with the spec"
    ref = spec.lut_gemv(packed, x, 16)
    assert np.allclose(result.y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@emulated
@pytest.mark.parametrize("case", GEMV_CASES, ids=str)
def test_gemv_is_bit_exact_to_the_spec(case):
    packed, rng = make(*case, seed=hash(case) % 2**32)
    w = layout.repack(packed)
    x = rng.standard_normal(case[3], dtype=np.float32)
    check_gemv(packed, x, driver.gemv(w, x, reference=True))


@emulated
def test_table_quantisation_is_exact_at_extreme_magnitudes():
    """Zero groups (scale 0), subnormal table scales and huge activations: the harness's own division."""
    packed, rng = make(4, 32, 128, 192, False)
    x = rng.standard_normal(192, dtype=np.float32)
    x[:32], x[32:64], x[64:96] = 0, x[32:64] * np.float32(2e-35), x[64:96] * np.float32(1e30)
    result = driver.gemv(layout.repack(packed), x, reference=True)
    assert result.t_scales[0] == 0 and 0 < result.t_scales[1] < np.finfo(np.float32).tiny
    check_gemv(packed, x, result)


@pytest.mark.skipif(MISSING is not None, reason=f"HVX build: {MISSING}")
@pytest.mark.parametrize("bits,group", [(4, 64), (2, 64), (4, 128), (2, 128)])
def test_counted_instructions_are_one_vlut16_per_128_lookups(bits, group):
    counts = cost.gemv_counts(build.harness(), 4096, 4096, bits, group)
    lookups = bits * 4096 // 4 * 4096  # one per plane, run and row
    assert counts["vlut16"] * 128 == lookups and counts["widening_add"] == counts["vlut16"]
    assert counts["vector_load"] >= counts["vlut16"] // 2 + counts["blocks"] * group // 16  # indices + tables
    assert counts["packets"] >= counts["vlut16"]  # one VLUT16 per packet at most
    estimate = cost.estimate(counts, 4096, 4096, bits, group, cost.DEVICES[0])
    assert estimate["memory_us"] == pytest.approx(cost.weight_bytes(4096, 4096, bits, group) / 59e3)
