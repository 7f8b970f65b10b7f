"""The npumoe low-bit weight format and LUT arithmetic, in numpy: the normative definition.

Every kernel (C, SIMD, emulated NEON) and every backend mapping is tested against the
functions here, so each step is written out exactly, including fp32 operation order
where the result must be bit-reproducible.

Codes and quantisation
    A weight matrix W [N, K] (N outputs, K inputs) is stored as codes q[n, k] in
    [0, 2^b), b ∈ {1, 2, 3, 4, 5, 6, 8}, with one float16 scale s[n, g] > 0 and one integer
    zero point z[n, g] ∈ [0, 2^b) per group g = k // group, group ∈ {32, 64, 128}:

        w[n, k] = s[n, g] · (q[n, k] − z[n, g])

    The product is exact in fp32 (11-bit scale times an integer of at most 8 bits), so
    every dequantisation route below yields the same fp32 bits. Symmetric tensors
    use z = 2^(b−1) (GPTQ's convention, so they map to signed int4 with zero point 0);
    1-bit symmetric is refused (its levels are −s and 0). Nothing in the format depends
    on b beyond the plane count; b = 5 is there because symmetric 5-bit codes hold every
    MXFP4 (FP4 E2M1) value exactly: q = 2·v + 16 ∈ [4, 28] with s = 2^(e − 128)
    (:mod:`npumoe.luts.mxfp4`); b = 6 holds an LM head at llama.cpp's Q6_K precision.

Bit-serial layout (what decoding reads)
    b one-bit planes. Plane i, row n, holds for each run c of 4 consecutive inputs the
    4-bit index idx_i(n, c) = Σ_j ((q[n, 4c+j] >> i) & 1) << j, j = 0..3; two indices
    per byte, even c in the low nibble: planes[i, n, c // 2]. Shape [b, N, K/8], uint8.

Activation tables (LUT-GEMV)
    For each run c of four activations x0..x3 = x[4c .. 4c+3] (fp32) a 16-entry table
    T[c, e] = Σ_j σ_j(e) x_j with σ_j(e) = +1 if bit j of e is set, else −1:
      odd e  — t = x0; t = t ± x1; t = t ± x2; t = t ± x3  (four fp32 operations in this
               order, + where bit j of e is set, − where it is clear);
      even e — T[c, e] = −T[c, 15 − e] (mirroring: 15 − e is odd).
    Quantisation, one block per weight group (group/4 tables): amax = max |T| over the
    block; Q = 127 (int8) or 32767 (int16); if amax = 0 the block is zero with scale 0,
    else inv = fp32(Q / amax), Tq = round-half-even(fp32(T · inv)), t_scale = fp32(amax / Q).

Accumulation and epilogue
    A[n, g] = Σ_{i<b} 2^i Σ_{c in g} Tq[c, idx_i(n, c)]            (exact in int32)
    Xq[g]   = Σ_{c in g} Tq[c, 15]                                   (15 = all bits set: Σ x)
    y[n]    = Σ_g s[n, g] · t_scale[g] / 2 · (A[n, g] + (2^b − 1 − 2 z[n, g]) · Xq[g])
    because Σ_k q_k x_k = ½ Σ_i 2^i Σ_c T[c, idx_i] + ½ (2^b − 1) Σ_c T[c, 15].

Two-level LUT dequantisation (prefill)
    Level 1 repacks bit-serial to bit-parallel with a 16-entry table per plane:
    REPACK[i, idx] has bit i of byte j set iff bit j of idx is set, so OR-ing
    REPACK[i, idx_i(n, c)] over the planes gives q[n, 4c .. 4c+3] as four bytes.
    Level 2 maps a code through a per-group value table with scale and zero baked in:
    V[n, g, v] = fp32(v − z[n, g]) · fp32(s[n, g]).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from npumoe.core.base.errors import InputError, WeightError
from npumoe.luts import BITS

GROUPS = (32, 64, 128)
TABLE_BITS = (8, 16)
TABLE_MAX = {8: 127, 16: 32767}
TABLE_DTYPE = {8: np.int8, 16: np.int16}

_E = np.arange(16)


@dataclass(frozen=True)
class PackedMeta:
    """What other code needs to carry a packed weight around: its format, shape and checksum."""

    bits: int
    group: int
    symmetric: bool
    shape: tuple[int, int]  # (N outputs, K inputs)
    checksum: str  # crc32 of the arrays, hex

    @property
    def groups(self) -> int:
        return self.shape[1] // self.group


@dataclass(frozen=True, eq=False)
class Packed:
    """A weight in the bit-serial format: planes [b, N, K/8] u8, scales [N, G] f16, zeros [N, G] u8."""

    meta: PackedMeta
    planes: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray


# ---------------------------------------------------------------------------------- validation


def check_group(group: int, k: int | None = None) -> None:
    if group not in GROUPS:
        raise InputError(f"group size {group} is not supported; use one of {', '.join(map(str, GROUPS))}.")
    if k is not None and k % group:
        raise InputError(f"K = {k} inputs is not a multiple of the group size {group}; pad K or pick a group "
                         "size that divides it.")


def check_format(bits: int, group: int, k: int | None = None, symmetric: bool = False) -> None:
    if bits not in BITS:
        raise InputError(f"{bits}-bit weights are not supported; use one of {', '.join(map(str, BITS))} bits.")
    if symmetric and bits == 1:
        raise InputError("1-bit symmetric quantisation has only the levels −s and 0; quantise 1-bit weights "
                         "with symmetric=False.")
    check_group(group, k)


def _checksum(bits, group, symmetric, shape, planes, scales, zeros) -> str:
    crc = zlib.crc32(np.asarray([bits, group, int(symmetric), *shape], dtype="<i8").tobytes())
    for a in (planes, scales, zeros):
        crc = zlib.crc32(np.ascontiguousarray(a).tobytes(), crc)
    return f"{crc:08x}"


def make_packed(planes, scales, zeros, bits: int, group: int, symmetric: bool) -> Packed:
    """Wrap arrays already in the bit-serial format, computing the checksum."""
    planes = np.ascontiguousarray(planes, dtype=np.uint8)
    scales = np.ascontiguousarray(scales, dtype=np.float16)
    zeros = np.ascontiguousarray(zeros, dtype=np.uint8)
    shape = (planes.shape[1], planes.shape[2] * 8)
    meta = PackedMeta(bits, group, symmetric, shape, _checksum(bits, group, symmetric, shape, planes, scales, zeros))
    packed = Packed(meta, planes, scales, zeros)
    verify(packed)
    return packed


def verify(packed: Packed) -> None:
    """Raise WeightError unless the arrays match the metadata (shapes, ranges, checksum)."""
    m = packed.meta
    check_format(m.bits, m.group, m.shape[1], m.symmetric)
    n, k = m.shape
    expected = {"planes": (m.bits, n, k // 8), "scales": (n, k // m.group), "zeros": (n, k // m.group)}
    for name, shape in expected.items():
        actual = getattr(packed, name).shape
        if actual != shape:
            raise WeightError(f"packed {name} has shape {list(actual)} but a {m.bits}-bit {n}×{k} weight with "
                              f"group {m.group} needs {list(shape)}; re-pack the weight.")
    if _checksum(m.bits, m.group, m.symmetric, m.shape, packed.planes, packed.scales, packed.zeros) != m.checksum:
        raise WeightError(f"packed weight checksum mismatch (expected {m.checksum}): the arrays were altered or "
                          "corrupted; re-pack the weight from its source.")
    if np.any(packed.zeros >= 2**m.bits) or (m.symmetric and np.any(packed.zeros != 2 ** (m.bits - 1))):
        raise WeightError(f"zero points outside [0, 2^{m.bits}) or not 2^{m.bits - 1} for a symmetric weight; "
                          "re-pack the weight.")
    if not np.all(np.isfinite(packed.scales)):
        raise WeightError("packed scales contain inf or NaN; re-quantise the weight.")


# ---------------------------------------------------------------------------------- quantisation


def quantize(w: np.ndarray, bits: int, group: int, symmetric: bool = False):
    """Round-to-nearest codes, float16 scales and integer zero points for W [N, K] (fp32).

    Asymmetric: the group's range [min(w, 0), max(w, 0)] spans the 2^b levels.
    Symmetric: z = 2^(b−1) and s = max|w| / (2^(b−1) − 1), so no weight is clipped.
    Codes are computed with the fp16-rounded scale, so they match what is stored.
    """
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise InputError(f"weights must be a 2-D [N, K] matrix, got shape {list(w.shape)}.")
    check_format(bits, group, w.shape[1], symmetric)
    if not np.all(np.isfinite(w)):
        raise InputError("weights contain inf or NaN; clean them before quantising.")
    n, k = w.shape
    wg = w.reshape(n, k // group, group)
    levels = 2**bits - 1
    if symmetric:
        scale = np.abs(wg).max(-1) / np.float32(2 ** (bits - 1) - 1)
    else:
        lo, hi = np.minimum(wg.min(-1), 0), np.maximum(wg.max(-1), 0)
        scale = (hi - lo) / np.float32(levels)
    if np.any(scale > np.finfo(np.float16).max):
        raise InputError("weights are too large for float16 group scales (|w| ≳ 1e6); rescale the layer.")
    s16 = scale.astype(np.float16)
    s16[s16 == 0] = 1  # an all-zero (or fp16-underflowing) group: any scale works, codes equal the zero point
    s = s16.astype(np.float32)
    zeros = np.full(s.shape, 2 ** (bits - 1)) if symmetric else np.clip(np.rint(-lo / s), 0, levels)
    q = np.clip(np.rint(wg / s[..., None]) + zeros[..., None], 0, levels)
    return q.reshape(n, k).astype(np.uint8), s16, zeros.astype(np.uint8)


def dequantize_codes(q: np.ndarray, scales: np.ndarray, zeros: np.ndarray, group: int) -> np.ndarray:
    """w = s · (q − z) in fp32, directly from bit-parallel codes."""
    diff = q.astype(np.int32) - np.repeat(zeros.astype(np.int32), group, axis=1)
    return diff.astype(np.float32) * np.repeat(scales.astype(np.float32), group, axis=1)


# ---------------------------------------------------------------------------------- bit-serial packing


def planes_from_codes(q: np.ndarray, bits: int) -> np.ndarray:
    """Bit-parallel codes [N, K] → bit-serial planes [b, N, K/8]."""
    q = np.asarray(q, dtype=np.uint8)
    n, k = q.shape
    bit = (q[None] >> np.arange(bits, dtype=np.uint8)[:, None, None]) & 1  # [b, N, K]
    idx = (bit.reshape(bits, n, k // 4, 4) << np.arange(4, dtype=np.uint8)).sum(-1, dtype=np.uint8)
    return idx[..., 0::2] | (idx[..., 1::2] << 4)


def indices_from_planes(planes: np.ndarray) -> np.ndarray:
    """Planes [b, N, K/8] → 4-bit indices idx_i(n, c) as [b, N, K/4] uint8."""
    idx = np.empty((*planes.shape[:2], planes.shape[2] * 2), dtype=np.uint8)
    idx[..., 0::2], idx[..., 1::2] = planes & 0x0F, planes >> 4
    return idx


def codes_from_planes(planes: np.ndarray) -> np.ndarray:
    """Bit-serial planes [b, N, K/8] → bit-parallel codes [N, K] (bit by bit, the plain way)."""
    idx = indices_from_planes(planes)
    b, n, c = idx.shape
    bits = (idx[..., None] >> np.arange(4, dtype=np.uint8)) & 1  # [b, N, K/4, 4]
    return (bits.reshape(b, n, c * 4) << np.arange(b, dtype=np.uint8)[:, None, None]).sum(0, dtype=np.uint8)


def pack(q: np.ndarray, scales: np.ndarray, zeros: np.ndarray, bits: int, group: int, symmetric: bool) -> Packed:
    q = np.asarray(q)
    check_format(bits, group, q.shape[1], symmetric)
    if q.max(initial=0) >= 2**bits:
        raise InputError(f"codes must lie in [0, 2^{bits}); got a maximum of {int(q.max())}.")
    return make_packed(planes_from_codes(q, bits), scales, zeros, bits, group, symmetric)


def packed_bytes(bits: int, group: int, shape: tuple[int, int]) -> int:
    """Bytes a [N, K] weight takes in the format: its bit planes, and a float16 scale and uint8 zero a group."""
    n, k = shape
    return bits * n * k // 8 + n * (k // group) * (2 + 1)


def quantize_pack(w: np.ndarray, bits: int, group: int, symmetric: bool = False) -> Packed:
    return pack(*quantize(w, bits, group, symmetric), bits, group, symmetric)


def unpack(packed: Packed) -> np.ndarray:
    return codes_from_planes(packed.planes)


def dequantize(packed: Packed) -> np.ndarray:
    return dequantize_codes(unpack(packed), packed.scales, packed.zeros, packed.meta.group)


# ---------------------------------------------------------------------------------- two-level LUT dequant


def repack_table(bits: int) -> np.ndarray:
    """Level 1: REPACK[i, idx] (uint32) puts bit j of idx at bit i of byte j."""
    idx_bits = (_E[:, None] >> np.arange(4)) & 1  # [16, 4]
    shifts = 8 * np.arange(4)[None, None, :] + np.arange(bits)[:, None, None]  # [b, 1, 4]
    return (idx_bits[None].astype(np.uint32) << shifts.astype(np.uint32)).sum(-1, dtype=np.uint32)


def value_tables(scales: np.ndarray, zeros: np.ndarray, bits: int) -> np.ndarray:
    """Level 2: V[n, g, v] = fp32(v − z) · fp32(s), the dequantised value of code v."""
    v = np.arange(2**bits, dtype=np.int32)
    return (v - zeros.astype(np.int32)[..., None]).astype(np.float32) * scales.astype(np.float32)[..., None]


def lut_dequantize(packed: Packed) -> np.ndarray:
    """Dequantise through the two tables: repack planes to bytes, then look codes up per group."""
    m = packed.meta
    n, k = m.shape
    idx = indices_from_planes(packed.planes)  # [b, N, K/4]
    words = np.bitwise_or.reduce(repack_table(m.bits)[np.arange(m.bits)[:, None, None], idx], axis=0)
    q = words.astype("<u4").view(np.uint8).reshape(n, k)  # byte j of word c is q[n, 4c + j]
    tables = value_tables(packed.scales, packed.zeros, m.bits)  # [N, G, 2^b]
    return np.take_along_axis(tables, q.reshape(n, m.groups, m.group).astype(np.intp), axis=2).reshape(n, k)


# ---------------------------------------------------------------------------------- activation tables


def build_tables(x: np.ndarray) -> np.ndarray:
    """fp32 tables T [K/4, 16] in the defined order (odd entries computed, even ones mirrored)."""
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 1 or x.shape[0] % 4:
        raise InputError(f"activations must be a vector whose length is a multiple of 4, got {list(x.shape)}.")
    xs = x.reshape(-1, 4)
    table = np.empty((xs.shape[0], 16), dtype=np.float32)
    for e in range(1, 16, 2):
        t = xs[:, 0].copy()
        for j in (1, 2, 3):
            t = t + xs[:, j] if (e >> j) & 1 else t - xs[:, j]
        table[:, e] = t
        table[:, 15 - e] = -t
    return table


def quantize_tables(table: np.ndarray, group: int, table_bits: int = 8):
    """Tables → (integer tables [K/4, 16], fp32 scale per group of activations [K/group])."""
    if table_bits not in TABLE_BITS:
        raise InputError(f"table precision {table_bits} is not supported; use 8 or 16 bits.")
    tq, t_scales = _symmetric(table.reshape(-1, group // 4 * 16), TABLE_MAX[table_bits], TABLE_DTYPE[table_bits])
    return tq.reshape(table.shape), t_scales


def _symmetric(blocks: np.ndarray, qmax: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    """Each row of ``blocks`` (fp32) as integers at max|row|/qmax, rounded half to even, and those scales."""
    qmax = np.float32(qmax)
    amax = np.abs(blocks).max(1)
    nonzero = amax > 0
    inv = np.zeros_like(amax)
    inv[nonzero] = qmax / amax[nonzero]
    return np.rint(blocks * inv[:, None]).astype(dtype), (amax / qmax).astype(np.float32)


def table_sums(tq: np.ndarray, group: int) -> np.ndarray:
    """Xq[g] = Σ_c Tq[c, 15]: the quantised Σ x of each group (the zero-point term)."""
    return tq[:, 15].astype(np.int32).reshape(-1, group // 4).sum(1, dtype=np.int32)


def lut_accumulate(planes: np.ndarray, tq: np.ndarray, group: int) -> np.ndarray:
    """A[n, g] = Σ_i 2^i Σ_{c in g} Tq[c, idx_i(n, c)] in int32 — what every kernel must reproduce."""
    idx = indices_from_planes(planes)  # [b, N, K/4]
    b, n, c = idx.shape
    looked_up = tq.astype(np.int32)[np.arange(c), idx]  # [b, N, K/4]
    per_plane = looked_up.reshape(b, n, c // (group // 4), group // 4).sum(-1, dtype=np.int32)
    return (per_plane << np.arange(b, dtype=np.int32)[:, None, None]).sum(0, dtype=np.int32)


def zero_terms(zeros: np.ndarray, bits: int) -> np.ndarray:
    """2^b − 1 − 2z: the coefficient of Xq in the epilogue (−1 for every symmetric group)."""
    return 2**bits - 1 - 2 * zeros.astype(np.int32)


def epilogue(acc, xq, t_scales, scales, zeros, bits: int) -> np.ndarray:
    """y [N] from the int32 accumulators: plane weights are inside A; scales and zero term here."""
    total = acc.astype(np.float64) + zero_terms(zeros, bits) * xq.astype(np.float64)
    factor = scales.astype(np.float64) * (t_scales.astype(np.float64) / 2)
    return (factor * total).sum(1).astype(np.float32)


def lut_gemv(packed: Packed, x: np.ndarray, table_bits: int = 8) -> np.ndarray:
    """y = W x the LUT way, with quantised tables (what the kernels compute)."""
    m = packed.meta
    _check_activations(x, m)
    tq, t_scales = quantize_tables(build_tables(x), m.group, table_bits)
    acc = lut_accumulate(packed.planes, tq, m.group)
    return epilogue(acc, table_sums(tq, m.group), t_scales, packed.scales, packed.zeros, m.bits)


def float_lut_gemv(packed: Packed, x: np.ndarray) -> np.ndarray:
    """y = W x the LUT way with fp32 tables (no table quantisation): the identity, checkable to 1e-6."""
    m = packed.meta
    _check_activations(x, m)
    table = build_tables(x).astype(np.float64)
    idx = indices_from_planes(packed.planes)
    b, n, c = idx.shape
    per_plane = table[np.arange(c), idx].reshape(b, n, m.groups, m.group // 4).sum(-1)  # [b, N, G]
    lookups = (per_plane * (2.0 ** np.arange(b))[:, None, None]).sum(0)
    sums = table[:, 15].reshape(m.groups, -1).sum(1)
    return (packed.scales.astype(np.float64) / 2 * (lookups + zero_terms(packed.zeros, m.bits) * sums)).sum(1)


def quantize_activations(x: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """x [K] → (int8 [K], fp32 scale per group [K/group]): symmetric at max|x|/127, rounded half to even — the
    int8 prefill's activations (as the tables of lut_gemv, but of the inputs themselves)."""
    xq, scales = _symmetric(x.astype(np.float32).reshape(-1, group), 127, np.int8)
    return xq.reshape(-1), scales


def int8_accumulate(packed: Packed, xq: np.ndarray) -> np.ndarray:
    """A[n, g] = Σ_{i in g} (q[n, i] − z[n, g]) · xq[i] in int32: weight codes times int8 activations."""
    m = packed.meta
    q = codes_from_planes(packed.planes).astype(np.int32).reshape(m.shape[0], m.groups, m.group)
    xg = xq.astype(np.int32).reshape(m.groups, m.group)
    return (q * xg).sum(-1, dtype=np.int32) - packed.zeros.astype(np.int32) * xg.sum(-1, dtype=np.int32)


def int8_gemv(packed: Packed, x: np.ndarray) -> np.ndarray:
    """y = W x with x quantised to int8 per group: Σ_g s[n, g] · xs[g] · A[n, g] (what the int8 GEMM computes)."""
    m = packed.meta
    _check_activations(x, m)
    xq, xs = quantize_activations(x, m.group)
    acc = int8_accumulate(packed, xq).astype(np.float64)
    return (packed.scales.astype(np.float64) * xs.astype(np.float64) * acc).sum(1).astype(np.float32)


def bf16_round(x: np.ndarray) -> np.ndarray:
    """fp32 → the nearest bf16 (ties to even), as fp32: the top 16 bits of the rounded pattern."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16).astype(np.uint32)
    return np.where(np.isnan(x), x, rounded.view(np.float32)).astype(np.float32)


def bf16_dot_gemm(w_bits: np.ndarray, x: np.ndarray) -> np.ndarray:
    """y [M, N] = bf16(x) [M, K] · Wᵀ for bf16 W given as its 16-bit patterns [N, K]: the bf16 prefill GEMM's
    contract. Each product of two bf16 values is exact in fp32, so only the fp32 summation order (which this
    float64 sum does not fix) separates a kernel from it."""
    w = (np.asarray(w_bits).astype(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return (bf16_round(x).astype(np.float64) @ w.T.astype(np.float64)).astype(np.float32)


def _check_activations(x, meta: PackedMeta) -> None:
    if np.shape(x) != (meta.shape[1],):
        raise InputError(f"activations have shape {list(np.shape(x))} but the weight takes {meta.shape[1]} inputs.")
