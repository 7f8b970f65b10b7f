"""Import GPTQ-style packed tensors (qweight / qzeros / scales) into the npumoe format.

GPTQ stores, for a linear layer with K inputs and N outputs:
    qweight  int32 [K·b/32, N]   codes along K, as a little-endian bit stream per column
                                (b = 2, 4, 8 never straddle a word; 3-bit codes do)
    qzeros   int32 [K/g, N·b/32] zero points along N, the same bit stream per group row
    scales   fp16  [K/g, N]
    g_idx    int32 [K], optional: group of each input (act-order checkpoints permute it)
and dequantises w = s · (q − z). "v1" checkpoints (AutoGPTQ's original format) store
z − 1 and add 1 on load; "v2" (``checkpoint_format: gptq_v2``) store z itself.
"""

from __future__ import annotations

import numpy as np

from npumoe.core.base.errors import WeightError
from npumoe.luts import spec

ZERO_OFFSET = {"v1": 1, "v2": 0}


def bit_stream_values(words: np.ndarray, bits: int) -> np.ndarray:
    """The b-bit fields of int32 words [..., n] read as one little-endian stream: [..., n·32/b]."""
    stream = np.unpackbits(np.ascontiguousarray(words, dtype="<u4").view(np.uint8), axis=-1, bitorder="little")
    fields = stream.reshape(*stream.shape[:-1], -1, bits).astype(np.uint16)
    return (fields << np.arange(bits, dtype=np.uint16)).sum(-1, dtype=np.uint16)


def from_gptq(qweight, qzeros, scales, bits: int, group: int, g_idx=None, version: str = "v1") -> spec.Packed:
    """A :class:`spec.Packed` holding exactly the weights the GPTQ tensors dequantise to."""
    if version not in ZERO_OFFSET:
        raise WeightError(f"GPTQ zero-point convention {version!r} is unknown; use 'v1' (stored z − 1) or 'v2'.")
    qweight, qzeros, scales = np.asarray(qweight), np.asarray(qzeros), np.asarray(scales)
    spec.check_format(bits, group)
    if qweight.ndim != 2 or qweight.dtype.kind not in "iu" or qweight.dtype.itemsize != 4:
        raise WeightError(f"GPTQ qweight must be a 2-D int32 tensor, got {qweight.dtype}{list(qweight.shape)}.")
    k, n = qweight.shape[0] * 32 // bits, qweight.shape[1]
    spec.check_group(group, k)
    expected = {"qzeros": (qzeros, (k // group, n * bits // 32)), "scales": (scales, (k // group, n))}
    for name, (a, shape) in expected.items():
        if a.shape != shape or (n * bits) % 32:
            raise WeightError(f"GPTQ {name} has shape {list(a.shape)} but a {bits}-bit {n}×{k} layer with group "
                              f"{group} needs {list(shape)} (and N·bits a multiple of 32); check bits and group_size.")
    if g_idx is not None and not np.array_equal(np.asarray(g_idx), np.arange(k) // group):
        raise WeightError("this GPTQ checkpoint reorders its groups (act-order / desc_act g_idx); npumoe needs "
                          "sequential groups: re-quantise without desc_act or reorder the inputs first.")
    if scales.dtype != np.float16 and not np.array_equal(scales.astype(np.float16).astype(scales.dtype), scales):
        raise WeightError(f"GPTQ scales are {scales.dtype} values that float16 cannot hold exactly; npumoe stores "
                          "float16 scales, so convert the checkpoint's scales to float16 first.")
    q = bit_stream_values(qweight.T, bits)  # [N, K]
    zeros = bit_stream_values(qzeros, bits).astype(np.int32).T + ZERO_OFFSET[version]  # [N, G]
    if zeros.max(initial=0) >= 2**bits:
        raise WeightError(f"a {version} zero point reaches 2^{bits} (a v1 checkpoint storing −1 for zero 0); "
                          "npumoe's zero points lie in [0, 2^bits): re-export the checkpoint as gptq_v2.")
    symmetric = bits > 1 and bool(np.all(zeros == 2 ** (bits - 1)))
    return spec.pack(q, scales.T.astype(np.float16), zeros.astype(np.uint8), bits, group, symmetric)
