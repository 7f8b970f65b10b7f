"""One packed weight → the arrays Core ML's and QNN/ONNX's quantised-weight ops take.

The npumoe format dequantises w[n, k] = s[n, g] · (q[n, k] − z[n, g]), g = k // group, with
codes q and zero points z in [0, 2^b) and float16 scales s. Each target below reproduces
those values exactly (bit for bit in fp32; with fp16 arrays, the fp16 rounding of them),
so the CPU kernels, the ANE and the Hexagon NPU all run the same weights.

Core ML ``constexpr_blockwise_shift_scale`` (iOS 18): output = scale · (data − offset), the
block size implied by data.shape / scale.shape, so [N, K/group] scales give blocks of
1 × group.
    data    int4 (b ≤ 4) or int8 (b = 5, 6, 8), [N, K]: q − 2^(D−1), D = 4 or 8 the stored width
    offset  same type, [N, K/group]: z − 2^(D−1)
    scale   [N, K/group]: s
  Symmetric weights drop the offset and store data = q − z (signed, zero-centred); the QDQ
  form below does the same with zero points of 0.

Core ML ``constexpr_lut_to_dense`` (iOS 18): output[n, k] = lut[n, k // group, indices[n, k], 0],
one palette per block of 1 × group (the leading lut dims divide the indices' dims).
    indices uint{P} [N, K]: q, P = b except 5 → 6 (Core ML has no uint5)
    lut     [N, K/group, 2^P, 1]: the level-2 value table V[n, g, v] = s · (v − z)
            (spec.value_tables), so the palette *is* npumoe's per-group table (at b = 5
            padded with 32 zero entries no code reaches).

ONNX ``DequantizeLinear`` (opset 21, blocked) as QNN's QDQ weights: y = (x − zero_point) ·
scale along ``axis`` = 1 in blocks of ``block_size`` = group.
    x           int4 (b ≤ 4) or int8 (b = 5, 6, 8), [N, K]: q − 2^(D−1)
    zero_point  same type, [N, K/group]: z − 2^(D−1) (symmetric: x = q − z, zero points 0)
    scale       [N, K/group]: s
  Per-channel (``axis`` = 0, scale and zero point [N]) exists when every group of a row
  shares one scale and zero point; QNN's HTP takes int4 weights with zero point 0 only,
  i.e. symmetric 4-bit tensors (:func:`qdq_symmetric_int4` says which ones qualify).

Which codes: :data:`NPU_INT4` is the one int4 format every target holds (the ANE's int4 packages,
the HTP's w4a16 QDQ weights, and ``npumoe quantize --bits 4 --group 32 --symmetric`` for the CPU),
:data:`NPU_PALETTES` the ANE's palettes (``npumoe quantize --bits 4|2``), so a cross-vendor
comparison at a given precision compares devices, not quantisers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from npumoe.core.base.errors import InputError
from npumoe.luts import spec


@dataclass(frozen=True)
class BlockwiseShiftScale:
    """Inputs of Core ML's constexpr_blockwise_shift_scale; ``dtype`` names data's (and offset's) type."""

    data: np.ndarray
    scale: np.ndarray
    offset: np.ndarray | None
    dtype: str  # "int4" or "int8" (values held in int8 arrays)


@dataclass(frozen=True)
class LutToDense:
    """Inputs of Core ML's constexpr_lut_to_dense (scalar palettes, one per 1 × group block)."""

    indices: np.ndarray
    lut: np.ndarray
    dtype: str  # "uint1" … "uint8" (no uint5): the indices' type


@dataclass(frozen=True)
class QDQ:
    """Inputs and attributes of ONNX DequantizeLinear (what QNN's QDQ weights carry)."""

    data: np.ndarray
    scale: np.ndarray
    zero_point: np.ndarray
    axis: int
    block_size: int | None  # None: per-channel along axis
    dtype: str  # "int4" or "int8"


def _stored(bits: int) -> tuple[str, int]:
    """The signed type a code fits, and the shift 2^(D−1) that centres [0, 2^b) in it."""
    return ("int4", 8) if bits <= 4 else ("int8", 128)


PALETTE_BITS = (1, 2, 3, 4, 6, 8)  # Core ML's index types, uint1 … uint8


def palette_bits(bits: int) -> int:
    """The narrowest Core ML index type that holds b-bit codes (uint6 for 5 bits)."""
    return min(p for p in PALETTE_BITS if p >= bits)


def _codes(packed: spec.Packed) -> np.ndarray:
    spec.verify(packed)
    return spec.unpack(packed).astype(np.int16)


def _centred(packed: spec.Packed):
    """(data, offset or None, type): codes as signed integers; symmetric ones need no offset."""
    m = packed.meta
    q, zeros = _codes(packed), packed.zeros.astype(np.int16)
    dtype, shift = _stored(m.bits)
    if m.symmetric:
        return (q - np.repeat(zeros, m.group, axis=1)).astype(np.int8), None, dtype
    return (q - shift).astype(np.int8), (zeros - shift).astype(np.int8), dtype


def _scales(packed: spec.Packed, dtype) -> np.ndarray:
    if np.dtype(dtype) not in (np.float16, np.float32):
        raise InputError(f"scale dtype {np.dtype(dtype)} is not supported; use float16 or float32.")
    return packed.scales.astype(dtype)


def blockwise_shift_scale(packed: spec.Packed, scale_dtype=np.float16) -> BlockwiseShiftScale:
    data, offset, dtype = _centred(packed)
    return BlockwiseShiftScale(data, _scales(packed, scale_dtype), offset, dtype)


def lut_to_dense(packed: spec.Packed, lut_dtype=np.float16) -> LutToDense:
    m = packed.meta
    if np.dtype(lut_dtype) not in (np.float16, np.float32):
        raise InputError(f"palette dtype {np.dtype(lut_dtype)} is not supported; use float16 or float32.")
    index_bits = palette_bits(m.bits)
    tables = spec.value_tables(packed.scales, packed.zeros, m.bits)
    unused = [(0, 0), (0, 0), (0, 2**index_bits - 2**m.bits)]  # entries no b-bit code reaches: zero
    return LutToDense(_codes(packed).astype(np.uint8), np.pad(tables, unused).astype(lut_dtype)[..., None],
                      f"uint{index_bits}")


def qdq_blocked(packed: spec.Packed, scale_dtype=np.float32) -> QDQ:
    data, offset, dtype = _centred(packed)
    zero_point = np.zeros(packed.scales.shape, np.int8) if offset is None else offset
    return QDQ(data, _scales(packed, scale_dtype), zero_point, axis=1, block_size=packed.meta.group, dtype=dtype)


def qdq_per_channel(packed: spec.Packed, scale_dtype=np.float32) -> QDQ:
    """Per-output-channel parameters; only when each row's groups share one scale and zero point."""
    blocked = qdq_blocked(packed, scale_dtype)
    scale, zero = blocked.scale, blocked.zero_point
    if np.any(scale != scale[:, :1]) or np.any(zero != zero[:, :1]):
        raise InputError("the groups of a row have different scales or zero points, so the weight has no "
                         "per-channel form; use qdq_blocked (block_size = group) instead.")
    return QDQ(blocked.data, scale[:, 0].copy(), zero[:, 0].copy(), axis=0, block_size=None, dtype=blocked.dtype)


@dataclass(frozen=True)
class NpuFormat:
    """A luts format NPU builds hold weights in; every target quantises to it with :meth:`quantize`."""

    bits: int
    group: int
    symmetric: bool

    def quantize(self, weight: np.ndarray) -> spec.Packed:
        """Round-to-nearest codes of ``weight`` [N, K] (fp32). Applied to weights that are already this format's
        dequantised codes, it gives those codes back, except in a group whose fp16 scale is subnormal."""
        return spec.quantize_pack(np.asarray(weight, np.float32), self.bits, self.group, self.symmetric)


NPU_INT4 = NpuFormat(4, 32, symmetric=True)  # ANE int4, HTP w4a16: QNN's int4 needs zero point 0
NPU_PALETTES = {b: NpuFormat(b, 64, symmetric=False) for b in (4, 2)}  # ANE palettize4/2: quantize's default


def qdq_symmetric_int4(packed: spec.Packed) -> bool:
    """Whether QNN's HTP can take the weight as int4 QDQ (4 bits or fewer, zero point 0)."""
    return packed.meta.bits <= 4 and not np.any(qdq_blocked(packed).zero_point)
