"""Weight compression: the ``precision`` build option → Core ML's constexpr decompression ops.

The ANE streams compressed weights and expands them on the fly, so int4 and palettised
weights cut package size without changing activations (still fp16). The precision applies
to routed-expert packages, which hold nearly all of an MoE's weights; attention, dense and
shared FFNs and the LM head stay fp16: they are a small share of the bytes and the most
sensitive to 4-bit error (on a small random-weight Qwen3-MoE, int4 everywhere gave a logit
cosine of 0.96, int4 experts alone 0.998). Only 1×1-conv (linear) weights are compressed.

int4 codes and scales come from ``npumoe.luts`` (:func:`npumoe.luts.checkpoint.npu_int4_codes`:
computed from the weights as stored, not from their fp16 rounding), so Core ML stores the ones
the CPU LUT kernels run and the HTP's w4a16 holds; coremltools' quantisation pass only places
them, each fp16 constant matched to its codes by content. Palettes are still coremltools'
seeded k-means. Both are deterministic, so identical weights in two functions compress
identically and a multifunction package still stores them once.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from npumoe.errors import InputError
from npumoe.luts import mappings


@dataclass(frozen=True)
class Scheme:
    op: str | None  # the MIL constexpr op that decompresses it
    bits: float  # stored bits per weight, scales and palettes included (for package sizing)
    description: str


INT4_BLOCK = mappings.NPU_INT4_GROUP  # input channels per int4 scale
PALETTE_GROUP = 16  # output channels sharing one palette

SCHEMES = {
    "fp16": Scheme(None, 16, "fp16 weights"),
    "int4": Scheme("constexpr_blockwise_shift_scale", 4 + 16 / INT4_BLOCK,
                   f"int4 symmetric, one fp16 scale per {INT4_BLOCK} input channels (npumoe.luts codes of the stored weights)"),
    "palettize4": Scheme("constexpr_lut_to_dense", 4, f"4-bit k-means palette per {PALETTE_GROUP} output channels"),
    "palettize2": Scheme("constexpr_lut_to_dense", 2, f"2-bit k-means palette per {PALETTE_GROUP} output channels"),
}


COMPRESSED_KINDS = frozenset({"experts"})


def precision_for(kind: str, precision: str) -> str:
    """The precision a package of graphs of ``kind`` is built at."""
    return precision if kind in COMPRESSED_KINDS else "fp16"


def scheme(precision: str) -> Scheme:
    if precision not in SCHEMES:
        raise InputError(f"precision {precision!r} is not one of {', '.join(SCHEMES)} for the ANE.")
    return SCHEMES[precision]


def compress(mlmodel, precision: str, int4: Mapping[bytes, mappings.BlockwiseShiftScale] | None = None):
    """The model with its conv weights compressed as ``precision`` says (fp16: unchanged); ``int4`` holds
    the codes of every conv weight at precision int4 (:func:`int4_blocks`)."""
    if scheme(precision).op is None:
        return mlmodel
    import coremltools.optimize.coreml as cto

    if precision == "int4":
        op_config = cto.OpLinearQuantizerConfig(mode="linear_symmetric", dtype="int4", granularity="per_block",
                                                block_size=INT4_BLOCK, weight_threshold=0)
        return luts_int4(mlmodel, cto.OptimizationConfig(op_type_configs={"conv": op_config}), int4)
    op_config = cto.OpPalettizerConfig(mode="kmeans", nbits=int(scheme(precision).bits),
                                       granularity="per_grouped_channel", group_size=PALETTE_GROUP,
                                       weight_threshold=0)
    return cto.palettize_weights(mlmodel, cto.OptimizationConfig(op_type_configs={"conv": op_config}))


def int4_blocks(module, weights) -> dict[bytes, mappings.BlockwiseShiftScale]:
    """Each conv kernel of ``module`` (an AneGraphModule) as luts int4, keyed by its fp16 bytes' digest:
    coremltools' pass sees only the fp16 constants, the codes come from the weights themselves."""
    from npumoe.luts.checkpoint import npu_int4_codes

    blocks = {}
    for name, kernels in module.conv_kernels().items():
        whole, start = mappings.blockwise_shift_scale(npu_int4_codes(weights, name)), 0
        for kernel in kernels:
            rows = slice(start, start + kernel.shape[0])
            blocks[_digest(kernel.numpy())] = mappings.BlockwiseShiftScale(
                whole.data[rows], whole.scale[rows], None, whole.dtype)
            start = rows.stop
    return blocks


def _digest(fp16_kernel: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(fp16_kernel, np.float16).tobytes(), digest_size=16).digest()


def luts_int4(mlmodel, config, int4: Mapping[bytes, mappings.BlockwiseShiftScale]):
    """coremltools' per-block weight quantiser (which finds the conv weights and writes
    ``constexpr_blockwise_shift_scale``) with the codes and scales of ``int4``."""
    from coremltools.converters.mil.mil import types
    from coremltools.models.utils import _apply_graph_pass
    from coremltools.optimize._utils import QuantParams
    from coremltools.optimize.coreml._quantization_passes import linear_quantize_weights

    class LutsQuantizer(linear_quantize_weights):  # coremltools 9's pass; the override is its one hook
        @classmethod
        def blockwise_compress_by_dtype(cls, original_data, dtype, mode, block_sizes):
            rows, cols = original_data.shape[:2]
            packed = int4.get(_digest(original_data))
            if packed is None:
                raise RuntimeError(f"a {rows}×{cols} conv weight has no luts int4 codes: int4_blocks missed it")
            tail = (1,) * (original_data.ndim - 2)
            return QuantParams(data=packed.data.reshape(original_data.shape).astype(types.nptype_from_builtin(types.int4)),
                               scale=packed.scale.reshape(rows, cols // INT4_BLOCK, *tail), offset=None,
                               nbits=np.uint8(4))

    return _apply_graph_pass(mlmodel, LutsQuantizer(config))
