"""A whole decode step as one lazily built MLX graph, evaluated once a token, as mlx-lm's decode loop runs
(:mod:`npumoe.core.runtime.device_step` says when the engine hands it a token).

The engine's layer-by-layer step evaluates each graph on its own: its outputs come back to torch for routing,
dispatch, combine and residuals, and each attention graph takes the whole KV cache in from the host. Here nothing
leaves MLX until the logits: the keys and values stay on the device between tokens (each token's written at its
slot in place, the buffers grown ``GROWTH`` slots at a time, as mlx-lm's ``KVCache`` keeps them) and attention
reads only the filled slots; routing is MLX's top-k; a token's experts run as mlx-lm's SwitchGLU runs them, one
gathered product a projection over the layer's experts stacked (:func:`~npumoe.backends.mlx.switch.
switch_function`), with no capacity padding. The attention, dense, shared-expert and LM-head graphs are the
functions their executors run, on the same weights and in the same dtype; the attention's cache concat becomes the
in-place write. It applies where every routed expert of a layer is on mlx and can be gathered (the conditions of
:func:`~npumoe.backends.mlx.switch.execution`) and the router is softmax, softmax over the top-k, or sigmoid
without expert groups; elsewhere the engine keeps its layer-by-layer path.
"""

from __future__ import annotations

import dataclasses
import functools

import mlx.core as mx
import numpy as np
import torch

from npumoe.backends.mlx.ops import OP_IMPLS, graph_function
from npumoe.backends.mlx.streams import stream
from npumoe.backends.mlx.switch import LINEARS, expert_segments, gatherable, switch_function
from npumoe.backends.mlx.weights import QuantizedMatrix, dense
from npumoe.core.compiler.graphs import experts_graph
from npumoe.core.ir.graph import WEIGHT_PREFIX, Graph, Op
from npumoe.core.ir.spec import ModelSpec, MoESpec
from npumoe.core.runtime.device_step import StepRequest

GROWTH = 256  # cache slots added at a time (mlx-lm's KVCache step)
ATTENTION_INPUTS = ("x", "cos", "sin", "mask", "k_cache", "v_cache")


class Slots:
    """One layer's keys (or values) on the device, [heads, slots, dim] in the graph's dtype, the first ``length``
    filled."""

    def __init__(self, capacity: int, dtype: mx.Dtype):
        self.capacity, self.dtype, self.length = capacity, dtype, 0
        self.buffer: mx.array | None = None

    def load(self, host: torch.Tensor, length: int) -> None:
        held = min(self.capacity, max(GROWTH, -(-length // GROWTH) * GROWTH))
        self.buffer = mx.zeros((host.shape[0], held, host.shape[2]), self.dtype)
        if length:
            self.buffer[:, :length] = mx.array(host[:, :length].numpy()).astype(self.dtype)
        self.length = length

    def append(self, new: mx.array) -> mx.array:
        """``new`` [heads, n, dim] written after the filled slots; every filled slot (a view)."""
        end = self.length + new.shape[1]
        if end > self.buffer.shape[1]:
            more = min(GROWTH, self.capacity - self.buffer.shape[1])
            self.buffer = mx.concatenate([self.buffer, mx.zeros((new.shape[0], more, new.shape[2]), self.dtype)], 1)
        self.buffer[:, self.length:end] = new
        self.length = end
        return self.buffer[:, :end]

    def write_back(self, host: torch.Tensor, length: int) -> None:
        host[:, :length] = torch.from_numpy(np.array(self.buffer[:, :length].astype(mx.float32)))


def decode_step(request: StepRequest) -> MlxDecodeStep | None:
    """The request's decode step as one MLX graph, or None where it does not apply (see the module's docstring)."""
    executors = request.executors
    if len({e.device for e in executors.values()}) != 1:
        return None
    program, spec, layers = request.program, request.program.spec, []
    device = next(iter(executors.values())).device
    with mx.stream(stream(device)):
        for i, step in enumerate(program.layers):
            attention = _Attention(executors[step.attention[1]], program.max_context,
                                   spec.layers[i].attention.sliding_window)
            if step.moe is None:
                dense_ffn = _graph(executors[step.dense[1]])
                ffn = lambda z, run=dense_ffn: (run(z), None)  # noqa: E731
            else:
                groups = [executors[s.graph] for g in step.moe.groups[1] for s in g.shapes]
                shared = _graph(executors[step.moe.shared[1]]) if step.moe.shared else None
                ffn = _moe(spec, i, groups, request.routers[i], shared, request.others.values())
                if ffn is None:
                    return None
            layers.append((attention, ffn))
        mx.clear_cache()  # (the prompt's group stacks, now the step's)
        return MlxDecodeStep(layers, _graph(executors[program.lm_head[1]]), request.rope, device)


class MlxDecodeStep:
    """:class:`~npumoe.core.runtime.device_step.DeviceStep` on MLX: ``layers`` (attention, feed-forward) and the
    LM head as MLX functions, run on ``device``."""

    def __init__(self, layers: list, head, rope: list[tuple[torch.Tensor, torch.Tensor]], device: str):
        self.layers, self.head, self.device = layers, head, device
        tables = {}  # a table shared by layers alike in rope, once
        self.rope = [tables.setdefault(id(cos), (mx.array(cos.numpy()), mx.array(sin.numpy()))) for cos, sin in rope]

    def __call__(self, x: torch.Tensor, start: int) -> tuple[torch.Tensor, list[list[int]]]:
        with mx.stream(stream(self.device)):
            h, picked = mx.array(x.numpy()), []
            for (attention, ffn), (cos, sin) in zip(self.layers, self.rope):
                h, z = attention(h, cos[start:start + 1], sin[start:start + 1], start)
                y, experts = ffn(z)
                if experts is not None:
                    picked.append(experts)
                h = h + y
            logits = self.head(h)
            mx.eval(logits, picked)
            return torch.from_numpy(np.array(logits)), [e.tolist() for e in picked]

    def load(self, k: list[torch.Tensor], v: list[torch.Tensor], length: int) -> None:
        with mx.stream(stream(self.device)):
            for (attention, _), keys, values in zip(self.layers, k, v):
                attention.k.load(keys, length)
                attention.v.load(values, length)
            mx.eval([(a.k.buffer, a.v.buffer) for a, _ in self.layers])

    def write_back(self, k: list[torch.Tensor], v: list[torch.Tensor], length: int) -> None:
        with mx.stream(stream(self.device)):
            for (attention, _), keys, values in zip(self.layers, k, v):
                attention.k.write_back(keys, length)
                attention.v.write_back(values, length)


def _graph(executor):
    """An executor's one-input graph as fp32 [rows, H] → its (first) output in fp32, computed in its dtype."""
    return lambda x: executor.run(x.astype(executor.dtype))[0].astype(mx.float32)


class _Attention:
    """An attention graph over the cache on the device: h, z of the token at ``start``, its keys and values written
    at that slot."""

    def __init__(self, executor, capacity: int, window: int | None):
        graph: Graph = executor.graph
        ops = [Op("kv_write", op.inputs, op.outputs, op.attrs)
               if op.op == "concat" and op.inputs[0] in ("k_cache", "v_cache") else op for op in graph.ops]
        self.run = graph_function(dataclasses.replace(graph, ops=ops), executor.weights, list(ATTENTION_INPUTS),
                                  OP_IMPLS | {"kv_write": lambda slots, new, *, axis: slots.append(new)})  # (axis: slots)
        self.dtype, self.window = executor.dtype, window
        self.k, self.v = Slots(capacity, executor.dtype), Slots(capacity, executor.dtype)

    def __call__(self, x, cos, sin, start: int):
        self.k.length = self.v.length = start  # (the engine's position: a step it reran overwrites its slot)
        dt = self.dtype
        h, z = self.run(x.astype(dt), cos.astype(dt), sin.astype(dt), self._mask(start), self.k, self.v)[:2]
        return h.astype(mx.float32), z.astype(mx.float32)

    def _mask(self, start: int) -> mx.array | None:
        """The token sees every filled slot and its own, or under a sliding window the last ``window``."""
        if self.window is None:
            return None
        return mx.where(mx.arange(start + 1) > start - self.window, 0.0, float("-inf"))[None].astype(self.dtype)


def _rows_of(experts, rows: mx.array, in_order: bool, x: mx.array) -> list[mx.array]:
    """A gathered group's graph function (x → [y]) over a layer's stacked ``experts``, its rows' experts ``rows``."""
    return [experts(x, rows, in_order)]


def _moe(spec: ModelSpec, layer: int, executors: list, router: tuple, shared, others):
    """MoE layer ``layer``'s decode as z → (y, the experts it routed to): MLX routing, the layer's experts (on
    ``executors``) gathered as one function, plus the ``shared`` expert's output; None where that does not
    apply. The layer's gathered groups (the prompt's, among ``others``, and the decode's) then run on the same
    stacks, so that the experts are held stacked once."""
    moe: MoESpec = spec.layers[layer].ffn
    scoring, n_group = moe.router.scoring, moe.router.n_group
    if scoring not in ("softmax", "softmax_topk", "sigmoid") or n_group > 1 or moe.num_experts < 2:
        return None
    graph = experts_graph(spec, layer, tuple(range(moe.num_experts)), (1,) * moe.num_experts, "decode")
    weights = {name: w for e in executors for name, w in e.weights.items()}
    matrices = [op.inputs[1][len(WEIGHT_PREFIX):] for op in graph.ops if op.op in LINEARS]
    kinds = {(w.bits, w.group) if isinstance(w, QuantizedMatrix) else None
             for w in (weights.get(name) for name in matrices) if w is not None}
    dtype = executors[0].dtype
    if not gatherable(graph) or not set(graph.weight_names()) <= weights.keys() or len(kinds) != 1 \
            or (executors[0].device == "cpu" and dtype != mx.float32) or {e.dtype for e in executors} != {dtype}:
        return None
    experts = switch_function(expert_segments(graph), weights)
    for group in (*others, *executors):
        if getattr(group, "gathered", False) and group.graph.layer == layer and group.dtype == dtype \
                and group.device == executors[0].device:
            rows = np.repeat(group.graph.meta["experts"], group.graph.meta["capacities"]).astype(np.uint32)
            group.run = functools.partial(_rows_of, experts, mx.array(rows), bool(np.all(np.diff(rows) >= 0)))
    rule, weight, bias, correction = router
    weight, bias, correction = (None if t is None else dense(t.float()) for t in (weight, bias, correction))
    k = rule.top_k

    def run(z: mx.array):
        logits = z @ weight.T if bias is None else z @ weight.T + bias
        if scoring == "softmax_topk":
            top = mx.argpartition(-logits, k - 1, axis=-1)[:, :k]
            gates = mx.softmax(mx.take_along_axis(logits, top, -1), axis=-1, precise=True)
        else:
            scores = mx.softmax(logits, axis=-1, precise=True) if scoring == "softmax" else mx.sigmoid(logits)
            choice = scores if correction is None else scores + correction
            top = mx.argpartition(-choice, k - 1, axis=-1)[:, :k]
            gates = mx.take_along_axis(scores, top, -1)
        if rule.normalize:
            gates = gates / (gates.sum(-1, keepdims=True) + (1e-20 if scoring == "sigmoid" else 0.0))
        if rule.routed_scaling != 1.0:
            gates = gates * rule.routed_scaling
        rows = top[0].astype(mx.uint32)
        y = experts(mx.broadcast_to(z.astype(dtype), (k, z.shape[-1])), rows).astype(mx.float32)
        y = (y * gates[0][:, None]).sum(axis=0, keepdims=True)
        return (y if shared is None else y + shared(z)), rows

    return run
