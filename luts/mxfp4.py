"""MXFP4 codes (gpt-oss's experts) as npumoe 5-bit weights, value for value.

An MXFP4 row holds blocks of 32 FP4 E2M1 codes, two per byte with the low nibble first, and one
E8M0 scale byte e per block: w = v · 2^(e − 127). E2M1 values v are {0, ±0.5, ±1, ±1.5, ±2, ±3,
±4, ±6}, so 2·v is an integer in [−12, 12], and the symmetric 5-bit codes q = 2·v + 16 (z = 16)
with group 32 and scale s = 2^(e − 128) give s · (q − z) = w exactly: no second rounding.

The npumoe format stores float16 scales, which hold 2^(e − 128) exactly only for e − 128 in
[−24, 15] (the subnormal 2^−24 up to 2^15). A matrix with any block outside that range has no
exact npumoe form (:func:`exact_in_fp16` says which), and the caller keeps it widened.

Cost: 5 planes plus an fp16 scale per 32 weights is 5.5 bits a weight, against MXFP4's 4.25 as
stored; a kernel reading the E2M1 codes through a 16-entry codebook would keep 4.25.
"""

from __future__ import annotations

import numpy as np

from npumoe.core.base.errors import WeightError
from npumoe.luts import spec

# FP4 E2M1: sign, 2 exponent bits, 1 mantissa bit; one E8M0 scale per block of MX_BLOCK values
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MX_BLOCK = 32
BITS = 5
ZERO = 2 ** (BITS - 1)
CODES = (ZERO + 2 * np.asarray(FP4_VALUES)).astype(np.uint8)  # 5-bit code of each E2M1 nibble
SCALE_BIAS = 128  # E8M0's bias 127, plus one because the codes hold 2·v
FP16_EXPONENTS = (-24, 15)  # 2^x is exact in float16 from the smallest subnormal to here


def _plane_bytes() -> np.ndarray:
    """For each byte pair (four E2M1 codes, one run of the bit-serial layout): the 4-bit index of each
    of the five planes, plane i in byte i of a uint64 (spec: idx_i = Σ_j bit i of q_j << j)."""
    pair = np.arange(2**16, dtype=np.uint16)
    codes = CODES[(pair[:, None] >> np.arange(0, 16, 4, dtype=np.uint16)) & 0x0F]  # [65536, 4], low nibble first
    index = ((codes[:, None, :] >> np.arange(BITS)[None, :, None]) & 1) << np.arange(4)  # [65536, plane, j]
    return (index.sum(-1).astype(np.uint64) << (8 * np.arange(BITS, dtype=np.uint64))).sum(-1, dtype=np.uint64)


PLANE_BYTES = _plane_bytes()


def exact_in_fp16(scales: np.ndarray) -> bool:
    """Whether every E8M0 scale byte's 2^(e − 128) is a float16 value."""
    exponents = scales.astype(np.int32) - SCALE_BIAS
    return bool(exponents.min(initial=0) >= FP16_EXPONENTS[0] and exponents.max(initial=0) <= FP16_EXPONENTS[1])


def from_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> spec.Packed:
    """The matrix [N, G·32] that MXFP4 blocks [N, G, 16] (uint8) and E8M0 scales [N, G] (uint8) hold,
    as 5-bit symmetric group-32 codes.

    The planes come from a table over byte pairs (four codes, one run of every plane) rather than
    through :func:`spec.pack`'s bit-by-bit route, several times faster (docs/performance.md, "MXFP4
    packing"), and gpt-oss-20b has 19 G expert weights. Tests check the values against transformers'.
    """
    if not exact_in_fp16(scales):
        raise WeightError("an MXFP4 scale is outside float16's powers of two (2^-24 to 2^15), so the matrix has "
                          "no exact 5-bit form; keep it widened (npumoe.load does).")
    n = blocks.shape[0]
    pairs = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(n, -1).view("<u2")  # [N, K/4]: one run each
    words = PLANE_BYTES[pairs[:, 0::2]] | (PLANE_BYTES[pairs[:, 1::2]] << np.uint64(4))  # runs 2c | 2c + 1
    plane_bytes = words.astype("<u8", copy=False).view(np.uint8).reshape(n, -1, 8)[..., :BITS]  # [N, K/8, b]
    planes = plane_bytes.transpose(2, 0, 1)
    exponents = scales.astype(np.int32) - SCALE_BIAS
    fp16_scales = np.ldexp(np.float32(1), exponents).astype(np.float16)
    return spec.make_packed(planes, fp16_scales, np.full(fp16_scales.shape, ZERO, np.uint8), BITS, MX_BLOCK,
                            symmetric=True)
