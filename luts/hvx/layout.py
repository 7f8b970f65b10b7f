"""The HVX tile layout: the canonical bit-serial planes permuted for 128-byte VLUT16.

One vector is one bit plane × one run pair × 128 rows: byte j holds row ``ROW_OF_BYTE[j]``
of the block with the plane's 4-bit index of run 2p in its low nibble and of run 2p + 1
in its high nibble — exactly the canonical byte ``planes[i, n, c // 2]``, so the repack is
a pure gather. VLUT16 sends even bytes to its low output vector and odd bytes to its high
one, and the widening add sends even halfwords to the low vector of its pair and odd ones
to the high; ``ROW_OF_BYTE`` (quarters 0, 2, 1, 3 for j mod 4) makes the four int32
accumulator vectors hold rows 0–31, 32–63, 64–95 and 96–127 in order.

Arrays (NB = ceil(N / 128); padded rows have zero codes and zero scale):
    tiles  [NB, G, b, group/8, 128] uint8
    scales [NB, G, 128] float32 (the float16 scales, widened exactly)
    zeros  [NB, G, 128] uint8
Activation tables are [K/16, 64] int16: entry e of run 4q + t at halfword
2·(16·(t & 1) + e) + (t >> 1) of vector q, where VLUT16 with selector Rt = t reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from npumoe.core.base.errors import WeightError
from npumoe.luts import spec

ROWS = 128
_J = np.arange(ROWS)
ROW_OF_BYTE = 32 * np.array([0, 2, 1, 3])[_J % 4] + _J // 4
TABLE_SLOT = np.array([[2 * (16 * (t & 1) + e) + (t >> 1) for e in range(16)] for t in range(4)])  # [t, e]


@dataclass(frozen=True, eq=False)
class HvxWeight:
    bits: int
    group: int
    shape: tuple[int, int]  # (N, K)
    tiles: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray

    @property
    def row_blocks(self) -> int:
        return self.tiles.shape[0]

    @property
    def groups(self) -> int:
        return self.shape[1] // self.group


def _padded(a: np.ndarray, rows: int, axis: int) -> np.ndarray:
    pad = [(0, 0)] * a.ndim
    pad[axis] = (0, rows - a.shape[axis])
    return np.pad(a, pad)


def repack(packed: spec.Packed) -> HvxWeight:
    """Canonical planes, scales and zeros → the HVX arrays."""
    m = packed.meta
    if m.bits not in spec.BITS or m.group not in spec.GROUPS:
        raise WeightError(f"the HVX kernel has no block for {m.bits}-bit weights with group {m.group}.")
    nb = -(-m.shape[0] // ROWS)
    planes = _padded(packed.planes, nb * ROWS, 1).reshape(m.bits, nb, ROWS, m.groups, m.group // 8)
    tiles = planes[:, :, ROW_OF_BYTE].transpose(1, 3, 0, 4, 2)
    per_row = {name: _padded(a, nb * ROWS, 0).reshape(nb, ROWS, m.groups).transpose(0, 2, 1)
               for name, a in (("scales", packed.scales.astype(np.float32)), ("zeros", packed.zeros))}
    return HvxWeight(m.bits, m.group, m.shape, np.ascontiguousarray(tiles),
                     np.ascontiguousarray(per_row["scales"]), np.ascontiguousarray(per_row["zeros"]))


def planes(w: HvxWeight) -> np.ndarray:
    """The HVX tiles back to canonical planes [b, N, K/8] (the inverse of :func:`repack`'s gather)."""
    nb, groups, bits, pairs, _ = w.tiles.shape
    out = np.empty((bits, nb, ROWS, groups, pairs), np.uint8)
    out[:, :, ROW_OF_BYTE] = w.tiles.transpose(2, 0, 4, 1, 3)
    return out.reshape(bits, nb * ROWS, groups * pairs)[:, : w.shape[0]]


def accumulators(acc: np.ndarray, w: HvxWeight) -> np.ndarray:
    """The kernel's A [NB, G, 128] → the spec's A [N, G]."""
    return acc.reshape(w.row_blocks, w.groups, ROWS).transpose(0, 2, 1).reshape(-1, w.groups)[: w.shape[0]]


def spec_tables(hvx_tables: np.ndarray) -> np.ndarray:
    """Tables in VLUT16 register order [K/16, 64] → the spec's order [K/4, 16]."""
    return hvx_tables.reshape(-1, 64)[:, TABLE_SLOT].reshape(-1, 16)


def hvx_tables(tq: np.ndarray) -> np.ndarray:
    """The spec's tables [K/4, 16] → VLUT16 register order [K/16, 64]."""
    out = np.empty((tq.shape[0] // 4, 64), tq.dtype)
    out[:, TABLE_SLOT] = tq.reshape(-1, 4, 16)
    return out
