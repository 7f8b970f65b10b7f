"""Weight compression: the ``precision`` build option → Core ML's constexpr decompression ops.

The ANE streams compressed weights and expands them on the fly, so int4 and palettised
weights cut package size without changing activations (still fp16). The precision applies
to routed-expert packages, which hold nearly all of an MoE's weights; attention, dense and
shared FFNs and the LM head stay fp16: they are a small share of the bytes and the most
sensitive to 4-bit error (on a small random-weight Qwen3-MoE, int4 everywhere gave a logit
cosine of 0.96, int4 experts alone 0.998). Only 1×1-conv (linear) weights are compressed.

Codes, scales and palettes come from ``npumoe.luts`` (:func:`npumoe.models.checkpoints.lut.npu_codes`,
computed from the weights as stored, not from their fp16 rounding), so Core ML stores the values
the CPU LUT kernels run and, at int4, the HTP's w4a16 holds: int4 is
:data:`~npumoe.luts.mappings.NPU_INT4` as ``constexpr_blockwise_shift_scale``; palettize4/2 are
:data:`~npumoe.luts.mappings.NPU_PALETTES`, one palette per row and 64 inputs, the group's value
table (``constexpr_lut_to_dense``). A luts palette is affine, so at 4 bits it holds what an
asymmetric int4 block would, at 8 bits a weight against 4.5: int4 is the one to ship, palettize4
the one to compare with a ``npumoe quantize --bits 4`` CPU run. coremltools' quantisation and
palettisation passes only place the arrays, each fp16 constant matched to its codes by content.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

import numpy as np

from npumoe.core.base.errors import InputError
from npumoe.luts import mappings


@dataclass(frozen=True)
class Scheme:
    op: str | None  # the MIL constexpr op that decompresses it
    bits: float  # stored bits per weight, scales and palettes included (for package sizing)
    description: str


INT4_BLOCK = mappings.NPU_INT4.group  # input channels per int4 scale
PALETTES = {"palettize4": mappings.NPU_PALETTES[4], "palettize2": mappings.NPU_PALETTES[2]}


def _palette_bits(fmt: mappings.NpuFormat) -> float:
    return fmt.bits + 2**fmt.bits * 16 / fmt.group  # indices + one fp16 palette per row and group


SCHEMES = {
    "fp16": Scheme(None, 16, "fp16 weights"),
    "int4": Scheme("constexpr_blockwise_shift_scale", 4 + 16 / INT4_BLOCK,
                   f"int4 symmetric, one fp16 scale per {INT4_BLOCK} input channels (npumoe.luts codes)"),
    **{name: Scheme("constexpr_lut_to_dense", _palette_bits(fmt),
                    f"{fmt.bits}-bit palette per row and {fmt.group} input channels (npumoe.luts value tables)")
       for name, fmt in PALETTES.items()},
}


COMPRESSED_KINDS = frozenset({"experts"})


def precision_for(kind: str, precision: str) -> str:
    """The precision a package of graphs of ``kind`` is built at."""
    return precision if kind in COMPRESSED_KINDS else "fp16"


def weight_bits(kind: str, precision: str) -> float:
    """Bits one stored weight of a graph of ``kind`` takes at ``precision`` (the cost model's memory budget)."""
    return scheme(precision_for(kind, precision)).bits


def scheme(precision: str) -> Scheme:
    if precision not in SCHEMES:
        raise InputError(f"precision {precision!r} is not one of {', '.join(SCHEMES)} for the ANE.")
    return SCHEMES[precision]


def compress(mlmodel, precision: str, arrays: Mapping[bytes, object] | None = None):
    """The model with its conv weights compressed as ``precision`` says (fp16: unchanged); ``arrays`` holds
    every conv weight's luts arrays (:func:`luts_arrays`)."""
    if scheme(precision).op is None:
        return mlmodel
    import coremltools.optimize.coreml as cto
    from coremltools.converters.mil.mil import types
    from coremltools.models.utils import _apply_graph_pass
    from coremltools.optimize._utils import LutParams, QuantParams
    from coremltools.optimize.coreml._quantization_passes import linear_quantize_weights, palettize_weights

    def found(original_data):
        if (value := arrays.get(_digest(original_data))) is None:
            raise RuntimeError(f"a {original_data.shape[:2]} conv weight has no luts arrays: luts_arrays missed it")
        return value, (1,) * (original_data.ndim - 2)

    class LutsInt4(linear_quantize_weights):  # coremltools 9's passes; each override is the pass's one hook
        @classmethod
        def blockwise_compress_by_dtype(cls, original_data, dtype, mode, block_sizes):
            blocks, tail = found(original_data)
            return QuantParams(
                data=blocks.data.reshape(*blocks.data.shape, *tail).astype(types.nptype_from_builtin(types.int4)),
                scale=blocks.scale.reshape(*blocks.scale.shape, *tail), offset=None, nbits=np.uint8(4))

    class LutsPalettes(palettize_weights):
        @staticmethod
        def blockwise_compress(original_data, *args, **kwargs):
            palette, tail = found(original_data)
            index_type = types.nptype_from_builtin(getattr(types, palette.dtype))
            return LutParams(indices=palette.indices.reshape(*palette.indices.shape, *tail).astype(index_type),
                             lut=palette.lut.reshape(*palette.lut.shape[:2], *tail, *palette.lut.shape[2:]),
                             vector_axis=None)

    if precision == "int4":
        op_config = cto.OpLinearQuantizerConfig(mode="linear_symmetric", dtype="int4", granularity="per_block",
                                                block_size=INT4_BLOCK, weight_threshold=0)
        return _apply_graph_pass(mlmodel, LutsInt4(cto.OptimizationConfig(op_type_configs={"conv": op_config})))
    op_config = cto.OpPalettizerConfig(mode="uniform", nbits=PALETTES[precision].bits, granularity="per_tensor",
                                       weight_threshold=0)
    return _apply_graph_pass(mlmodel, LutsPalettes(cto.OptimizationConfig(op_type_configs={"conv": op_config})))


def luts_arrays(module, weights, precision: str) -> dict[bytes, object]:
    """Each conv kernel of ``module`` (an AneGraphModule) as the luts arrays ``precision`` stores
    (:class:`~npumoe.luts.mappings.BlockwiseShiftScale` or :class:`~npumoe.luts.mappings.LutToDense`), keyed by
    its fp16 bytes' digest: coremltools' passes see only the fp16 constants, the codes come from the weights."""
    from npumoe.models.checkpoints.lut import npu_codes

    fmt, to_arrays = ((mappings.NPU_INT4, mappings.blockwise_shift_scale) if precision == "int4"
                      else (PALETTES[precision], mappings.lut_to_dense))
    found = {}
    for name, kernels in module.conv_kernels().items():
        whole, start = to_arrays(npu_codes(weights, name, fmt)), 0
        for kernel in kernels:
            rows = slice(start, start + kernel.shape[0])
            found[_digest(kernel.numpy())] = _rows(whole, rows)
            start = rows.stop
    return found


def _rows(arrays, rows: slice):
    """The same arrays for a slice of the weight's rows (a kernel of a weight split into several convs)."""
    return replace(arrays, **{f.name: getattr(arrays, f.name)[rows] for f in fields(arrays)
                              if isinstance(getattr(arrays, f.name), np.ndarray)})


def _digest(fp16_kernel: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(fp16_kernel, np.float16).tobytes(), digest_size=16).digest()
