"""Weight compression: the ``precision`` build option → Core ML's constexpr decompression ops.

The ANE streams compressed weights and expands them on the fly, so int4 and palettised
weights cut package size without changing activations (still fp16). The precision applies
to routed-expert packages, which hold nearly all of an MoE's weights; attention, dense and
shared FFNs and the LM head stay fp16: they are a small share of the bytes and the most
sensitive to 4-bit error (on a small random-weight Qwen3-MoE, int4 everywhere gave a logit
cosine of 0.96, int4 experts alone 0.998). Only 1×1-conv (linear) weights are compressed.

The values come from coremltools' own optimizers for now; ``npumoe.luts.mappings`` (the
T-MAN low-bit format mapped to exactly these constexpr ops' arrays) replaces them once it
exists, so one packed weight serves the CPU kernels and Core ML alike. Both are
deterministic (k-means is seeded), so identical weights in two functions compress
identically and a multifunction package still stores them once.
"""

from __future__ import annotations

from dataclasses import dataclass

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
        return cto.linear_quantize_weights(mlmodel, cto.OptimizationConfig(op_type_configs={"conv": op_config}))
    op_config = cto.OpPalettizerConfig(mode="kmeans", nbits=int(scheme(precision).bits),
                                       granularity="per_grouped_channel", group_size=PALETTE_GROUP,
                                       weight_threshold=0)
    return cto.palettize_weights(mlmodel, cto.OptimizationConfig(op_type_configs={"conv": op_config}))
