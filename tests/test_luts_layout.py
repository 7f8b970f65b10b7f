"""The kernels' tile arrangement: a lossless permutation of the spec's bit-serial planes."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from npumoe.core.base.errors import WeightError
from npumoe.luts import layout, spec


@st.composite
def packed_weights(draw):
    bits = draw(st.sampled_from(spec.BITS))
    symmetric = bits > 1 and draw(st.booleans())
    group = draw(st.sampled_from(spec.GROUPS))
    n, k = draw(st.integers(1, 50)), group * draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return spec.quantize_pack(rng.standard_normal((n, k)).astype(np.float32), bits, group, symmetric), rng


@settings(max_examples=40, deadline=None)
@given(packed_weights())
def test_tiles_round_trip_and_hold_the_documented_bytes(case):
    packed, rng = case
    tiled = layout.to_tiles(packed)
    back = layout.from_tiles(tiled)
    for name in ("planes", "scales", "zeros"):
        assert np.array_equal(getattr(back, name), getattr(packed, name))
    idx = spec.indices_from_planes(packed.planes)  # [b, N, K/4]
    n, k = packed.meta.shape
    for _ in range(20):  # byte 16p + r of tile (rb, t, i): low nibble run 8t + p, high nibble run 8t + 4 + p
        i, row, t, p = rng.integers(packed.meta.bits), rng.integers(n), rng.integers(k // 32), rng.integers(4)
        byte = tiled.tiles[row // 16, t, i, 16 * p + row % 16]
        assert (byte & 15, byte >> 4) == (idx[i, row, 8 * t + p], idx[i, row, 8 * t + 4 + p])
    assert tiled.scales[row // 16, 0, row % 16] == packed.scales[row, 0]
    assert (tiled.zeros is None) == packed.meta.symmetric


def test_padding_rows_are_zero_codes_with_zero_scale():
    packed = spec.quantize_pack(np.ones((17, 64), np.float32), 4, 64)
    tiled = layout.to_tiles(packed)
    assert tiled.row_blocks == 2 and not np.any(tiled.scales[1, :, 1:]) and not np.any(tiled.zeros[1, :, 1:])


def test_altered_tiles_and_wrong_shapes_are_refused():
    packed = spec.quantize_pack(np.random.default_rng(0).standard_normal((20, 128)).astype(np.float32), 2, 32)
    tiled = layout.to_tiles(packed)
    tiles = tiled.tiles.copy()
    tiles[0, 1, 0, 5] ^= 1
    altered = layout.TiledWeight(tiled.bits, tiled.group, tiled.shape, tiles, tiled.scales, tiled.zeros,
                                 tiled.checksum)
    with pytest.raises(WeightError, match="checksum mismatch"):
        layout.from_tiles(altered)
    wrong = layout.TiledWeight(tiled.bits, tiled.group, (20, 256), tiled.tiles, tiled.scales, tiled.zeros)
    with pytest.raises(WeightError, match="tiled tiles is uint8"):
        wrong.check()
