"""The reference executor: runs any IR graph in fp32 torch, op by op.

Its op implementations *are* the IR's semantics; every other backend is tested against
it. It is also the path cold experts and spilled tokens take at run time.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

from npumoe.core.ir.backend import check_feed
from npumoe.core.ir.graph import WEIGHT_PREFIX, Graph, Op, Role
from npumoe.luts.decode import swiglu_expert, swiglu_experts
from npumoe.luts.torch_op import (
    LutLinear,
    bf16_linear,
    bf16_linear_many,
    held_threads,
    lut_linear_many,
    lut_linear_rows_many,
    on_held_threads,
    rms_norm_rows,
    rope_rows,
)


def _rmsnorm(x, w, *, eps):
    if (y := rms_norm_rows(x, w, eps)) is not None:  # one pass of C over the rows
        return y
    if w.dtype == x.dtype:  # torch's own: the same ops in one call
        return torch.rms_norm(x, (x.shape[-1],), w, eps)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _layernorm(x, w, b=None, *, eps):
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


def _rotate(x, cos, sin, interleaved):
    if interleaved:
        half = cos.shape[-1] // 2
        c, s = cos[..., :half], sin[..., :half]
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.addcmul(x * cos, torch.cat((-x2, x1), dim=-1), sin)


def _rope(x, cos, sin, *, rotary_dim, interleaved):
    if rotary_dim == x.shape[-1]:  # (most models: no pass-through part to split off and join again)
        y = rope_rows(x, cos, sin, interleaved)  # one pass of C
        return y if y is not None else _rotate(x, cos.unsqueeze(1), sin.unsqueeze(1), interleaved)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((_rotate(rot, cos, sin, interleaved), rest), dim=-1)


QUERIES_A_THREAD = 8  # query positions, at least, a thread's share of a split prompt attention


def _queries_on_held_threads(mask_at: int) -> Callable[[Callable], Callable]:
    """A prompt's attention split by query positions across the threads torch_on_one_thread holds, a part a thread
    (torch_op.on_held_threads): the positions are independent, so the result is the same, and no OpenMP worker is
    left spinning on the next kernel's core, as after torch's own threaded ops (docs/performance.md, prefill).
    ``mask_at``: the mask's place among the arguments after the queries."""
    def split(attention: Callable) -> Callable:
        @functools.wraps(attention)
        def run(q, *args, **attrs):
            seq, mask = q.shape[-2], args[mask_at]
            parts = min(held_threads(), seq // QUERIES_A_THREAD)
            if parts < 2 or mask.shape[0] != seq:
                return attention(q, *args, **attrs)
            bounds = [seq * i // parts for i in range(parts + 1)]

            def part(a: int, b: int) -> torch.Tensor:
                return attention(q[..., a:b, :], *args[:mask_at], mask[a:b], *args[mask_at + 1:], **attrs)
            return torch.cat(on_held_threads([functools.partial(part, a, b) for a, b in zip(bounds, bounds[1:])]),
                             dim=-2)
        return run
    return split


@_queries_on_held_threads(mask_at=2)
def _sdpa(q, k, v, mask, sinks=None, *, scale):
    groups = q.shape[0] // k.shape[0]
    if groups > 1:  # (a copy of the whole cache: skipped when every query head has its own)
        k, v = k.repeat_interleave(groups, dim=0), v.repeat_interleave(groups, dim=0)
    logits = torch.matmul(q, k.transpose(1, 2)) * scale + mask
    if sinks is None:
        probs = torch.softmax(logits, dim=-1)
    else:
        sink = sinks.reshape(-1, 1, 1).expand(-1, logits.shape[1], 1)
        joint = torch.cat((logits, sink), dim=-1)
        probs = torch.softmax(joint - joint.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
    return torch.matmul(probs, v)


@_queries_on_held_threads(mask_at=4)
def _sdpa_over_parts(q, k_old, k_new, v_old, v_new, mask, sinks=None, *, scale):
    """``sdpa(q, concat(k_old, k_new), concat(v_old, v_new), mask, sinks)`` without building either
    concatenation (at decode each would copy the layer's whole KV cache) and with grouped-query heads
    matched by reshaping the queries instead of repeating K and V (another copy of the cache). Scale and
    mask ride in the products (baddbmm): a decode step is a handful of kernel calls, not a score of them."""
    kv_heads, (heads, seq, dim), old = k_old.shape[0], q.shape, k_old.shape[1]
    groups = heads // kv_heads
    grouped = q.reshape(kv_heads, groups * seq, dim)  # row g·seq + s: query head kv·groups + g at position s
    rows = mask if groups == 1 or seq == 1 else mask.repeat(groups, 1)  # each query head's rows see its mask
    logits = torch.cat((torch.baddbmm(rows[:, :old], grouped, k_old.transpose(1, 2), alpha=scale),
                        torch.baddbmm(rows[:, old:], grouped, k_new.transpose(1, 2), alpha=scale)), dim=-1)
    if sinks is None:
        probs = torch.softmax(logits, dim=-1)
    else:
        sink = sinks.reshape(kv_heads, groups, 1, 1).expand(-1, -1, seq, 1).reshape(kv_heads, groups * seq, 1)
        joint = torch.cat((logits, sink), dim=-1)
        probs = torch.softmax(joint - joint.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
    out = torch.baddbmm(torch.bmm(probs[..., old:], v_new), probs[..., :old], v_old)
    return out.reshape(heads, seq, v_old.shape[-1])


def fuse_cached_attention(steps: list[tuple]) -> list[tuple]:
    """The bound steps with each ``sdpa`` whose K and V are two-part ``concat`` s used by nothing else
    (the cache and this call's keys, as attention graphs build them) run as :func:`_sdpa_over_parts`.
    An optimisation of the interpreter, not a new op: the result is the ops' own up to summation order."""
    producer = {out: i for i, (_, _, _, outs) in enumerate(steps) for out in outs}
    readers: dict[str, int] = {}
    for _, args, _, _ in steps:
        for a in args:
            if isinstance(a, str):
                readers[a] = readers.get(a, 0) + 1
    fused, dropped = list(steps), set()
    for i, (impl, args, attrs, outs) in enumerate(steps):
        if impl is not _sdpa:
            continue
        parts = [steps[producer[a]] if a in producer else None for a in args[1:3]]
        if all(p and p[0] is OP_IMPLS["concat"] and len(p[1]) == 2 and p[2]["axis"] == 1 and readers[a] == 1
               for p, a in zip(parts, args[1:3])):
            (k_old, k_new), (v_old, v_new) = parts[0][1], parts[1][1]
            fused[i] = (_sdpa_over_parts, [args[0], k_old, k_new, v_old, v_new, *args[3:]], attrs, outs)
            dropped.update(producer[a] for a in args[1:3])
    return [step for j, step in enumerate(fused) if j not in dropped]


WIDEN_BLOCK = 1 << 22  # weights widened to fp32 at a time: 16 MB


def _linear(x, w, b=None):
    """A bf16/fp16 matrix (a large model's compute dtype) is widened exactly to fp32 for the product:
    activations, products and sums stay fp32, so only the weights' rounding differs from fp32. The exception
    is a bf16 matrix given ``BF16_DOT_FROM`` rows or more (a prompt) on a CPU with AVX-512 BF16: the
    activations are rounded to bf16 for its dot products (:func:`npumoe.luts.torch_op.bf16_linear`)."""
    if w.dtype == x.dtype:
        return F.linear(x, w, b)
    if w.dtype == torch.bfloat16 and (y := bf16_linear(x, w)) is not None:  # decode: w read at 2 bytes a weight
        return y if b is None else y + b
    rows = max(1, WIDEN_BLOCK // w.shape[1])  # widened a block of rows at a time: a 50k-row LM head is not
    y = torch.cat([F.linear(x, w[r:r + rows].to(x.dtype)) for r in range(0, w.shape[0], rows)], dim=-1)  # copied whole
    return y if b is None else y + b


def _lut_linear(x, w, b=None):
    """``w`` is a packed matrix (:class:`npumoe.luts.torch_op.LutLinear`): ``npumoe::lut_linear``."""
    y = w(x)
    return y if b is None else y + b


BATCHED = {_linear: bf16_linear_many, _lut_linear: lut_linear_many}  # step kind → its batched kernel call


def _slice(x, *, axis, start, stop, step):
    return x.narrow(axis, start, stop - start) if step == 1 else x[(slice(None),) * axis + (slice(start, stop, step),)]


OP_IMPLS: dict[str, Callable] = {
    "linear": _linear,
    "lut_linear": _lut_linear,
    "rmsnorm": _rmsnorm,
    "layernorm": _layernorm,
    "rope": _rope,
    "sdpa": _sdpa,
    "silu": F.silu,
    "gelu": lambda x, *, approximate: F.gelu(x, approximate=approximate),
    "relu": F.relu,
    "sigmoid": torch.sigmoid,
    "add": torch.add,
    "mul": torch.mul,
    "affine": lambda x, *, scale, shift: x * scale + shift,
    "clamp": lambda x, *, min, max: torch.clamp(x, min=min, max=max),
    "reshape": lambda x, *, shape: x.reshape(shape),
    "transpose": lambda x, *, perm: x.permute(perm),
    "slice": _slice,
    "concat": lambda *xs, axis: torch.cat(xs, dim=axis),
}


def register_op(name: str, impl: Callable) -> None:
    """Add an op implementation."""
    OP_IMPLS[name] = impl


def evaluate(graph: Graph, inputs: Mapping[str, torch.Tensor], weight: Callable[[str], torch.Tensor],
             impls: Mapping[str, Callable] = OP_IMPLS) -> dict[str, torch.Tensor]:
    """``graph``'s outputs from its ops, each weight asked of ``weight(name)`` as the op runs: for code that traces
    graphs into a program of its own (torch.export), where weights must be read through its module. The cached
    attention runs by parts as :class:`TorchGraphExecutor` runs it (:func:`fuse_cached_attention`); nothing is
    batched."""
    steps = [(impls[op.op], [weight(v[len(WEIGHT_PREFIX):]) if v.startswith(WEIGHT_PREFIX) else v for v in op.inputs],
              op.a, op.outputs) for op in graph.ops]
    env = dict(inputs)
    for step in fuse_cached_attention(steps):
        _run_step(step, env)
    return {name: env[name] for name in graph.outputs}


def value_shapes(graph: Graph, weights: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """Every value's static shape, by running the reference ops on meta tensors (the ops' semantics are
    their shapes' too). Weights are asked through ``weight_shape``, so packed experts stay packed."""
    from npumoe.core.ir.weights import weight_shape

    env = {n: torch.empty(t.shape, device="meta") for n, t in graph.inputs.items()}
    for op in graph.ops:
        args = [torch.empty(weight_shape(weights, v[len(WEIGHT_PREFIX):]), device="meta") if v.startswith(WEIGHT_PREFIX)
                else env[v] for v in op.inputs]
        out = OP_IMPLS[op.op](*args, **op.a)
        env.update(zip(op.outputs, out if isinstance(out, tuple) else (out,)))
    return {n: tuple(int(d) for d in t.shape) for n, t in env.items()}


class TorchGraphExecutor:
    """Binds a graph's weights once; each call runs its ops in order."""

    keeps_state = False  # the cache comes in as inputs, any length (the engine passes only filled slots)

    def __init__(self, graph: Graph, weights: Mapping[str, torch.Tensor]):
        self.graph = graph
        self._steps = fuse_cached_attention([self._bind(op, weights) for op in graph.ops])
        self._runs = _independent_runs(self._steps)
        self._shape = [(impl, attrs, len(args)) for impl, args, attrs, _ in self._steps]  # what run_many lines up
        self._batches = any(len(run) > 1 for run in self._runs)  # q, k, v (or gate, up) as one kernel call
        self._batchable = any(map(_batchable, self._steps))  # side by side with its twins, one kernel call
        self._needed = frozenset(n for n, t in graph.inputs.items() if t.role != Role.POSITION)

    @staticmethod
    def _bind(op: Op, weights):
        # a linear whose matrix the weights also hold packed (npumoe.models.checkpoints.lut) runs as lut_linear
        packed = getattr(weights, "packed", {})
        refs = [n[len(WEIGHT_PREFIX):] if n.startswith(WEIGHT_PREFIX) else None for n in op.inputs]
        kind = "lut_linear" if op.op == "linear" and refs[1] in packed else op.op
        if kind not in OP_IMPLS:
            raise NotImplementedError(f"the CPU executor has no implementation of IR op {op.op!r}")
        # (the packed matrix itself, not weights[ref], which would dequantise it for nothing)
        args = [n if ref is None else packed[ref] if kind == "lut_linear" and i == 1 else weights[ref]
                for i, (n, ref) in enumerate(zip(op.inputs, refs))]
        return OP_IMPLS[kind], args, op.a, op.outputs

    def __call__(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not inputs.keys() >= self._needed:  # any length: only presence checked
            check_feed(self.graph, inputs, keeps_state=False, static=False)  # (which names what is missing)
        if self._batches:
            return self.run_many([self], [inputs])[0]
        env = dict(inputs)  # a decode step's graphs are many small ops: the loop itself is the hot path
        for step in self._steps:
            _run_step(step, env)
        return {name: env[name] for name in self.graph.outputs}

    @staticmethod
    def run_many(executors: list[TorchGraphExecutor], inputs: list[Mapping[str, torch.Tensor]]) -> list[dict]:
        """Each executor on its inputs, as calling each computes them, with independent bf16 or packed linears
        batched into one kernel call: consecutive ones of a graph that read no output of each other (q, k, v;
        gate, up) and, for graphs of one shape run side by side (a decode step's experts), the same step of
        every graph. The kernel then streams all their matrices as one run instead of restarting per matrix."""
        if not (executors and executors[0]._batchable and _same_steps(executors)):  # nothing to batch: one by one
            return [e(i) for e, i in zip(executors, inputs)]
        envs = [dict(i) for i in inputs]
        for run in executors[0]._runs:
            steps = [(e._steps[i], env) for e, env in zip(executors, envs) for i in run]
            if not (len(steps) > 1 and _batchable(steps[0][0]) and _run_linears(steps)):
                for step, env in steps:
                    _run_step(step, env)
        return [{name: env[name] for name in e.graph.outputs} for e, env in zip(executors, envs)]

    @functools.cached_property
    def fused_expert(self):
        """This graph's record for the fused expert kernel calls when it is one plain SwiGLU expert (fp32, bf16 or
        packed matrices), else None (asked at first use: it needs the kernels, whose absence the first run, not the
        construction, reports)."""
        return None if self.swiglu_matrices is None else swiglu_expert(*self.swiglu_matrices)

    @functools.cached_property
    def swiglu_matrices(self) -> tuple | None:
        """(gate, up, down) when this graph is one plain SwiGLU expert, else None."""
        return _swiglu_matrices(self.graph, self._steps)

    @staticmethod
    def prompt_many(executors: list[TorchGraphExecutor], x: torch.Tensor, counts: list[int]) -> torch.Tensor | None:
        """Expert i's ``counts[i]`` consecutive rows of x through expert i, for a prompt's experts of SwiGLU matrices of
        one kind (bf16, or packed) and shape (:func:`_swiglu_prompt`): their outputs' rows in x's order; None where
        that does not apply (the caller then runs each graph)."""
        matrices = [e.swiglu_matrices for e in executors]
        kinds = {None if m is None else tuple(_batched_kind(w) for w in m) for m in matrices}
        into = {("bf16",) * 3: _linears_into, ("packed",) * 3: _packed_linears_into}.get(kinds.pop()) \
            if len(kinds) == 1 else None  # (no executors: no kind)
        if into is None or len({tuple(_out_in(w) for w in m) for m in matrices}) != 1:
            return None
        return _swiglu_prompt(matrices, x, counts, into)

    @staticmethod
    def combine_many(executors: list[TorchGraphExecutor], x: torch.Tensor, weights: torch.Tensor):
        """Σ_i weights[i] · executor_i({"x": x})["y"] for one token through every expert in one kernel call (a
        decode token's routed experts); None where that does not apply (an expert that is not a plain SwiGLU,
        another row count or dtype): the caller then runs them one way or another."""
        records = [e.fused_expert for e in executors]
        if not records or any(r is None for r in records):
            return None
        return swiglu_experts(records, weights, x)


def _swiglu_matrices(graph: Graph, steps: list) -> tuple | None:
    """(gate, up, down) of a one-expert graph computing y = down(silu(gate x) ⊙ up x) with no biases, as its linear
    steps hold them (tensors or packed matrices), or None for any other graph."""
    if graph.kind != "experts" or len(steps) != 5 or list(graph.outputs) != ["y"]:
        return None
    (gate, g_args, _, (g,)), (up, u_args, _, (u,)), (act, a_args, a_attrs, (a,)), (mul, m_args, _, (h,)), \
        (down, d_args, _, (y,)) = steps
    linears = {_linear, _lut_linear}
    if not (gate in linears and up in linears and down in linears and act is F.silu and not a_attrs
            and mul is torch.mul and len(g_args) == len(u_args) == len(d_args) == 2 and g_args[0] == u_args[0] == "x"
            and a_args == [g] and m_args == [a, u] and d_args[0] == h and y == "y"):
        return None
    return g_args[1], u_args[1], d_args[1]


def _batched_kind(w) -> str | None:
    """A SwiGLU matrix the batched prompt calls take: "bf16" (a tensor), "packed" (:class:`LutLinear`), else None."""
    if isinstance(w, LutLinear):
        return "packed" if w.bias is None else None
    return "bf16" if isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16 else None


def _out_in(w) -> tuple[int, int]:
    return (w.out_features, w.in_features) if isinstance(w, LutLinear) else tuple(w.shape)


def _swiglu_prompt(matrices: list[tuple], x: torch.Tensor, counts: list[int], linears_into) -> torch.Tensor:
    """Each expert's rows of x (consecutive, ``counts`` of them each) through its SwiGLU matrices, into one
    [rows, out] tensor: every expert's gate and up products written into two buffers by one batched kernel call
    (``linears_into``), silu and the product over those whole buffers, then the down products by another, where
    stepping each expert's graph took four torch calls and two kernel calls per expert, each split over the threads on
    its own. The same kernels (or, for a product they do not take, the same single call) and elementwise ops on the
    same rows, so the same values."""
    gates, ups, downs = zip(*matrices)
    rows = x.shape[0]
    g, u, h = (torch.empty(rows, _out_in(gates[0])[0]) for _ in range(3))
    y = torch.empty(rows, _out_in(downs[0])[0])
    xs, hs = torch.split(x, counts), torch.split(h, counts)
    # each expert's gate and up side by side: its rows of x are still in cache for the second
    gs, us = torch.split(g, counts), torch.split(u, counts)
    pairs = [(part, w, out) for part, gw, uw, go, uo in zip(xs, gates, ups, gs, us) for w, out in ((gw, go), (uw, uo))]
    linears_into(*(list(column) for column in zip(*pairs)))
    torch.mul(F.silu(g), u, out=h)
    linears_into(list(hs), list(downs), list(torch.split(y, counts)))
    return y


def _linears_into(xs: list[torch.Tensor], ws: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
    """outs[i] = xs[i] · ws[i]ᵀ: one batched bf16 kernel call, :func:`_linear` for what it does not take."""
    done = bf16_linear_many(xs, ws, outs) or [None] * len(xs)
    for x, w, out, y in zip(xs, ws, outs, done):
        if y is None:
            out.copy_(_linear(x, w))


def _packed_linears_into(xs: list[torch.Tensor], ws: list[LutLinear], outs: list[torch.Tensor]) -> None:
    """outs[i] = xs[i] · ws[i]ᵀ for packed matrices: one batched int8 GEMM call, each op's own call for what it does
    not take (few rows, other widths)."""
    done = lut_linear_rows_many(xs, ws, outs) or [None] * len(xs)
    for x, w, out, y in zip(xs, ws, outs, done):
        if y is None and x.shape[0]:
            out.copy_(w(x))


def _batchable(step) -> bool:
    """Can a batched kernel call take this step: a packed linear, or a linear of a bf16 matrix (fp32 ones are
    torch's own GEMVs, one call each)?"""
    impl, args = step[0], step[1]
    return impl in BATCHED and (impl is not _linear or getattr(args[1], "dtype", None) == torch.bfloat16)


def _independent_runs(steps: list) -> list[list[int]]:
    """Step indices in runs: consecutive batchable linears of one kind (bf16 or packed) none of which reads
    another's output share a run, every other step is a run of its own."""
    runs: list[list[int]] = []
    for i, (impl, args, _, _) in enumerate(steps):
        last = runs[-1] if runs else None
        if _batchable(steps[i]) and last and _batchable(steps[last[0]]) and steps[last[0]][0] is impl \
                and args[0] not in {out for j in last for out in steps[j][3]}:
            last.append(i)
        else:
            runs.append([i])
    return runs


def _same_steps(executors: list[TorchGraphExecutor]) -> bool:
    """Do the executors run the same ops with the same attributes, so that their steps line up?"""
    return len(executors) == 1 or bool(executors) and all(e._shape == executors[0]._shape for e in executors[1:])


def _run_step(step, env: dict) -> None:
    impl, args, attrs, outputs = step
    result = impl(*[env[a] if a.__class__ is str else a for a in args], **attrs)
    if len(outputs) == 1:
        env[outputs[0]] = result
    else:
        env.update(zip(outputs, result))


def _run_linears(steps: list[tuple]) -> bool:
    """Linear steps of one kind, each with its environment, as one batched bf16 or LUT GEMV (a step the kernel
    does not take, alone); False (nothing run) where the batched call does not apply at all."""
    many = BATCHED[steps[0][0][0]]
    ys = many([env[args[0]] for (_, args, _, _), env in steps], [args[1] for (_, args, _, _), _ in steps])
    if ys is None:
        return False
    for (step, env), y in zip(steps, ys):
        if y is None:
            _run_step(step, env)
        else:
            args, outputs = step[1], step[3]
            env[outputs[0]] = y if len(args) < 3 else y + args[2]
    return True
