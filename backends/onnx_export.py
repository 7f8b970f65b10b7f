"""IR graph → ONNX model (fp32, static shapes): standard ONNX in the subset QNN's HTP compiles, which
OpenVINO (the Intel NPU backend) reads as well.

Each IR op becomes a few standard ONNX nodes whose names start with the IR op's output
value (``linear_3/MatMul``), so a node the HTP rejects can be traced back to its IR op.
Choices made for the HTP, each checked on the x86 HTP:

* ``linear`` is a MatMul against the transposed weight [in, out] (QNN's FullyConnected
  layout; per-channel weight quantisation then runs along axis 1);
* no Erf (rejected): ``gelu`` is ONNX's Gelu op (opset 20), ``silu`` is x·sigmoid(x);
* ``rmsnorm`` divides by the root mean square: the HTP's fixed-point Reciprocal saturates
  at 1 (an input of std 0.05 comes out 18× too small in w8a16);
* ``sdpa`` folds the GQA head groups into the query rows, so K and V are never repeated.

Initializers are sorted and named after their canonical weights, so the same graph and
weights always serialise to the same bytes.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from npumoe.core.ir.graph import WEIGHT_PREFIX, Graph, Op

OPSET = 21  # blocked DequantizeLinear (int4 QDQ) needs 21; QNN 2.51 accepts 13-28
DTYPE = np.float32
TRANSPOSED = ".T"  # suffix of a weight initializer stored transposed: a linear's [in, out]


class _Builder:
    """Accumulates nodes and initializers for one ONNX graph."""

    def __init__(self, weights: Mapping[str, torch.Tensor], shapes: dict[str, tuple[int, ...]]):
        from onnx import helper, numpy_helper

        self.helper, self.numpy_helper = helper, numpy_helper
        self.weights, self.shapes = weights, shapes
        self.nodes: list = []
        self.inits: dict[str, np.ndarray] = {}
        self.prefix = ""
        self._count = 0

    def const(self, value, dtype=DTYPE) -> str:
        arr = np.asarray(value, dtype=dtype).reshape(np.shape(value) or (1,))
        self._count += 1
        name = f"{self.prefix}/c{self._count}"
        self.inits[name] = arr
        return name

    def weight(self, ref: str, transpose: bool = False) -> str:
        name = ref[len(WEIGHT_PREFIX):]
        key = f"{name}{TRANSPOSED}" if transpose else name
        if key not in self.inits:
            arr = self.weights[name].detach().float().numpy()
            self.inits[key] = np.ascontiguousarray(arr.T if transpose else arr)
        return key

    def node(self, op_type: str, *inputs: str, out: str | None = None, **attrs) -> str:
        self._count += 1
        out = out or f"{self.prefix}/{op_type}_{self._count}"
        self.nodes.append(self.helper.make_node(op_type, list(inputs), [out],
                                                name=f"{self.prefix}/{op_type}_{self._count}", **attrs))
        return out

    def value(self, ref: str) -> str:
        return self.weight(ref) if ref.startswith(WEIGHT_PREFIX) else ref


# -- one function per IR op; each returns the name of its (single) ONNX output ------------------------------------
def _linear(b: _Builder, op: Op, out: str) -> str:
    x, w, *bias = op.inputs
    y = b.node("MatMul", x, b.weight(w, transpose=True), out=None if bias else out)
    return b.node("Add", y, b.value(bias[0]), out=out) if bias else y


def _rms(b: _Builder, x: str, w: str, eps: float, out: str) -> str:
    ms = b.node("ReduceMean", b.node("Mul", x, x), b.const([-1], np.int64), keepdims=1)
    return b.node("Mul", b.node("Div", x, b.node("Sqrt", b.node("Add", ms, b.const(eps)))), w, out=out)


def _rmsnorm(b, op, out):
    x, w = op.inputs
    return _rms(b, x, b.value(w), op.a["eps"], out)


def _layernorm(b, op, out):
    x, w, *bias = (b.value(v) for v in op.inputs)
    return b.node("LayerNormalization", x, w, *bias, out=out, axis=-1, epsilon=op.a["eps"])


def _slice(b: _Builder, x: str, axis: int, start: int, stop: int, step: int = 1, out: str | None = None) -> str:
    consts = (b.const([v], np.int64) for v in (start, stop, axis, step))
    return b.node("Slice", x, *consts, out=out)


def _rope(b, op, out):
    x, cos, sin = op.inputs
    rot_dim, interleaved = op.a["rotary_dim"], op.a["interleaved"]
    seq, heads, dim = b.shapes[x]
    cos3 = b.node("Reshape", cos, b.const([seq, 1, rot_dim], np.int64))
    sin3 = b.node("Reshape", sin, b.const([seq, 1, rot_dim], np.int64))
    rot = x if rot_dim == dim else _slice(b, x, 2, 0, rot_dim)
    if interleaved:
        half = rot_dim // 2
        c, s = _slice(b, cos3, 2, 0, half), _slice(b, sin3, 2, 0, half)
        even, odd = _slice(b, rot, 2, 0, rot_dim, 2), _slice(b, rot, 2, 1, rot_dim, 2)
        first = b.node("Sub", b.node("Mul", even, c), b.node("Mul", odd, s))
        second = b.node("Add", b.node("Mul", odd, c), b.node("Mul", even, s))
        pairs = b.node("Concat", b.node("Unsqueeze", first, b.const([-1], np.int64)),
                       b.node("Unsqueeze", second, b.const([-1], np.int64)), axis=-1)
        rotated = b.node("Reshape", pairs, b.const([seq, heads, rot_dim], np.int64),
                         out=out if rot_dim == dim else None)
    else:
        half = rot_dim // 2
        x1, x2 = _slice(b, rot, 2, 0, half), _slice(b, rot, 2, half, rot_dim)
        turned = b.node("Concat", b.node("Neg", x2), x1, axis=-1)
        rotated = b.node("Add", b.node("Mul", rot, cos3), b.node("Mul", turned, sin3),
                         out=out if rot_dim == dim else None)
    if rot_dim == dim:
        return rotated
    return b.node("Concat", rotated, _slice(b, x, 2, rot_dim, dim), axis=-1, out=out)


def _sdpa(b, op, out):
    q, k, v, mask, *sinks = op.inputs
    (hq, seq, dk), (hkv, length, _), dv = b.shapes[q], b.shapes[k], b.shapes[v][2]
    groups = hq // hkv
    qg = b.node("Reshape", b.node("Mul", q, b.const(op.a["scale"])), b.const([hkv, groups * seq, dk], np.int64))
    logits = b.node("MatMul", qg, b.node("Transpose", k, perm=[0, 2, 1]))
    logits = b.node("Reshape", logits, b.const([hq, seq, length], np.int64))
    logits = b.node("Add", logits, mask)
    if sinks:
        sink = b.node("Expand", b.node("Reshape", b.value(sinks[0]), b.const([hq, 1, 1], np.int64)),
                      b.const([hq, seq, 1], np.int64))
        probs = _slice(b, b.node("Softmax", b.node("Concat", logits, sink, axis=-1), axis=-1), 2, 0, length)
    else:
        probs = b.node("Softmax", logits, axis=-1)
    probs = b.node("Reshape", probs, b.const([hkv, groups * seq, length], np.int64))
    o = b.node("MatMul", probs, v)
    return b.node("Reshape", o, b.const([hq, seq, dv], np.int64), out=out)


def _gelu(b, op, out):
    return b.node("Gelu", op.inputs[0], out=out, approximate=op.a["approximate"])


def _silu(b, op, out):
    return b.node("Mul", op.inputs[0], b.node("Sigmoid", op.inputs[0]), out=out)


def _affine(b, op, out):
    scale, shift = op.a["scale"], op.a["shift"]
    if shift == 0.0:
        return b.node("Mul", op.inputs[0], b.const(scale), out=out)
    x = op.inputs[0] if scale == 1.0 else b.node("Mul", op.inputs[0], b.const(scale))
    return b.node("Add", x, b.const(shift), out=out)


def _clamp(b, op, out):
    lo = b.const(op.a["min"]) if op.a["min"] is not None else ""
    hi = b.const(op.a["max"]) if op.a["max"] is not None else ""
    return b.node("Clip", op.inputs[0], lo, *([hi] if hi else []), out=out)


def _elementwise(onnx_op: str):
    return lambda b, op, out: b.node(onnx_op, *(b.value(v) for v in op.inputs), out=out)


LOWERINGS = {
    "linear": _linear,
    "rmsnorm": _rmsnorm,
    "layernorm": _layernorm,
    "rope": _rope,
    "sdpa": _sdpa,
    "gelu": _gelu,
    "silu": _silu,
    "relu": _elementwise("Relu"),
    "sigmoid": _elementwise("Sigmoid"),
    "add": _elementwise("Add"),
    "mul": _elementwise("Mul"),
    "affine": _affine,
    "clamp": _clamp,
    "reshape": lambda b, op, out: b.node("Reshape", op.inputs[0], b.const(op.a["shape"], np.int64), out=out),
    "transpose": lambda b, op, out: b.node("Transpose", op.inputs[0], out=out, perm=list(op.a["perm"])),
    "slice": lambda b, op, out: _slice(b, op.inputs[0], op.a["axis"], op.a["start"], op.a["stop"], op.a["step"], out),
    "concat": lambda b, op, out: b.node("Concat", *op.inputs, out=out, axis=op.a["axis"]),
}


class UnsupportedOp(Exception):
    """An IR op with no ONNX lowering (the caller turns it into a typed error naming graph and op)."""

    def __init__(self, op: Op):
        super().__init__(op.op)
        self.op = op


def to_onnx(graph: Graph, weights: Mapping[str, torch.Tensor]):
    """The graph as an ``onnx.ModelProto``: inputs and outputs keep their IR names and static shapes."""
    from onnx import TensorProto, helper

    for op in graph.ops:
        if op.op not in LOWERINGS:
            raise UnsupportedOp(op)
    from npumoe.core.compiler.interpreter import value_shapes

    b = _Builder(weights, value_shapes(graph, weights))
    for op in graph.ops:
        b.prefix = op.outputs[0]
        LOWERINGS[op.op](b, op, op.outputs[0])

    def info(name, shape):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape))

    used = {v for n in b.nodes for v in n.input}
    onnx_graph = helper.make_graph(
        b.nodes, graph.name,
        [info(n, t.shape) for n, t in graph.inputs.items() if n in used],
        [info(n, t.shape) for n, t in graph.outputs.items()],
        [b.numpy_helper.from_array(arr, name) for name, arr in sorted(b.inits.items())],
    )
    model = helper.make_model(onnx_graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="npumoe", producer_version="1")
    model.ir_version = 10
    return model
