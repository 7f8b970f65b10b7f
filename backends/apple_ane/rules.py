"""The ANE rule table: what a Core ML function must satisfy to stay on the Neural Engine.

One table serves two readers. The planner's :data:`~npumoe.backends.apple_ane.caps.ANE_CAPS`
is derived from it, and ``npumoe lint`` checks saved packages against it, so whatever the
planner emits for the ANE is what the lint accepts. No coremltools import here.

Each :data:`RULES` entry names its requirement and public source:

* ``static-shapes`` every input, output, state and intermediate has fixed dimensions
  (NPUMoE Fig. 4: dynamic shapes ×);
* ``ane-ops`` only MIL ops in :data:`ANE_OPS`, never those in :data:`REJECTED_OPS` (NPUMoE
  Fig. 4: indexing, top-k, scatter/gather, comparisons, layernorm, custom ops ×;
  hollance/neural-engine "unsupported layers": gather, custom layers);
* ``dynamic-index`` no index computed at run time, except the offset of a state update
  (``slice_update`` → ``write_state``, the KV cache write; NPUMoE §3.2 puts the stateful KV
  cache update on the NPU);
* ``fp16`` computed floating values are fp16; int32 only on the path from the ``position``
  input to that offset (ane-guide.readthedocs.io ch. 17, "dtype rule": the datapath is fp16);
* ``states`` at most 2 states, dims after the first powers of two, sequence and head dims
  ≥ 32 (SqueezeBits, "Disaggregated inference on Apple Silicon", 2025: many states fail to
  compile, non-power-of-two state dims fail at run time);
* ``axis-size`` rank-4 tensors: channel axis ≤ 65536, other axes ≤ 16384; other ranks: every
  axis ≤ 16384 (the ANE compiler's own range check, "N[1-65536] D[1-16384] C[1-65536]
  H[1-16384] W[1-16384]"; ane-guide ch. 17, measured on M1);
* ``graph-bytes`` the weights one function reads ≤ 1.2 GB (NPUMoE §4.2: larger graphs fell
  back to CPU on M2 Ultra);
* ``package-bytes`` one ``.mlpackage`` ≤ 1 GB for iOS, ≤ 2 GB for macOS (ANEMLL
  docs/convert.md: "ANE models on iOS are limited to 1GB file size; macOS supports up to ~2GB").
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    id: str
    requirement: str
    source: str


RULES = {
    r.id: r
    for r in (
        Rule("static-shapes", "every input, output, state and intermediate has fixed dimensions", "NPUMoE Fig. 4"),
        Rule("ane-ops", "only MIL ops the ANE takes: no gather/scatter, top-k, comparisons, layer_norm, custom ops",
             "NPUMoE Fig. 4"),
        Rule("dynamic-index", "no index computed at run time except the KV write offset of a state update",
             "NPUMoE Fig. 4, §3.2"),
        Rule("fp16", "computed floating values are fp16; int32 only on the KV write-offset path", "ane-guide ch. 17"),
        Rule("states", "at most 2 states; dims after the first powers of two; sequence and head dims >= 32",
             "SqueezeBits 2025"),
        Rule("axis-size", "channel axis <= 65536, every other axis <= 16384", "ANE compiler range check"),
        Rule("graph-bytes", "the weights one function reads <= 1.2 GB", "NPUMoE §4.2"),
        Rule("package-bytes", "one package <= 1 GB (iOS) / 2 GB (macOS)", "ANEMLL docs/convert.md"),
    )
}

# -- ops --------------------------------------------------------------------------------------------
ANE_OPS = frozenset({
    "const", "constexpr_blockwise_shift_scale", "constexpr_lut_to_dense",
    "conv", "matmul", "scaled_dot_product_attention", "softmax",
    "add", "sub", "mul", "real_div", "pow", "rsqrt", "sqrt", "maximum", "minimum", "clip",
    "silu", "sigmoid", "relu", "gelu", "reduce_mean", "reduce_sum",
    "reshape", "transpose", "concat", "split", "slice_by_index", "slice_by_size", "expand_dims", "squeeze",
    "tile", "identity", "read_state", "write_state", "slice_update",
})  # fmt: skip

REJECTED_OPS = {  # op → the NPUMoE Figure 4 row that rules it out
    **dict.fromkeys(("gather", "gather_nd", "gather_along_axis", "scatter", "scatter_nd", "scatter_along_axis"),
                    "scatter/gather"),
    **dict.fromkeys(("topk", "argsort", "reduce_argmax", "reduce_argmin"), "top-k"),
    **dict.fromkeys(("equal", "not_equal", "greater", "greater_equal", "less", "less_equal", "select",
                     "logical_and", "logical_or", "logical_not", "logical_xor"), "comparison ops"),
    "layer_norm": "layernorm",
    **dict.fromkeys(("while_loop", "cond", "non_zero", "shape", "range_1d", "fill_like"), "dynamic shapes"),
    "custom_layer": "custom operators",
}

STATE_WRITE_OP = "slice_update"  # the only op allowed a runtime index, and only into a state update
POSITION_INPUT = "position"  # int32 [1]: the cache length before this call (the KV write offset)
INDEX_PARAMS = frozenset({"begin", "end", "size", "shape", "reps", "axes", "perm", "indices", "split_sizes", "axis"})

# -- numbers ----------------------------------------------------------------------------------------
COMPUTE_DTYPE = "float16"
CHANNEL_ALIGNMENT = 16  # ANE tiles channels and sequence in multiples of 16 (NPUMoE §3.2)
MAX_STATES = 2
MIN_STATE_DIM = 32  # sequence and head dims of a state
MAX_AXIS = 16384
MAX_CHANNELS = 65536
MAX_GRAPH_WEIGHT_BYTES = int(1.2e9)
MAX_PACKAGE_BYTES = {"ios": 10**9, "macos": 2 * 10**9}
DEFAULT_PLATFORM = "ios"  # the stricter limit: one build serves both

# -- IR ops and the MIL ops our lowering (layout.py) turns them into --------------------------------
IR_LOWERING = {
    "linear": {"conv"},
    "rmsnorm": {"pow", "reduce_mean", "add", "rsqrt", "mul"},
    "layernorm": {"reduce_mean", "sub", "pow", "add", "rsqrt", "mul"},
    "rope": {"mul", "add", "concat", "split", "slice_by_index", "expand_dims", "reshape"},
    "sdpa": {"scaled_dot_product_attention", "matmul", "softmax", "add", "mul", "concat", "tile", "reshape",
             "expand_dims", "slice_by_index"},
    "silu": {"silu"}, "gelu": {"gelu"}, "relu": {"relu"}, "sigmoid": {"sigmoid"},
    "add": {"add"}, "mul": {"mul"}, "affine": {"mul", "add"}, "clamp": {"clip", "maximum", "minimum"},
    "reshape": {"reshape", "transpose"}, "transpose": {"transpose"},
    "slice": {"slice_by_index"}, "concat": {"concat"},
}  # fmt: skip


def ir_ops_on_ane() -> frozenset[str]:
    """IR ops whose lowering stays inside :data:`ANE_OPS` (``lut_linear`` has none: low-bit
    weights reach Core ML as constexpr decompression of a plain ``linear``)."""
    return frozenset(op for op, mil in IR_LOWERING.items() if mil <= ANE_OPS)


def max_graph_bytes(platform: str = DEFAULT_PLATFORM) -> int:
    """Weights one planned graph may carry: the graph budget, and never more than a package."""
    return min(MAX_GRAPH_WEIGHT_BYTES, MAX_PACKAGE_BYTES[platform])


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def state_dims_ok(shape: tuple[int, ...]) -> bool:
    """Every dim after the first a power of two; the last two (sequence, head) at least 32."""
    return all(is_pow2(d) for d in shape[1:]) and all(d >= MIN_STATE_DIM for d in shape[-2:])


def axis_limit(rank: int, axis: int) -> int:
    return MAX_CHANNELS if rank == 4 and axis == 1 else MAX_AXIS
