"""The IR op set (:mod:`npumoe.core.ir.graph`) in MLX, op for op the reference interpreter's semantics
(:mod:`npumoe.core.compiler.interpreter`), and a graph bound to its weights as one MLX function.

Activations are fp32 by default, and a bf16 or fp16 weight meets them through MLX's type promotion, which widens
it exactly, as the interpreter does; with bf16 or fp16 activations (as mlx-lm runs such models) a product stays
in the weights' dtype. Attention is MLX's fused ``scaled_dot_product_attention`` (grouped-query heads and
sinks included), the kernel mlx-lm runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import mlx.core as mx

from npumoe.backends.mlx.weights import QuantizedMatrix
from npumoe.core.ir.graph import WEIGHT_PREFIX, Graph


def _linear(x, w, b=None):
    y = w.matmul(x) if isinstance(w, QuantizedMatrix) else x @ w.T
    return y if b is None else y + b


def _rmsnorm(x, w, *, eps):
    return mx.fast.rms_norm(x, w.astype(x.dtype), eps)


def _layernorm(x, w, b=None, *, eps):
    return mx.fast.layer_norm(x, w.astype(x.dtype), None if b is None else b.astype(x.dtype), eps)


def _rotate(x, cos, sin, interleaved: bool):
    if interleaved:
        half = cos.shape[-1] // 2
        c, s = cos[..., :half], sin[..., :half]
        even, odd = x[..., 0::2], x[..., 1::2]
        return mx.stack((even * c - odd * s, odd * c + even * s), axis=-1).reshape(x.shape)
    x1, x2 = mx.split(x, 2, axis=-1)
    return x * cos + mx.concatenate((-x2, x1), axis=-1) * sin


def _rope(x, cos, sin, *, rotary_dim, interleaved):
    cos, sin = cos[:, None], sin[:, None]  # broadcast over heads
    if rotary_dim == x.shape[-1]:
        return _rotate(x, cos, sin, interleaved)
    return mx.concatenate((_rotate(x[..., :rotary_dim], cos, sin, interleaved), x[..., rotary_dim:]), axis=-1)


def _sdpa(q, k, v, mask, sinks=None, *, scale):
    out = mx.fast.scaled_dot_product_attention(q[None], k[None], v[None], scale=scale, mask=mask, sinks=sinks)
    return out[0]


def _gelu(x, *, approximate):
    if approximate == "tanh":
        return 0.5 * x * (1 + mx.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    return 0.5 * x * (1 + mx.erf(x / math.sqrt(2)))


def _slice(x, *, axis, start, stop, step):
    return x[(slice(None),) * axis + (slice(start, stop, step),)]


OP_IMPLS: dict[str, Callable] = {
    "linear": _linear,
    "lut_linear": _linear,  # its weight arrives as a QuantizedMatrix
    "rmsnorm": _rmsnorm,
    "layernorm": _layernorm,
    "rope": _rope,
    "sdpa": _sdpa,
    "silu": lambda x: x * mx.sigmoid(x),
    "gelu": _gelu,
    "relu": lambda x: mx.maximum(x, 0),
    "sigmoid": mx.sigmoid,
    "add": mx.add,
    "mul": mx.multiply,
    "affine": lambda x, *, scale, shift: x * scale + shift,
    "clamp": lambda x, *, min, max: mx.clip(x, min, max),
    "reshape": lambda x, *, shape: x.reshape(shape),
    "transpose": lambda x, *, perm: x.transpose(perm),
    "slice": _slice,
    "concat": lambda *xs, axis: mx.concatenate(xs, axis=axis),
}


def graph_function(graph: Graph, weights: Mapping[str, mx.array | QuantizedMatrix],
                   inputs: list[str], impls: Mapping[str, Callable] = OP_IMPLS) -> Callable[..., list[mx.array]]:
    """``graph`` as an MLX function of its ``inputs`` (in that order) → its outputs (in declared order), the
    weights bound in, each op run by ``impls``."""
    steps = []
    for op in graph.ops:
        args = [weights[name[len(WEIGHT_PREFIX):]] if name.startswith(WEIGHT_PREFIX) else name for name in op.inputs]
        steps.append((impls[op.op], args, op.a, op.outputs))
    outputs = list(graph.outputs)

    def run(*values: mx.array) -> list[mx.array]:
        env = dict(zip(inputs, values))
        for impl, args, attrs, outs in steps:
            result = impl(*[env[a] if isinstance(a, str) else a for a in args], **attrs)
            env.update(zip(outs, result if isinstance(result, tuple) else (result,)))
        return [env[name] for name in outputs]

    return run
