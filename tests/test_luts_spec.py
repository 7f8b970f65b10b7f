"""The numpy spec against first principles: plain per-element formulas and fp64 matmuls."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from npumoe.core.base.errors import InputError, WeightError
from npumoe.luts import spec

FORMATS = [(b, s) for b in spec.BITS for s in (False, True) if not (s and b == 1)]


@st.composite
def packed_weights(draw, max_rows=40, max_groups=3):
    bits, symmetric = draw(st.sampled_from(FORMATS))
    group = draw(st.sampled_from(spec.GROUPS))
    n = draw(st.integers(1, max_rows))
    k = group * draw(st.integers(1, max_groups))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    w = (rng.standard_normal((n, k)) * rng.uniform(0.01, 3)).astype(np.float32)
    return spec.quantize_pack(w, bits, group, symmetric), w, rng


def nmse(y, ref):
    return float(np.mean((np.asarray(y, np.float64) - ref) ** 2) / np.mean(ref**2))


@settings(max_examples=40, deadline=None)
@given(packed_weights())
def test_planes_hold_the_bits_of_the_codes(case):
    packed, _, rng = case
    q = spec.unpack(packed)
    bits, (n, k) = packed.meta.bits, packed.meta.shape
    for _ in range(20):  # idx_i(n, c) bit j is bit i of q[n, 4c + j]; even c in the low nibble
        i, row, col = rng.integers(bits), rng.integers(n), rng.integers(k)
        byte = int(packed.planes[i, row, col // 8])
        nibble = (byte >> (4 * ((col // 4) % 2))) & 15
        assert (nibble >> (col % 4)) & 1 == (int(q[row, col]) >> i) & 1
    assert np.array_equal(spec.codes_from_planes(spec.planes_from_codes(q, bits)), q)


@settings(max_examples=40, deadline=None)
@given(packed_weights())
def test_quantisation_error_is_at_most_half_a_step_and_codes_reproduce(case):
    packed, w, _ = case
    m = packed.meta
    q, deq = spec.unpack(packed), spec.dequantize(packed)
    step = np.repeat(packed.scales.astype(np.float32), m.group, axis=1)
    zeros = np.repeat(packed.zeros.astype(np.int32), m.group, axis=1)
    assert q.max() < 2**m.bits and (not m.symmetric or np.all(packed.zeros == 2 ** (m.bits - 1)))
    # symmetric never clips; the asymmetric zero point is rounded, which can clip by half a step more
    assert np.all(np.abs(w - deq) <= step * (0.5 + 1e-3 if m.symmetric else 1.0) + 1e-30)
    assert np.array_equal(deq, (q.astype(np.float64) - zeros) * step)  # exact in fp32
    assert np.array_equal(np.rint(deq / step) + zeros, q)  # dequantised weights re-quantise to the same codes


@settings(max_examples=40, deadline=None)
@given(packed_weights())
def test_two_level_lut_dequantisation_is_bit_identical(case):
    packed, _, _ = case
    assert np.array_equal(spec.lut_dequantize(packed), spec.dequantize(packed))


def test_repack_table_places_bit_j_at_bit_i_of_byte_j():
    table = spec.repack_table(8)
    for i in range(8):
        for idx in range(16):
            word = int(table[i, idx])
            assert word.to_bytes(4, "little") == bytes(((idx >> j) & 1) << i for j in range(4))


def test_value_tables_bake_in_scale_and_zero():
    scales, zeros = np.array([[0.5, 0.125]], np.float16), np.array([[3, 0]], np.uint8)
    tables = spec.value_tables(scales, zeros, 2)
    assert tables.tolist() == [[[-1.5, -1.0, -0.5, 0.0], [0.0, 0.125, 0.25, 0.375]]]


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 64), st.integers(0, 2**32 - 1))
def test_tables_follow_the_defined_fp32_order_and_mirror(runs, seed):
    x = np.random.default_rng(seed).standard_normal(4 * runs).astype(np.float32) * 10
    table = spec.build_tables(x)
    for c in range(runs):
        x0, x1, x2, x3 = (np.float32(v) for v in x[4 * c: 4 * c + 4])
        for e in range(1, 16, 2):
            t = x0
            for j, xj in ((1, x1), (2, x2), (3, x3)):
                t = np.float32(t + xj) if (e >> j) & 1 else np.float32(t - xj)
            assert table[c, e] == t and table[c, 15 - e] == -t
    assert np.allclose(table[:, 15], x.reshape(-1, 4).sum(1), rtol=1e-5, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(spec.GROUPS), st.integers(1, 4), st.sampled_from(spec.TABLE_BITS), st.integers(0, 2**32 - 1))
def test_table_quantisation_uses_the_full_range_per_group(group, groups, table_bits, seed):
    x = np.random.default_rng(seed).standard_normal(group * groups).astype(np.float32)
    x[:group] = 0  # an all-zero group: zero table, zero scale
    table = spec.build_tables(x)
    tq, t_scales = spec.quantize_tables(table, group, table_bits)
    qmax = spec.TABLE_MAX[table_bits]
    blocks = np.abs(tq.astype(np.int32)).reshape(groups, -1).max(1)
    assert blocks[0] == 0 and t_scales[0] == 0 and np.all(blocks[1:] == qmax)
    step = np.repeat(t_scales, group // 4)[:, None].astype(np.float64)
    err = np.abs(tq * step - table)  # half a step, plus three fp32 roundings (inv, T·inv, the scale) of ≤ amax
    assert np.all(err <= step * (0.5 + 4 * 2.0**-24 * qmax))
    assert np.array_equal(spec.table_sums(tq, group), tq[:, 15].astype(np.int64).reshape(groups, -1).sum(1))


@settings(max_examples=40, deadline=None)
@given(packed_weights())
def test_float_table_lut_gemv_equals_the_dequantised_matvec(case):
    packed, _, rng = case
    m = packed.meta
    x = rng.standard_normal(m.shape[1]).astype(np.float32)
    ref = spec.dequantize(packed).astype(np.float64) @ x
    y = spec.float_lut_gemv(packed, x)
    # relative to the size of what is looked up: each table entry is ±Σ|x| of its run, weighted up to 2^b − 1
    magnitude = (packed.scales.astype(np.float64) * (2**m.bits - 1)) @ np.abs(x).reshape(m.groups, -1).sum(1)
    assert np.all(np.abs(y - ref) <= 1e-6 * magnitude)


@settings(max_examples=25, deadline=None)
@given(packed_weights(max_rows=6, max_groups=2), st.sampled_from(spec.TABLE_BITS))
def test_accumulator_matches_a_direct_sum_over_codes(case, table_bits):
    packed, _, rng = case
    m = packed.meta
    x = rng.standard_normal(m.shape[1]).astype(np.float32)
    tq, _ = spec.quantize_tables(spec.build_tables(x), m.group, table_bits)
    q = spec.unpack(packed).astype(np.int64)
    direct = np.zeros((m.shape[0], m.groups), np.int64)
    for row in range(m.shape[0]):
        for col in range(0, m.shape[1], 4):
            for i in range(m.bits):
                idx = sum(((int(q[row, col + j]) >> i) & 1) << j for j in range(4))
                direct[row, col // m.group] += int(tq[col // 4, idx]) << i
    assert np.array_equal(spec.lut_accumulate(packed.planes, tq, m.group), direct)


@pytest.mark.parametrize("table_bits, limit", [(8, 2e-4), (16, 1e-8)])
@pytest.mark.parametrize("bits, symmetric", [(2, False), (4, False), (4, True), (8, False)])
def test_quantised_table_gemv_is_within_nmse_of_fp32(bits, symmetric, table_bits, limit):
    rng = np.random.default_rng(bits)
    w = rng.standard_normal((256, 1024)).astype(np.float32)
    packed = spec.quantize_pack(w, bits, 64, symmetric)
    x = rng.standard_normal(1024).astype(np.float32)
    ref = spec.dequantize(packed).astype(np.float64) @ x
    assert nmse(spec.lut_gemv(packed, x, table_bits), ref) <= limit


@pytest.mark.parametrize("kwargs, match", [
    (dict(bits=7, group=64), "7-bit weights are not supported"),
    (dict(bits=4, group=48), "group size 48 is not supported"),
    (dict(bits=1, group=64, symmetric=True), "1-bit symmetric"),
])
def test_unsupported_formats_are_refused(kwargs, match):
    with pytest.raises(InputError, match=match):
        spec.quantize(np.zeros((4, 128), np.float32), **kwargs)


def test_k_not_a_multiple_of_the_group_is_refused():
    with pytest.raises(InputError, match="K = 96 inputs is not a multiple of the group size 64"):
        spec.quantize(np.zeros((4, 96), np.float32), 4, 64)


def test_non_finite_weights_and_wrong_activations_are_refused():
    with pytest.raises(InputError, match="inf or NaN"):
        spec.quantize(np.full((4, 64), np.nan, np.float32), 4, 64)
    packed = spec.quantize_pack(np.ones((4, 64), np.float32), 4, 64)
    with pytest.raises(InputError, match="takes 64 inputs"):
        spec.lut_gemv(packed, np.ones(32, np.float32))


def test_corruption_and_mismatched_shapes_are_detected():
    packed = spec.quantize_pack(np.random.default_rng(0).standard_normal((8, 128)).astype(np.float32), 4, 32)
    planes = packed.planes.copy()
    planes[1, 2, 3] ^= 0x10
    with pytest.raises(WeightError, match="checksum mismatch"):
        spec.verify(spec.Packed(packed.meta, planes, packed.scales, packed.zeros))
    with pytest.raises(WeightError, match="packed scales has shape"):
        spec.verify(spec.Packed(packed.meta, packed.planes, packed.scales[:, :2], packed.zeros))
    with pytest.raises(WeightError, match="zero points outside"):
        spec.make_packed(packed.planes, packed.scales, packed.zeros + 16, 4, 32, False)


def test_metadata_is_a_small_frozen_hashable_record():
    packed = spec.quantize_pack(np.ones((3, 64), np.float32), 2, 32)
    m = packed.meta
    assert (m.bits, m.group, m.symmetric, m.shape, m.groups) == (2, 32, False, (3, 64), 2)
    assert {m: 1}[spec.PackedMeta(**vars(m))] == 1
    with pytest.raises(AttributeError):
        m.bits = 4
