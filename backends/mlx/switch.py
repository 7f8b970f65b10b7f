"""An expert group as mlx-lm's SwitchGLU runs its experts: each projection of every expert in one gathered product
(``mx.gather_mm``; ``mx.gather_qmm`` for quantised matrices), the row's expert chosen by index, instead of one
product per expert and projection. Expert g's rows are the graph's [Σ C_<g, Σ C_≤g): sorted, as gather wants them.

It applies to a group whose experts run the same ops on their slice of ``x`` (every graph npumoe's planner makes
for a routed expert group), their matrices alike (all dense, or all quantised; a luts checkpoint holds one format);
anything else is run op by op (:func:`~npumoe.backends.mlx.ops.graph_function`). MLX's CPU backend gathers only
fp32, so there bf16 and fp16 activations run op by op too. The graph still has the plan's static capacities: the
engine pads each expert's rows to them, as it does for every device.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

import mlx.core as mx
import numpy as np

from npumoe.backends.mlx.ops import OP_IMPLS
from npumoe.backends.mlx.weights import QuantizedMatrix
from npumoe.core.ir.graph import WEIGHT_PREFIX, Graph, Op

LINEARS = ("linear", "lut_linear")


def gatherable(graph: Graph) -> bool:
    """Is ``graph`` an expert group of two or more experts running the same ops on their slices of x, with weights
    only as its linears' matrices and biases?"""
    segments = expert_segments(graph)
    return (segments is not None and len(segments) > 1 and all(_renaming(segments[0], s) for s in segments[1:])
            and all(op.op in LINEARS or not any(n.startswith(WEIGHT_PREFIX) for n in op.inputs) for op in graph.ops))


def execution(graph: Graph, quantized: Collection[str], gather: bool) -> str:
    """How the mlx target runs an experts graph whose matrices ``quantized`` names are MLX quantised: "gather_mm"
    or "gather_qmm" (:func:`gathered_experts`; only where ``gather``, the device's dtype allowing), or "per expert"
    (op by op), said in the manifest."""
    matrices = {op.inputs[1][len(WEIGHT_PREFIX):] for op in graph.ops if op.op in LINEARS}
    if not gather or not gatherable(graph) or 0 < len(matrices & set(quantized)) < len(matrices):
        return "per expert"
    return "gather_qmm" if matrices & set(quantized) else "gather_mm"


def gathered_experts(graph: Graph, weights: Mapping[str, mx.array | QuantizedMatrix]) -> Callable:
    """A :func:`gatherable` ``graph``, its matrices all dense or all quantised alike, as a function x → [y] of
    gathered products."""
    segments = expert_segments(graph)
    run = switch_function(segments, weights)
    rows = mx.array(np.repeat(np.arange(len(segments), dtype=np.uint32), graph.meta["capacities"]))
    return lambda x: [run(x, rows, in_order=True)]


def switch_function(segments: list[list[Op]], weights: Mapping[str, mx.array | QuantizedMatrix]) -> Callable:
    """Experts alike (each one's ops, after the slice of x that starts it) as one function (x [rows, H], rows'
    experts [rows] uint32, indices into ``segments``; ``in_order``: sorted) → y [rows, H], each projection one
    gathered product over the experts' matrices stacked."""
    template, steps = segments[0], []
    for i, op in enumerate(template[1:], start=1):  # (after its slice)
        columns = [[s[i].inputs[j] for s in segments] for j in range(len(op.inputs))]
        args = [column[0] if not column[0].startswith(WEIGHT_PREFIX)
                else _stack([weights[n[len(WEIGHT_PREFIX):]] for n in column]) for column in columns]
        stacked = [a for a in args if not isinstance(a, str)]
        mx.eval([a.arrays("") if isinstance(a, QuantizedMatrix) else a for a in stacked])  # now, on this thread
        steps.append((op.op, args, op.a, op.outputs))
    return _switch_function(steps, template[0].outputs[0], template[-1].outputs[0])


def expert_segments(graph: Graph) -> list[list[Op]] | None:
    """Each expert's ops (its slice of x first), or None unless the graph is slices of x, each with its expert's
    ops, and a concat of their last outputs into y."""
    if graph.kind != "experts" or not graph.ops or graph.ops[-1].op != "concat":
        return None
    segments: list[list[Op]] = []
    for op in graph.ops[:-1]:
        if op.op == "slice" and op.inputs == ("x",):
            segments.append([op])
        elif segments:
            segments[-1].append(op)
        else:
            return None
    if graph.ops[-1].inputs != tuple(s[-1].outputs[0] for s in segments):
        return None
    return segments


def _renaming(template: list[Op], segment: list[Op]) -> dict[str, str] | None:
    """segment's value names → template's, or None unless segment runs template's ops (bar slice bounds and
    weights) on its own values in the same order."""
    renaming = {"x": "x"}
    if len(segment) != len(template) or len(segment) < 2:
        return None
    for mine, theirs in zip(segment, template):
        if mine.op != theirs.op or (mine.op != "slice" and mine.attrs != theirs.attrs):
            return None
        for a, b in zip(mine.inputs, theirs.inputs):
            if not a.startswith(WEIGHT_PREFIX) and renaming.get(a) != b:
                return None
        renaming.update(zip(mine.outputs, theirs.outputs))
    return renaming


def _stack(arrays: list) -> mx.array | QuantizedMatrix:
    """The experts' matrices (or biases) as one [experts, …] array (quantised ones: codes, scales and biases)."""
    if isinstance(arrays[0], QuantizedMatrix):
        return QuantizedMatrix(*(mx.stack([getattr(a, f) for a in arrays]) for f in ("codes", "scales", "biases")),
                               arrays[0].bits, arrays[0].group)
    return mx.stack(arrays)


def _switch_function(steps: list, x_name: str, y_name: str) -> Callable:
    def run(x: mx.array, rows: mx.array, in_order: bool = False) -> mx.array:
        def product(x, w, b=None):
            if isinstance(w, QuantizedMatrix):
                y = mx.gather_qmm(x, w.codes, w.scales, w.biases, rhs_indices=rows, transpose=True,
                                  group_size=w.group, bits=w.bits, sorted_indices=in_order).astype(x.dtype)
            else:
                y = mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=rows, sorted_indices=in_order)
            return y if b is None else y + b[rows][:, None]

        env = {x_name: x[:, None]}  # [rows, 1, H]: one row a product, its expert by index
        for op, args, attrs, outs in steps:
            values = [env[a] if isinstance(a, str) else a for a in args]
            env[outs[0]] = product(*values) if op in LINEARS else OP_IMPLS[op](*values, **attrs)
        return env[y_name][:, 0]

    return run
