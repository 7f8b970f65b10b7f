"""npumoe's weights as MLX arrays: dense tensors in the dtype the model holds them, luts codes as MLX's own
affine quantised matrices.

MLX's affine format dequantises w = scale · q + bias per group of 32, 64 or 128 inputs, its codes packed
least significant bit first into uint32 words (any of 1-8 bits). A luts matrix (:mod:`npumoe.luts.spec`:
w = s · (q − z)) is the same codes with scale = s and bias = −s · z. In fp32 both products and their sum are
exact (an 11-bit scale times codes and zero points of at most 8 bits), so MLX dequantises to the very values
the CPU LUT kernels, the ANE and the HTP hold, for every luts format; ``quantized_matmul`` then differs from
the reference only in fp32 summation order. The codes would not agree exactly with fp16 or bf16 scales and
biases (−s · z has up to 19 significant bits), so they are kept fp32. ``mx.quantize`` is not used: it chooses
its own codes (a group's min and max as bias and range), which match no other target's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import torch

from npumoe.luts import layout, mappings, spec

INT8 = mappings.NpuFormat(8, 64, symmetric=False)  # as `npumoe quantize --bits 8` writes it (its default group)
PRECISIONS: dict[str, mappings.NpuFormat | None] = {"stored": None, "int4": mappings.NPU_INT4, "int8": INT8}
QUANTIZED_KINDS = frozenset({"experts"})  # what --precision int4/int8 quantises: the routed experts, as the ANE's


@dataclass(frozen=True)
class QuantizedMatrix:
    """A weight [N, K] in MLX's affine format: packed codes [N, K·bits/32] uint32, scales and biases [N, K/group]."""

    codes: mx.array
    scales: mx.array
    biases: mx.array
    bits: int
    group: int

    def matmul(self, x: mx.array) -> mx.array:
        """x · Wᵀ, in x's dtype (computed against the fp32 scales and biases)."""
        return mx.quantized_matmul(x, self.codes, self.scales, self.biases, transpose=True, group_size=self.group,
                                   bits=self.bits).astype(x.dtype)

    def arrays(self, name: str) -> dict[str, mx.array]:
        """Its arrays under ``name`` as a safetensors file holds them (:func:`quantized_from_arrays` reads them)."""
        return {name: self.codes, f"{name}.scales": self.scales, f"{name}.biases": self.biases}


def quantized_from_packed(packed: spec.Packed) -> QuantizedMatrix:
    """A luts matrix as the MLX matrix of the same codes and values (see the module's docstring)."""
    m = packed.meta
    codes = spec.unpack(packed)
    bits = (codes[..., None] >> np.arange(m.bits, dtype=np.uint8)) & 1  # [N, K, b], least significant first
    words = np.packbits(bits.reshape(m.shape[0], -1), axis=1, bitorder="little").view("<u4")
    scales = packed.scales.astype(np.float32)
    return QuantizedMatrix(mx.array(words), mx.array(scales), mx.array(-scales * packed.zeros.astype(np.float32)),
                           m.bits, m.group)


def quantized_from_arrays(arrays: Mapping[str, mx.array], name: str, bits: int, group: int) -> QuantizedMatrix:
    return QuantizedMatrix(arrays[name], arrays[f"{name}.scales"], arrays[f"{name}.biases"], bits, group)


def dense(tensor: torch.Tensor) -> mx.array:
    """A torch tensor as an MLX array of the same dtype (bf16 through its bit patterns: numpy has none)."""
    tensor = tensor.detach().contiguous()
    if tensor.dtype == torch.bfloat16:
        return mx.array(tensor.view(torch.int16).numpy()).view(mx.bfloat16)
    return mx.array(tensor.numpy())


def luts_codes(weights, name: str, kind: str, precision: str) -> spec.Packed | None:
    """The luts codes matrix ``name`` of a ``kind`` graph is held in, or None for a dense matrix: a
    ``--precision`` format's (:func:`~npumoe.models.checkpoints.lut.npu_codes`, the ANE's and HTP's codes) for
    the routed experts, else the checkpoint's own packed codes (``npumoe quantize``, GPTQ, MXFP4)."""
    from npumoe.models.checkpoints.lut import npu_codes

    fmt = PRECISIONS[precision]
    if fmt is not None and kind in QUANTIZED_KINDS:
        return npu_codes(weights, name, fmt)
    packed = getattr(weights, "packed", {})
    return layout.from_tiles(packed[name].tiled()) if name in packed else None
