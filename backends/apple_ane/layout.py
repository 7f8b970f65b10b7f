"""IR graph → torch module in the ANE's layout, ready to trace into Core ML.

The ANE computes on [1, C, 1, S] tensors and runs linear layers fastest as 1×1
convolutions (Apple, "Deploying Transformers on the Apple Neural Engine", 2022). The module
replays a graph's ops in that layout: an [S, C] activation stays [1, C, 1, S] through every
op that can take it (linear, norms, elementwise, row slices and concats) and is put back in
the IR's layout only where an op needs that (head reshapes, rope, attention).

Shapes are static Python ints inferred once on the meta device, never read from tensors
while tracing (a traced ``x.shape`` becomes a dynamic ``int`` op in Core ML). With a
:class:`~npumoe.backends.apple_ane.kvstate.KVState`, the graph's ``k_cache``/``v_cache``
inputs become reads of two state buffers and the chunk's ``k_new``/``v_new`` are written
into them at ``position``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch
import torch.nn.functional as F

from npumoe.backends.apple_ane.kvstate import KVState
from npumoe.backends.apple_ane.rules import MAX_CHANNELS
from npumoe.core.compiler.interpreter import value_shapes
from npumoe.core.ir.graph import WEIGHT_PREFIX, Graph, Op, Role, TensorType

# Output channels per 1×1 conv: a wider linear (an LM head) becomes several convs and a concat.
# coremltools' fp16 overflow check takes ~40 bytes per weight of one const, so a 50k-row LM head
# held 4 GB more while converting; at 8192 rows it holds ~0.7 GB.
CONV_ROWS = 8192


class Val(NamedTuple):
    t: torch.Tensor | tuple[torch.Tensor, ...]  # a tuple: an output's channel parts (see output_parts)
    act: bool  # True: a logical [S, C] activation held as [1, C, 1, S]


def is_activation(t: TensorType) -> bool:
    """Held as [1, C, 1, S] on the ANE: declared an activation, and [S, C]."""
    return t.role == Role.ACTIVATION and len(t.shape) == 2


def to_ane(x: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    rows, channels = shape
    return x.transpose(0, 1).reshape(1, channels, 1, rows)


def from_ane(x: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    rows, channels = shape
    return x.reshape(channels, rows).transpose(0, 1)


class AneGraphModule(torch.nn.Module):
    """One IR graph as a traceable module: ``forward(*inputs)`` in :meth:`input_names` order."""

    def __init__(self, graph: Graph, weights: Mapping[str, torch.Tensor], kv: KVState | None = None,
                 dtype: torch.dtype = torch.float16):
        """``dtype``: what weights and states are held in: Core ML traces fp16, so building in fp16
        (not fp32, then ``.half()``) keeps one layer's experts at their fp16 size while converting."""
        super().__init__()
        self.dtype = dtype
        self.graph, self.kv = graph, kv
        self.shapes = value_shapes(graph, weights)
        self._weight_attr: dict[str, str] = {}
        self._conv_attrs: dict[str, list[str]] = {}
        for op in graph.ops:
            for i, name in enumerate(op.inputs):
                if name.startswith(WEIGHT_PREFIX):
                    self._register(name[len(WEIGHT_PREFIX):], weights, as_conv=op.op == "linear" and i == 1)
        if kv is not None:
            for name, shape in kv.shapes.items():
                self.register_buffer(name, torch.zeros(shape, dtype=dtype))

    def conv_kernels(self) -> dict[str, list[torch.Tensor]]:
        """Linear weight name → its 1×1-conv kernels ([rows, in, 1, 1], row chunks in order)."""
        return {name: [getattr(self, attr) for attr in attrs] for name, attrs in self._conv_attrs.items()}

    def _register(self, name: str, weights, as_conv: bool) -> None:
        w = weights[name].detach().to(self.dtype, copy=True)  # a copy: never a view of the mapped checkpoint
        attr = name.replace(".", "_")
        if not as_conv:
            self.register_buffer(attr, w)
            self._weight_attr[name] = attr
            return
        kernels = []
        for k, rows in enumerate(w.split(CONV_ROWS)):  # [out, in] → 1×1 conv kernels of ≤ CONV_ROWS outputs
            self.register_buffer(f"{attr}_conv{k}", rows[:, :, None, None].clone())
            kernels.append(f"{attr}_conv{k}")
        self._conv_attrs[name] = kernels

    @property
    def stateful(self) -> bool:
        return self.kv is not None

    def input_names(self) -> list[str]:
        """The function's inputs: the graph's, less the KV cache a stateful module keeps as states, or less
        the position only a stateful one reads."""
        skip = Role.KV_CACHE if self.stateful else Role.POSITION
        return [n for n, t in self.graph.inputs.items() if t.role != skip]

    def input_layouts(self) -> dict[str, str]:
        """"ane" for [S, C] activations fed as [1, C, 1, S], "ir" for everything else."""
        return {n: "ane" if is_activation(self.graph.inputs[n]) else "ir" for n in self.input_names()}

    def input_shapes(self) -> dict[str, tuple[int, ...]]:
        out = {}
        for name, layout in self.input_layouts().items():
            shape = self.graph.inputs[name].shape
            out[name] = (1, shape[1], 1, shape[0]) if layout == "ane" else shape
        return out

    def input_is_int(self, name: str) -> bool:
        """Integer inputs (the position) stay int32; every other input is fp16 on the device."""
        return self.graph.inputs[name].dtype == "int32"

    def output_layouts(self) -> dict[str, str]:
        return {n: "ane" if is_activation(t) else "ir" for n, t in self.graph.outputs.items()}

    def output_parts(self) -> dict[str, list[str]]:
        """Outputs wider than the ANE's channel axis (a 151,936-token LM head): function outputs of at most
        MAX_CHANNELS channels each, named ``NAME_i``, that the executor concatenates; the whole width never
        exists on the device. Every other output is its own one part."""
        parts, read = {}, {v for op in self.graph.ops for v in op.inputs}
        for n, layout in self.output_layouts().items():
            channels = self.graph.outputs[n].shape[-1]
            wide = layout == "ane" and channels > MAX_CHANNELS and n not in read
            parts[n] = [f"{n}_{i}" for i in range(-(-channels // MAX_CHANNELS))] if wide else [n]
        return parts

    def output_names(self) -> list[str]:
        return [p for parts in self.output_parts().values() for p in parts]

    # -- tracing ----------------------------------------------------------------------------------
    def forward(self, *args: torch.Tensor):
        env: dict[str, Val] = {}
        names = self.input_names()
        for name, t in zip(names, args):
            if self.graph.inputs[name].role != Role.POSITION:
                env[name] = Val(t, self.input_layouts()[name] == "ane")
        if self.stateful:
            for name in self.graph.inputs_with(Role.KV_CACHE):
                heads, length, dim = self.shapes[name]
                env[name] = Val(getattr(self, name)[self.kv.slot(self.graph.layer), :heads, :length, :dim], False)
        for op in self.graph.ops:
            env[op.outputs[0]] = LOWER[op.op](self, op, [self._arg(n, env) for n in op.inputs], **op.a)
        if self.stateful:
            self._write_states(env, args[names.index(self.graph.inputs_with(Role.POSITION)[0])])
        out = []
        for n, layout in self.output_layouts().items():
            v = env[n]
            if isinstance(v.t, tuple):
                out.extend(v.t)
            else:
                out.append(self.as_act((n, v)) if layout == "ane" else self.logical(v, n))
        return tuple(out)

    def _arg(self, name: str, env: dict[str, Val]):
        if name.startswith(WEIGHT_PREFIX):
            return name[len(WEIGHT_PREFIX):]  # resolved by the op, which knows the form it needs
        return (name, env[name])

    def _write_states(self, env: dict[str, Val], position: torch.Tensor) -> None:
        """Store this chunk's keys and values at ``position`` (the KV cache write)."""
        slot, p = self.kv.slot(self.graph.layer), position[0]
        if torch.compiler.is_exporting():  # torch.export wants a bounded int; jit.trace keeps the tensor
            p = p.item()
            torch._check(p >= 0)
            torch._check(p + self.graph.meta["seq"] <= min(shape[2] for shape in self.kv.shapes.values()))
        for new, t in self.graph.outputs.items():
            if t.role != Role.KV_NEW:
                continue
            state = t.updates
            heads, seq, dim = self.shapes[new]
            getattr(self, state)[slot:slot + 1, :heads, p:p + seq, :dim] = self.logical(env[new], new)[None]

    # -- helpers the lowerings share ---------------------------------------------------------------
    def weight(self, name: str) -> torch.Tensor:
        return getattr(self, self._weight_attr[name])

    def conv(self, x: torch.Tensor, name: str, bias: torch.Tensor | None,
             split: bool = False) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """``x`` [1, C, 1, S] through the linear ``name`` as 1×1 convs of ≤ CONV_ROWS outputs each;
        ``split``: as outputs of at most MAX_CHANNELS channels each instead of one tensor."""
        kernels = [getattr(self, attr) for attr in self._conv_attrs[name]]
        biases = bias.split(CONV_ROWS) if bias is not None else [None] * len(kernels)
        parts = [F.conv2d(x, w, b) for w, b in zip(kernels, biases)]
        per_output = MAX_CHANNELS // CONV_ROWS if split else len(parts)
        groups = [parts[i:i + per_output] for i in range(0, len(parts), per_output)]
        joined = tuple(g[0] if len(g) == 1 else torch.cat(g, dim=1) for g in groups)
        return joined if split else joined[0]

    def logical(self, v: Val, name: str) -> torch.Tensor:
        return from_ane(v.t, self.shapes[name]) if v.act else v.t

    def as_act(self, arg) -> torch.Tensor:
        """An [S, C] operand (value or 1-D/2-D weight) in ANE layout."""
        if isinstance(arg, str):  # a weight broadcast along channels
            return self.weight(arg).reshape(1, -1, 1, 1)
        name, v = arg
        return v.t if v.act else to_ane(v.t, self.shapes[name])

    def as_ir(self, arg) -> torch.Tensor:
        if isinstance(arg, str):
            return self.weight(arg)
        name, v = arg
        return self.logical(v, name)


# -- lowerings: (module, op, args, **attrs) → Val ---------------------------------------------------
def _acts_ok(m: AneGraphModule, args) -> bool:
    """Can this elementwise op run in ANE layout? Yes when some operand is an activation and
    every other one an [S, C]-broadcastable 2-D value or a per-channel weight."""
    values = [a for a in args if not isinstance(a, str)]
    return any(v.act for _, v in values) and all(len(m.shapes[n]) == 2 for n, _ in values)


def _elementwise(fn):
    def lower(m: AneGraphModule, op: Op, args, **attrs) -> Val:
        if _acts_ok(m, args):
            return Val(fn(*[m.as_act(a) for a in args], **attrs), True)
        return Val(fn(*[m.as_ir(a) for a in args], **attrs), False)

    return lower


def _linear(m: AneGraphModule, op: Op, args, **_) -> Val:
    x, w = args[0], args[1]
    bias = m.weight(args[2]) if len(args) > 2 else None
    name, v = x
    shape = m.shapes[name]
    if len(shape) == 2:
        split = len(m.output_parts().get(op.outputs[0], ())) > 1  # a wide graph output, read by no other op
        return Val(m.conv(m.as_act(x), w, bias, split), True)
    rows = 1
    for d in shape[:-1]:
        rows *= d
    flat = (rows, shape[-1])
    y = m.conv(to_ane(m.as_ir(x).reshape(flat), flat), w, bias)
    return Val(from_ane(y, (rows, m.shapes[op.outputs[0]][-1])).reshape(m.shapes[op.outputs[0]]), False)


def _norm_axis(m: AneGraphModule, x) -> tuple[torch.Tensor, int, bool]:
    act = not isinstance(x, str) and x[1].act
    return (m.as_act(x), 1, True) if act else (m.as_ir(x), -1, False)


def _rmsnorm(m: AneGraphModule, op: Op, args, *, eps) -> Val:
    x, axis, act = _norm_axis(m, args[0])
    w = m.as_act(args[1]) if act else m.weight(args[1])
    return Val(x * torch.rsqrt(x.pow(2).mean(axis, keepdim=True) + eps) * w, act)


def _layernorm(m: AneGraphModule, op: Op, args, *, eps) -> Val:
    x, axis, act = _norm_axis(m, args[0])
    centred = x - x.mean(axis, keepdim=True)
    y = centred * torch.rsqrt(centred.pow(2).mean(axis, keepdim=True) + eps)
    y = y * (m.as_act(args[1]) if act else m.weight(args[1]))
    if len(args) > 2:
        y = y + (m.as_act(args[2]) if act else m.weight(args[2]))
    return Val(y, act)


def _rope(m: AneGraphModule, op: Op, args, *, rotary_dim, interleaved) -> Val:
    x, cos, sin = (m.as_ir(a) for a in args)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads
    dim = m.shapes[args[0][0]][-1]
    rot = x[..., :rotary_dim]
    half = rotary_dim // 2
    if interleaved:
        c, s = cos[..., :half], sin[..., :half]
        even, odd = rot[..., 0::2], rot[..., 1::2]
        shape = m.shapes[args[0][0]][:-1] + (rotary_dim,)
        rot = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).reshape(shape)
    else:
        rot = rot * cos + torch.cat((-rot[..., half:], rot[..., :half]), dim=-1) * sin
    return Val(rot if rotary_dim == dim else torch.cat((rot, x[..., rotary_dim:]), dim=-1), False)


def _sdpa(m: AneGraphModule, op: Op, args, *, scale) -> Val:
    q, k, v, mask = (m.as_ir(a) for a in args[:4])
    (hq, seq, dim), (hkv, length, _), dv = m.shapes[args[0][0]], m.shapes[args[1][0]], m.shapes[args[2][0]][-1]
    if hq != hkv:  # GQA: repeat each KV head for its query heads (expand + reshape; no gather)
        k = k.unsqueeze(1).expand(hkv, hq // hkv, length, dim).reshape(hq, length, dim)
        v = v.unsqueeze(1).expand(hkv, hq // hkv, length, dv).reshape(hq, length, dv)
    if len(args) == 4:
        if abs(scale * dim**0.5 - 1.0) > 1e-6:  # Core ML's SDPA scales by 1/√D; fold the rest into q
            q = q * (scale * dim**0.5)
        return Val(F.scaled_dot_product_attention(q, k, v, attn_mask=mask), False)
    sinks = m.as_ir(args[4]).reshape(hq, 1, 1).expand(hq, seq, 1)  # one more logit per head
    logits = torch.matmul(q, k.transpose(1, 2)) * scale + mask
    probs = torch.softmax(torch.cat((logits, sinks), dim=-1), dim=-1)[..., :length]
    return Val(torch.matmul(probs, v), False)


def _slice(m: AneGraphModule, op: Op, args, *, axis, start, stop, step) -> Val:
    name, v = args[0]
    if v.act and step == 1:
        return Val(v.t.narrow(3 if axis == 0 else 1, start, stop - start), True)
    x = m.as_ir(args[0])
    return Val(x[(slice(None),) * axis + (slice(start, stop, step),)], False)


def _concat(m: AneGraphModule, op: Op, args, *, axis) -> Val:
    if all(v.act for _, v in args):
        return Val(torch.cat([v.t for _, v in args], dim=3 if axis == 0 else 1), True)
    return Val(torch.cat([m.as_ir(a) for a in args], dim=axis), False)


LOWER = {
    "linear": _linear,
    "rmsnorm": _rmsnorm,
    "layernorm": _layernorm,
    "rope": _rope,
    "sdpa": _sdpa,
    "silu": _elementwise(F.silu),
    "gelu": _elementwise(lambda x, *, approximate: F.gelu(x, approximate=approximate)),
    "relu": _elementwise(F.relu),
    "sigmoid": _elementwise(torch.sigmoid),
    "add": _elementwise(torch.add),
    "mul": _elementwise(torch.mul),
    "affine": _elementwise(lambda x, *, scale, shift: x * scale + shift),
    "clamp": _elementwise(lambda x, *, min, max: torch.clamp(x, min=min, max=max)),
    "reshape": lambda m, op, args, *, shape: Val(m.as_ir(args[0]).reshape(shape), False),
    "transpose": lambda m, op, args, *, perm: Val(m.as_ir(args[0]).permute(perm), False),
    "slice": _slice,
    "concat": _concat,
}
