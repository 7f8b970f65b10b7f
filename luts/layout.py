"""The kernels' tiled arrangement of a packed weight: the same bits, permuted for SIMD.

One tile is 64 bytes: 16 output rows × 32 inputs of one bit plane. Byte 16p + r holds,
for row r of the block, the plane's 4-bit index of run c = 8t + p in its low nibble and
of run c = 8t + 4 + p in its high nibble (t = the tile's position along K). So each
16-byte quarter of a plane is one byte position p of all 16 rows, and all its nibbles
index the same two 16-entry tables: a 16-entry lookup (AVX2 `vpshufb` per 128-bit lane,
NEON one-register `tbl`) serves a whole quarter. AVX-512 turns a plane into row order
with one `vpermb` (four bytes a row in each 32-bit lane), looks up 64 entries with one
more and sums them per row with one 4-way dot product (`vpdpbusd`), the plane weight 2^i
as its multiplier. (Row order in memory, byte 4r + p, suited AVX-512 alone: AVX2 spent
six shuffles a plane regrouping it and fell well short of the read bandwidth; docs/performance.md,
"LUT-GEMV on AVX2".) The layout
does not depend on the bit width or the group size, so one layout serves every kernel
and every format.

Arrays (NB = ceil(N / 16); rows past N are zero codes with zero scale):
    tiles  [NB, K/32, b, 64] uint8
    scales [NB, K/group, 16] float16
    zeros  [NB, K/group, 16] uint8, or None for symmetric weights (z = 2^(b−1))
"""

from __future__ import annotations

import ctypes
import functools
import zlib
from dataclasses import dataclass

import numpy as np

from npumoe.core.base.errors import WeightError
from npumoe.luts import spec

ROWS = 16
TILE_K = 32
TILE_BYTES = 64


class NativeWeight(ctypes.Structure):
    """``lut_weight`` of csrc/lut.h: the addresses and format of a :class:`TiledWeight`."""

    _fields_ = [("tiles", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("zeros", ctypes.c_void_p),
                ("row_blocks", ctypes.c_int), ("k", ctypes.c_int), ("bits", ctypes.c_int), ("group", ctypes.c_int)]


@dataclass(frozen=True, eq=False)
class TiledWeight:
    bits: int
    group: int
    shape: tuple[int, int]  # (N, K)
    tiles: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray | None
    checksum: str = ""  # of the packed weight it came from; empty when rebuilt from bare arrays

    @property
    def row_blocks(self) -> int:
        return _row_blocks(self.shape[0])

    @property
    def groups(self) -> int:
        return self.shape[1] // self.group

    def check(self, fix: str = "re-tile it with npumoe.luts.layout.to_tiles") -> None:
        """Raise WeightError unless the arrays have the shapes and dtypes the format implies (``fix`` ends it)."""
        spec.check_format(self.bits, self.group, self.shape[1])
        nb, k = self.row_blocks, self.shape[1]
        expected = {"tiles": ((nb, k // TILE_K, self.bits, TILE_BYTES), np.uint8),
                    "scales": ((nb, self.groups, ROWS), np.float16)}
        if self.zeros is not None:
            expected["zeros"] = ((nb, self.groups, ROWS), np.uint8)
        for name, (shape, dtype) in expected.items():
            a = getattr(self, name)
            if a.shape != shape or a.dtype != dtype or not a.flags.c_contiguous:
                raise WeightError(f"tiled {name} is {a.dtype}{list(a.shape)} but a {self.bits}-bit {self.shape[0]}×{k} "
                                  f"weight with group {self.group} needs contiguous {np.dtype(dtype)}{list(shape)}; "
                                  f"{fix}.")

    @functools.cached_property
    def native(self) -> NativeWeight:
        """This weight as the kernels' ``lut_weight``, built once after :meth:`check`.

        A decode step calls a kernel per expert matrix, with the weight's Python objects cold in
        cache: handing over one prepared struct instead of reading seven fields (and three numpy
        addresses) per call keeps the call's own cost small against the GEMV (docs/performance.md,
        "Call overhead"). A frozen weight's arrays do not move, and the struct lives as long as the weight.
        """
        self.check()
        nb, k = self.row_blocks, self.shape[1]
        return NativeWeight(self.tiles.ctypes.data, self.scales.ctypes.data,
                            None if self.zeros is None else self.zeros.ctypes.data, nb, k, self.bits, self.group)

    def __getstate__(self) -> dict:
        """Pickled without the native struct: its addresses are this process's arrays, not the copy's."""
        return {key: value for key, value in self.__dict__.items() if key != "native"}

    @property
    def nbytes(self) -> int:
        """Bytes a kernel streams per pass over the weight."""
        return sum(a.nbytes for a in (self.tiles, self.scales, self.zeros) if a is not None)


def _row_blocks(n: int) -> int:
    return -(-n // ROWS)


def _pad_rows(a: np.ndarray, rows: int, axis: int) -> np.ndarray:
    pad = [(0, 0)] * a.ndim
    pad[axis] = (0, rows - a.shape[axis])
    return np.pad(a, pad)


def _blocked(per_group: np.ndarray, nb: int) -> np.ndarray:
    """[N, G] → [NB, G, 16], zero-padded rows."""
    return np.ascontiguousarray(_pad_rows(per_group, nb * ROWS, 0).reshape(nb, ROWS, -1).transpose(0, 2, 1))


def to_tiles(packed: spec.Packed) -> TiledWeight:
    spec.verify(packed)
    m = packed.meta
    n, k = m.shape
    nb = _row_blocks(n)
    idx = _pad_rows(spec.indices_from_planes(packed.planes), nb * ROWS, 1)  # [b, NB·16, K/4]
    idx = idx.reshape(m.bits, nb, ROWS, k // TILE_K, 2, 4)  # run c = 8t + 4h + p → (t, h, p)
    tile_bytes = idx[..., 0, :] | (idx[..., 1, :] << 4)  # [b, NB, r, t, p]
    tiles = np.ascontiguousarray(tile_bytes.transpose(1, 3, 0, 4, 2)).reshape(nb, k // TILE_K, m.bits, TILE_BYTES)
    zeros = None if m.symmetric else _blocked(packed.zeros, nb)
    return TiledWeight(m.bits, m.group, m.shape, tiles, _blocked(packed.scales, nb), zeros, m.checksum)


def tiles_checksum(tiled: TiledWeight) -> str:
    """crc32 of the format and the tiled arrays, read in place (a mapped checkpoint's pages are not copied): what a
    stored tiled weight is checked against at load. ``TiledWeight.checksum`` is the packed form's, which only a
    conversion back (:func:`from_tiles`) can check."""
    n, k = tiled.shape
    crc = zlib.crc32(np.asarray([tiled.bits, tiled.group, int(tiled.zeros is None), n, k], dtype="<i8").tobytes())
    for a in (tiled.tiles, tiled.scales, tiled.zeros):
        if a is not None:
            crc = zlib.crc32(np.ascontiguousarray(a).data, crc)
    return f"{crc:08x}"


def tiled_bytes(bits: int, group: int, shape: tuple[int, int], symmetric: bool) -> dict[str, int]:
    """Bytes of each array of a tiled [N, K] weight (rows padded to a block of 16)."""
    nb, k = _row_blocks(shape[0]), shape[1]
    blocked = nb * (k // group) * ROWS
    return {"tiles": nb * (k // TILE_K) * bits * TILE_BYTES, "scales": 2 * blocked} | ({} if symmetric else
                                                                                        {"zeros": blocked})


BLOCK_ROWS = 4096  # rows quantised at a time by quantize_tiles: an LM head's temporaries are GBs whole


def quantize_tiles(rows, shape: tuple[int, int], bits: int, group: int, symmetric: bool = False) -> TiledWeight:
    """``to_tiles(spec.quantize_pack(W))`` of W [N, K] read :data:`BLOCK_ROWS` rows at a time (``rows(start, stop)``
    gives them as fp32): quantisation is per row and tiling per 16 rows, so the result is the same and memory holds
    one block's temporaries. The result carries no packed checksum (:func:`tiles_checksum` is its own)."""
    n, k = shape
    blocks = [to_tiles(spec.quantize_pack(rows(start, min(start + BLOCK_ROWS, n)), bits, group, symmetric))
              for start in range(0, n, BLOCK_ROWS)]
    zeros = None if symmetric else np.concatenate([b.zeros for b in blocks])
    return TiledWeight(bits, group, (n, k), np.concatenate([b.tiles for b in blocks]),
                       np.concatenate([b.scales for b in blocks]), zeros)


def from_tiles(tiled: TiledWeight) -> spec.Packed:
    """The inverse of :func:`to_tiles`, checked against the source's checksum when it has one."""
    tiled.check()
    n, k = tiled.shape
    nb, bits = tiled.row_blocks, tiled.bits
    t = tiled.tiles.reshape(nb, k // TILE_K, bits, 4, ROWS).transpose(2, 0, 4, 1, 3)  # [b, NB, r, t, p]
    idx = np.stack([t & 0x0F, t >> 4], axis=-2).reshape(bits, nb * ROWS, k // 4)[:, :n]
    planes = idx[..., 0::2] | (idx[..., 1::2] << 4)

    def unblocked(a):
        return a.transpose(0, 2, 1).reshape(nb * ROWS, -1)[:n]

    zeros = np.full((n, tiled.groups), 2 ** (bits - 1), np.uint8) if tiled.zeros is None else unblocked(tiled.zeros)
    packed = spec.make_packed(planes, unblocked(tiled.scales), zeros, bits, tiled.group, tiled.zeros is None)
    if tiled.checksum and packed.meta.checksum != tiled.checksum:
        raise WeightError(f"tiled weight checksum mismatch (expected {tiled.checksum}, got {packed.meta.checksum}): "
                          "the tiles were altered or corrupted; re-tile from the packed weight.")
    return packed
