"""The device-neutral program: static graphs that backends lower, and the host steps around them.

A :class:`Graph` is a straight-line list of :class:`Op` over named values with static shapes.
Weights are referenced by canonical name (see ``npumoe.models``), never embedded, so one
set of weights serves every graph and every backend. The op set is deliberately small; the
interpreter (``npumoe.core.compiler.interpreter``) is its reference semantics:

=============  ==================================================================================
op             semantics (inputs → outputs; attrs)
=============  ==================================================================================
linear         x[..., in], W[out, in], (b[out]) → x @ Wᵀ + b
lut_linear     like linear, W stored in the ``npumoe.luts`` low-bit format
rmsnorm        x, w → x · rsqrt(mean(x², -1) + eps) · w                       ; eps
layernorm      x, w, b → (x − mean) · rsqrt(var + eps) · w + b                 ; eps
rope           x[S, heads, D], cos[S, R/2·2], sin → x with its first R dims rotated
               (halves, or adjacent pairs when ``interleaved``)                ; rotary_dim, interleaved
sdpa           q[Hq, S, D], k[Hkv, L, D], v[Hkv, L, Dv], mask[S, L], (sinks[Hq]) → [Hq, S, Dv]
               softmax(q·kᵀ·scale + mask) · v with GQA head sharing; a sink adds one more
               logit per head to the softmax denominator                        ; scale
silu gelu      elementwise activations (gelu: ``approximate`` "none" or "tanh")
relu sigmoid
add mul        elementwise, numpy broadcasting
affine         x · scale + shift (scalars)                                      ; scale, shift
clamp          x clipped to [min, max] (either may be None)                     ; min, max
reshape        static target shape                                              ; shape
transpose      axis permutation                                                 ; perm
slice          x[start:stop] along axis (step 1 or 2)                           ; axis, start, stop, step
concat         along axis                                                       ; axis
=============  ==================================================================================

Every graph input and output declares its :class:`Role`, and the engine and every executor act on
roles, never on names: what is laid out as an activation, what a device may clamp, what a stateful
executor keeps itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

OPS = frozenset(
    {
        "linear", "lut_linear", "rmsnorm", "layernorm", "rope", "sdpa",
        "silu", "gelu", "relu", "sigmoid", "add", "mul", "affine", "clamp",
        "reshape", "transpose", "slice", "concat",
    }
)  # fmt: skip

WEIGHT_PREFIX = "w:"  # an op input naming a canonical weight rather than a graph value


class Role(str, Enum):
    """What a graph input or output is to the host and to a device."""

    ACTIVATION = "activation"  # [rows, channels] hidden states flowing layer to layer
    HOST_TABLE = "host_table"  # built by the host per call from positions (rope cos/sin): not an activation
    MASK = "mask"  # additive attention mask, −inf where masked: a device may floor it at its own −big
    KV_CACHE = "kv_cache"  # the cache attention reads; an executor that keeps state holds it itself
    KV_NEW = "kv_new"  # an output: this call's cache rows, appended to the input its ``updates`` names
    POSITION = "position"  # int32 [1], the cache length before this call: read only by stateful executors


@dataclass(frozen=True)
class TensorType:
    shape: tuple[int, ...]
    dtype: str = "float32"
    role: Role = Role.ACTIVATION
    updates: str | None = None  # a KV_NEW output: the KV_CACHE input it extends


@dataclass(frozen=True)
class Op:
    op: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: tuple[tuple[str, Any], ...] = ()

    @property
    def a(self) -> dict[str, Any]:
        return dict(self.attrs)


@dataclass
class Graph:
    """One static graph. ``kind`` tells the planner and backends what it is for:
    "attention", "ffn" (a dense MLP or shared expert), "experts" (an expert group), "lm_head"."""

    name: str
    kind: str
    inputs: dict[str, TensorType]
    outputs: dict[str, TensorType]
    ops: list[Op]
    layer: int | None = None
    placement: str = "cpu"  # "npu" or "cpu": decided by the plan, never by the graph
    meta: dict[str, Any] = field(default_factory=dict)

    def inputs_with(self, role: Role) -> list[str]:
        return [name for name, t in self.inputs.items() if t.role == role]

    def stateless_inputs(self) -> list[str]:
        """What an executor that keeps no state takes: every input but the position."""
        return [name for name, t in self.inputs.items() if t.role != Role.POSITION]

    def weight_names(self) -> list[str]:
        seen: dict[str, None] = {}
        for op in self.ops:
            for name in op.inputs:
                if name.startswith(WEIGHT_PREFIX):
                    seen[name[len(WEIGHT_PREFIX):]] = None
        return list(seen)


class GraphBuilder:
    """Appends ops with fresh value names; keeps graph-building code short and readable."""

    def __init__(self, prefix: str = ""):
        self.ops: list[Op] = []
        self._count = 0
        self._prefix = prefix

    def __call__(self, op: str, *inputs: str, n_out: int = 1, **attrs) -> str | tuple[str, ...]:
        if op not in OPS:
            raise ValueError(f"unknown IR op {op!r}")
        outs = tuple(self._fresh(op) for _ in range(n_out))
        self.ops.append(Op(op, tuple(inputs), outs, tuple(sorted(attrs.items()))))
        return outs[0] if n_out == 1 else outs

    def _fresh(self, op: str) -> str:
        self._count += 1
        return f"{self._prefix}{op}_{self._count}"

    def rename_output(self, value: str, name: str) -> str:
        """Give the op that produced ``value`` a stable, public output name."""
        for i, op in enumerate(self.ops):
            if value in op.outputs:
                outs = tuple(name if o == value else o for o in op.outputs)
                self.ops[i] = Op(op.op, op.inputs, outs, op.attrs)
        for i, op in enumerate(self.ops):
            if value in op.inputs:
                ins = tuple(name if v == value else v for v in op.inputs)
                self.ops[i] = Op(op.op, ins, op.outputs, op.attrs)
        return name


def w(name: str) -> str:
    """Reference the canonical weight ``name`` as an op input."""
    return WEIGHT_PREFIX + name
