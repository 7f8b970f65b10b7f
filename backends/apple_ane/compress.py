"""Weight compression: the ``precision`` build option → Core ML's constexpr decompression ops.

The ANE streams compressed weights and expands them on the fly, so int4 and palettised
weights cut package size without changing activations (still fp16). The precision applies
to routed-expert packages, which hold nearly all of an MoE's weights; attention, dense and
shared FFNs and the LM head stay fp16: they are a small share of the bytes and the most
sensitive to 4-bit error (on a small random-weight Qwen3-MoE, int4 everywhere gave a logit
cosine of 0.96, int4 experts alone 0.998). Only 1×1-conv (linear) weights are compressed.

int4 values come from ``npumoe.luts`` (its symmetric quantiser and
:func:`npumoe.luts.mappings.blockwise_shift_scale`), so the codes Core ML stores are the ones
the CPU LUT kernels run; coremltools' quantisation pass only places them (its arithmetic
differs from luts' at rounding ties). Palettes are still coremltools' seeded k-means. Both are
deterministic, so identical weights in two functions compress identically and a
multifunction package still stores them once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from npumoe.errors import InputError


@dataclass(frozen=True)
class Scheme:
    op: str | None  # the MIL constexpr op that decompresses it
    bits: float  # stored bits per weight, scales and palettes included (for package sizing)
    description: str


INT4_BLOCK = 32  # input channels per int4 scale
PALETTE_GROUP = 16  # output channels sharing one palette

SCHEMES = {
    "fp16": Scheme(None, 16, "fp16 weights"),
    "int4": Scheme("constexpr_blockwise_shift_scale", 4 + 16 / INT4_BLOCK,
                   f"int4 symmetric, one fp16 scale per {INT4_BLOCK} input channels"),
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


def compress(mlmodel, precision: str):
    """The model with its conv weights compressed as ``precision`` says (fp16: unchanged)."""
    if scheme(precision).op is None:
        return mlmodel
    import coremltools.optimize.coreml as cto

    if precision == "int4":
        op_config = cto.OpLinearQuantizerConfig(mode="linear_symmetric", dtype="int4", granularity="per_block",
                                                block_size=INT4_BLOCK, weight_threshold=0)
        return luts_int4(mlmodel, cto.OptimizationConfig(op_type_configs={"conv": op_config}))
    op_config = cto.OpPalettizerConfig(mode="kmeans", nbits=int(scheme(precision).bits),
                                       granularity="per_grouped_channel", group_size=PALETTE_GROUP,
                                       weight_threshold=0)
    return cto.palettize_weights(mlmodel, cto.OptimizationConfig(op_type_configs={"conv": op_config}))


def luts_int4(mlmodel, config):
    """coremltools' per-block weight quantiser (which finds the conv weights and writes
    ``constexpr_blockwise_shift_scale``) with the codes and scales computed by ``npumoe.luts``."""
    from coremltools.converters.mil.mil import types
    from coremltools.models.utils import _apply_graph_pass
    from coremltools.optimize._utils import QuantParams
    from coremltools.optimize.coreml._quantization_passes import linear_quantize_weights

    from npumoe.luts import mappings, spec

    class LutsQuantizer(linear_quantize_weights):  # coremltools 9's pass; the override is its one hook
        @classmethod
        def blockwise_compress_by_dtype(cls, original_data, dtype, mode, block_sizes):
            rows, cols = original_data.shape[:2]
            weight = original_data.reshape(rows, cols).astype(np.float32)
            packed = mappings.blockwise_shift_scale(spec.quantize_pack(weight, 4, INT4_BLOCK, symmetric=True))
            tail = (1,) * (original_data.ndim - 2)
            return QuantParams(data=packed.data.reshape(original_data.shape).astype(types.nptype_from_builtin(types.int4)),
                               scale=packed.scale.reshape(rows, cols // INT4_BLOCK, *tail), offset=None,
                               nbits=np.uint8(4))

    return _apply_graph_pass(mlmodel, LutsQuantizer(config))
