"""The whole model as one torch module of static shapes: what ``npumoe export`` traces into one program.

Two methods share one KV cache, held in buffers they write: ``prefill`` (a chunk of the program's size from a start
position, its first ``valid`` tokens real) and ``decode`` (one token). Attention, dense and shared feed-forwards and
the LM head evaluate the compiler's own IR graphs, so the program computes what the reference interpreter does for
every family the IR describes; what the host runtime does between graphs (rope rows, masks, the cache append,
routing, dispatch, combine) is written here in tensor ops whose shapes never depend on the tokens.

A MoE layer keeps the plan's static dispatch (:class:`StaticMoE`); no routed pair is lost, so its results are the
reference's whatever the capacities.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np
import torch
from torch.fx.traceback import annotate

from npumoe.core.compiler.graphs import experts_graph
from npumoe.core.compiler.interpreter import OP_IMPLS, TorchGraphExecutor, evaluate
from npumoe.core.compiler.program import ExpertGroup, Program
from npumoe.core.ir.backend import EXPERT_REGION
from npumoe.core.ir.graph import WEIGHT_PREFIX
from npumoe.core.ir.rope import cos_sin
from npumoe.core.ir.spec import ModelSpec
from npumoe.core.ir.weights import expert
from npumoe.core.runtime.router import route
from npumoe.luts import experts_op, linear_op

MASKED = float("-inf")


def _buffer_name(weight: str) -> str:
    return "w_" + weight.replace(".", "_")


def _fp32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to(torch.float32).contiguous()


def _batched_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """The IR's linear over a leading expert axis: x[E, R, in] · w[E, out, in]ᵀ (+ b[E, out])."""
    y = torch.matmul(x, w.transpose(-1, -2))
    return y if b is None else y + b.unsqueeze(-2)


EXPERT_OPS = {**OP_IMPLS, "linear": _batched_linear}
PACKED_PARTS = ("tiles", "scales", "zeros")


class PackedMatrix(NamedTuple):
    """A packed linear's weight as the program holds it: the kernels' tiles, scales and zeros (empty: symmetric)."""

    tiles: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    bits: int
    group: int


def _packed_linears(graphs, weights) -> dict[str, tuple[int, int]]:
    """(bits, group) of each matrix held packed that these graphs only multiply by (a linear's weight) and that
    ``npumoe::lut_linear_rows`` takes: run through npumoe's LUT kernels in place, never stored as fp32. The embedding
    stays a table (it is indexed, not multiplied)."""
    packed = getattr(weights, "packed", {})
    uses = [(op.op, i, v[len(WEIGHT_PREFIX):]) for g in graphs for op in g.ops for i, v in enumerate(op.inputs)
            if v.startswith(WEIGHT_PREFIX)]
    other = {name for op, i, name in uses if (op, i) != ("linear", 1)} | {"embed.weight"}
    chosen = {}
    for name in {name for _, _, name in uses if name in packed} - other:
        tiled = packed[name].tiled()
        if linear_op.fits(tiled):
            chosen[name] = tiled.bits, tiled.group
    return chosen


def _or_packed(linear: Callable, valid: torch.Tensor | None) -> Callable:
    """The IR's linear, through ``npumoe::lut_linear_rows`` where its weight is a :class:`PackedMatrix` (over the
    first ``valid`` rows of its input, or all)."""

    def run(x, w, b=None):
        if not isinstance(w, PackedMatrix):
            return linear(x, w, b)
        y = linear_op.lut_linear_rows(x, valid, w.tiles, w.scales, w.zeros, w.bits, w.group)
        return y if b is None else y + b

    return run


def _in_place(linear: Callable) -> Callable:
    """The IR's linear, through ``npumoe::f32_linear_rows`` where its weight is an fp32 matrix (read where it lies)."""

    def run(x, w, b=None):
        if not isinstance(w, torch.Tensor) or w.dtype != torch.float32 or x.dim() != 2:
            return linear(x, w, b)
        y = linear_op.f32_linear_rows(x, w)
        return y if b is None else y + b

    return run


def _scatter_rows(into: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``into`` with row rows[i] set to values[i]. A scatter, not an index_put: ExecuTorch's reinplace pass, which
    makes the cache writes (index_put) in place, also rewrote these and corrupted the prefill's results under
    XNNPACK (logits off by up to 3.7 on the demo); the cache writes are the only index_puts left."""
    return into.scatter(0, rows.unsqueeze(1).expand(-1, into.shape[1]), values)


def attention_mask(window: int | None, start: torch.Tensor, valid: torch.Tensor, seq: int,
                   slots: int) -> torch.Tensor:
    """:func:`npumoe.core.runtime.kvcache.attention_mask` with the start position and the real rows as tensors:
    [seq, slots + seq], cache slots below ``start`` and this chunk's keys causally, padding rows only themselves."""
    rows = torch.arange(seq)
    query = start + rows
    cache = torch.arange(slots).unsqueeze(0) < start
    new = (rows.unsqueeze(0) <= rows.unsqueeze(1)) & (rows.unsqueeze(0) < valid)
    if window is not None:
        cache = cache & (torch.arange(slots).unsqueeze(0) > query.unsqueeze(1) - window)
        new = new & (query.unsqueeze(0) > query.unsqueeze(1) - window)
    padding = (rows >= valid).unsqueeze(1)
    visible = torch.cat((cache & ~padding, torch.where(padding, rows.unsqueeze(0) == rows.unsqueeze(1), new)), dim=1)
    return torch.where(visible, 0.0, MASKED)


class StaticMoE(torch.nn.Module):
    """One MoE layer's routing, dispatch, experts and combine in static shapes.

    A chunk's routed (token, expert) pairs are ranked within their expert in token order, as the runtime's dispatch
    ranks them; each static group launches the compiled shape whose capacities fit the chunk's loads best (the
    runtime's choice); pairs within capacity fill an [experts × width] buffer that one batched product per matrix
    runs. The others spill to a pair-by-pair path, each pair through its own expert's matrices, with slots for the
    most pairs that can spill (every pair for CPU-resident experts and unplanned layers). A decode token's pairs
    always take that path: it reads only its experts' matrices. Where the experts are plain SwiGLUs of packed
    matrices, or of fp32 ones and ``in_place`` (a CPU program), that path is one op over the stacks that reads each
    pair's matrices in place (the engine's fused decode call); else each pair's matrices are gathered for it."""

    def __init__(self, spec: ModelSpec, layer: int, weights, groups: list[ExpertGroup], chunk: int,
                 dtype: torch.dtype = torch.float32, in_place: bool = False):
        super().__init__()
        moe = spec.layers[layer].ffn
        self.dtype = dtype  # the expert products': their matrices stored so, their rows cast to it before them
        self.router, self.top_k, self.num_experts = moe.router, moe.top_k, moe.num_experts
        prefix = f"layers.{layer}.moe.router"
        self.register_buffer("router_weight", _fp32(weights[f"{prefix}.weight"]))
        self.register_buffer("router_bias", _fp32(weights[f"{prefix}.bias"]) if moe.router.bias else None)
        self.register_buffer("correction", _fp32(weights[f"{prefix}.correction_bias"])
                             if moe.router.correction_bias else None)
        self.graph = experts_graph(spec, layer, (0,), (1,), f"L{layer}.exported_expert")
        self.stacked = {}  # expert 0's weight names in the graph → every expert's, stacked [E, ...]
        self.packed = self._stack_packed(weights, layer)
        for name in () if self.packed else self.graph.weight_names():
            part = name[len(expert(layer, 0)) + 1:]
            buffer = "experts_" + part.replace(".", "_")
            self.register_buffer(buffer, torch.stack([_fp32(weights[f"{expert(layer, e)}.{part}"]).to(dtype)
                                                      for e in range(moe.num_experts)]))
            self.stacked[name] = buffer
        self.swiglu = self._swiglu_stacks(weights) if in_place and self.stacked and dtype == torch.float32 else None
        self.register_buffer("pair_token", torch.arange(chunk).repeat_interleave(moe.top_k))
        self.register_buffer("expert_ids", torch.arange(moe.num_experts))
        self._plan_capacities(groups, chunk)

    def _stack_packed(self, weights, layer: int) -> tuple[int, int, int] | None:
        """(bits, group, intermediate) when every expert is a plain SwiGLU of packed matrices of one format, their
        tiles, scales and zeros then stacked into buffers for ``npumoe::lut_swiglu_experts``; else None."""
        packed = getattr(weights, "packed", {})
        if not all(name in packed for name in self.graph.weight_names()):
            return None
        matrices = TorchGraphExecutor(self.graph, weights).swiglu_matrices
        if matrices is None:
            return None
        part = {id(packed[n]): n[len(expert(layer, 0)) + 1:] for n in self.graph.weight_names()}
        tiled = [[packed[f"{expert(layer, e)}.{part[id(m)]}"].tiled() for e in range(self.num_experts)]
                 for m in matrices]
        formats = {(t.bits, t.group, t.zeros is None) for ts in tiled for t in ts}
        if len(formats) != 1:
            return None
        for matrix, ts in zip(("gate", "up", "down"), tiled):
            for field, tensor in zip(("tiles", "scales", "zeros"), experts_op.stack(ts)):
                self.register_buffer(f"experts_{matrix}_{field}", tensor)
        return tiled[0][0].bits, tiled[0][0].group, tiled[0][0].shape[0]

    def _swiglu_stacks(self, weights) -> tuple[str, str, str] | None:
        """The buffers of the gate, up and down stacks when every expert is a plain SwiGLU (its linears in that
        order), for ``npumoe::swiglu_experts``; else None."""
        if TorchGraphExecutor(self.graph, weights).swiglu_matrices is None:
            return None
        linears = [op.inputs[1][len(WEIGHT_PREFIX):] for op in self.graph.ops if op.op == "linear"]
        return tuple(self.stacked[name] for name in linears)

    def _fused_experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Row r of x [rows, H] through its experts ids[r] weighted by weights[r], in one op over the stacks."""
        if self.swiglu:
            return experts_op.swiglu_experts(x, ids, weights, *(getattr(self, b) for b in self.swiglu))
        stacks = [tuple(getattr(self, f"experts_{m}_{f}") for f in ("tiles", "scales", "zeros"))
                  for m in ("gate", "up", "down")]
        return experts_op.lut_swiglu_experts(x, ids, weights, stacks, *self.packed)

    def _plan_capacities(self, groups: list[ExpertGroup], chunk: int) -> None:
        """The static groups' shapes as tensors, the buffer's width and the spill slots they need. An expert holds
        at most ``chunk`` of a chunk's pairs, so no capacity needs more."""
        smallest = [0] * self.num_experts  # each expert's least capacity over its group's shapes (0: CPU-resident)
        fixed = torch.zeros(self.num_experts, dtype=torch.int64)
        self.choices = []  # (group index buffer, its shapes' buffer, overflow cost) of groups with several shapes
        self.groups = []  # the group index buffer of every static group (for the padding count)
        for j, group in enumerate(g for g in groups if g.shapes):
            caps = torch.tensor([s.capacities for s in group.shapes])  # as compiled: the engine's choice and padding
            members = torch.tensor(group.experts)
            for column, e in enumerate(group.experts):
                smallest[e] = min(int(caps[:, column].min()), chunk)
            self.register_buffer(f"group_{j}_experts", members)
            self.groups.append(f"group_{j}_experts")
            if len(group.shapes) == 1:
                fixed[members] = caps[0]
                continue
            self.register_buffer(f"group_{j}_shapes", caps)
            self.choices.append((f"group_{j}_experts", f"group_{j}_shapes", group.overflow_cost))
        self.register_buffer("fixed_capacity", fixed)
        self.register_buffer("static_expert", torch.tensor([c > 0 for c in smallest]) if groups else
                             torch.zeros(self.num_experts, dtype=torch.bool))
        self.width = max((int(c) for g in groups for s in g.shapes for c in s.capacities), default=0)
        self.width = min(self.width, chunk)
        # the most pairs that can spill: every token routed to the k experts of least capacity
        self.spill_slots = sum(sorted((chunk - c for c in smallest), reverse=True)[:self.top_k])

    def _route(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        experts, gates, _ = route(z, self.router, self.router_weight, self.router_bias, self.correction)
        return experts.reshape(-1), gates.reshape(-1)

    def _experts(self, x: torch.Tensor, matrices: dict[str, torch.Tensor]) -> torch.Tensor:
        """x[E', R, H] through expert e's matrices for each leading index e (matrices stacked to match); its nodes are
        marked as the expert products (a target's lowering may hand its device exactly these), the casts to and from
        their dtype left outside."""
        x = x.to(self.dtype)
        with annotate(EXPERT_REGION):
            y = evaluate(self.graph, {"x": x}, matrices.__getitem__, EXPERT_OPS)["y"]
        return y.to(torch.float32)

    def _pairs(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Row i of x[n, H] through expert ``experts[i]``: its matrices read in place by the fused op, or gathered."""
        if self.packed or self.swiglu:
            return self._fused_experts(x, experts.unsqueeze(1), torch.ones(experts.shape[0], 1))
        matrices = {name: getattr(self, buffer).index_select(0, experts) for name, buffer in self.stacked.items()}
        return self._experts(x.unsqueeze(1), matrices).squeeze(1)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        expert_of, gate = self._route(z)
        if self.packed or self.swiglu:  # the routed experts and their weighted sum in one call, as the engine's
            return self._fused_experts(z, expert_of.unsqueeze(0), gate.unsqueeze(0))
        y = self._pairs(z.expand(self.top_k, -1), expert_of)
        return (y * gate.unsqueeze(1)).sum(0, keepdim=True)

    def prefill(self, z: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's output for the chunk, and [padded rows, spilled pairs] as the engine's metrics count them."""
        seq, hidden = z.shape
        expert_of, gate = self._route(z)
        token = self.pair_token
        real = token < valid  # padding rows route too, but their pairs take no slot
        counts = ((expert_of.unsqueeze(1) == self.expert_ids) & real.unsqueeze(1)).to(torch.int64).cumsum(0)
        rank = counts.gather(1, expert_of.unsqueeze(1)).squeeze(1) - 1  # within its expert, in token order
        y, spill, tally = None, real, torch.zeros(2, dtype=torch.int64)
        if self.width:
            capacity = self._capacities(counts[-1])
            fits = real & (rank < capacity.index_select(0, expert_of))
            y, spill = self._static_pass(z, token, expert_of, rank, fits), real & ~fits
            spilled = (spill & self.static_expert.index_select(0, expert_of)).sum()  # not the CPU-resident experts'
            tally = torch.stack((self._padded(counts[-1], capacity), spilled.to(torch.int64)))
        if self.spill_slots:
            spilled = self._spill_pass(z, token, expert_of, spill)
            y = spilled if y is None else y + spilled
        return (y * gate.unsqueeze(1)).view(seq, self.top_k, hidden).sum(1), tally

    def _padded(self, loads: torch.Tensor, capacity: torch.Tensor) -> torch.Tensor:
        """The empty rows of the groups' launches this chunk: a group launches when a pair fits (the engine's
        ``padded``; an expert's unused rows in a launched group count)."""
        padded = torch.zeros((), dtype=torch.int64)
        for members in self.groups:
            members = getattr(self, members)
            rows, filled = capacity.index_select(0, members), torch.minimum(loads.index_select(0, members), capacity
                                                                              .index_select(0, members))
            padded = padded + torch.where(filled.sum() > 0, rows.sum() - filled.sum(), 0)
        return padded

    def _capacities(self, loads: torch.Tensor) -> torch.Tensor:
        """[E] each expert's static slots this chunk: its group's shape of least padding + overflow_cost · overflow
        for these loads (:meth:`npumoe.core.runtime.moe.MoELayer._layout`)."""
        capacity = self.fixed_capacity
        for members, shapes, overflow_cost in self.choices:
            members, shapes = getattr(self, members), getattr(self, shapes)
            excess = shapes - loads.index_select(0, members)
            cost = excess.clamp(min=0).sum(1) + overflow_cost * (-excess).clamp(min=0).sum(1)
            chosen = shapes.index_select(0, cost.argmin().reshape(1)).squeeze(0)
            capacity = capacity.scatter(0, members, chosen)
        return capacity

    def _static_pass(self, z, token, expert_of, rank, fits) -> torch.Tensor:
        """[pairs, H] the pairs within capacity through the batched experts (zero for the others)."""
        rows = self.num_experts * self.width
        slot = torch.where(fits, expert_of * self.width + rank, rows)  # the rest write one scratch row
        buffer = _scatter_rows(z.new_zeros(rows + 1, z.shape[1]), slot, z.index_select(0, token))
        if self.packed:
            out = self._pairs(buffer[:rows], self.expert_ids.repeat_interleave(self.width))
        else:
            stacked = {name: getattr(self, buffer_name) for name, buffer_name in self.stacked.items()}
            out = self._experts(buffer[:rows].view(self.num_experts, self.width, -1), stacked).reshape(rows, -1)
        return torch.where(fits.unsqueeze(1), out.index_select(0, slot.clamp(max=rows - 1)), 0.0)

    def _spill_pass(self, z, token, expert_of, spill) -> torch.Tensor:
        """[pairs, H] the spilled pairs, each through its own expert (zero for the others)."""
        pairs, slots = token.shape[0], self.spill_slots
        slot = torch.where(spill, spill.to(torch.int64).cumsum(0) - 1, slots)  # spilled pairs in order; rest: scratch
        pair_of_slot = torch.full((slots + 1,), pairs).scatter(0, slot, torch.arange(pairs))[:slots]
        token_of_slot = torch.cat((token, token[:1])).index_select(0, pair_of_slot)  # (an empty slot: any row)
        expert_of_slot = torch.cat((expert_of, expert_of[:1])).index_select(0, pair_of_slot)
        y = self._pairs(z.index_select(0, token_of_slot), expert_of_slot)
        return _scatter_rows(z.new_zeros(pairs + 1, z.shape[1]), pair_of_slot, y)[:pairs]


class WholeModel(torch.nn.Module):
    """Embedding, every layer, the final norm and the LM head over a KV cache of ``program.max_context`` slots; the
    IR's ops run as ``impls`` implements them (default: the reference interpreter's), the expert products in
    ``expert_dtype``. ``in_place`` (a cpu program): fp32 experts' pair-by-pair path through ``npumoe::swiglu_experts``
    (:class:`StaticMoE`) and an fp32 LM head through ``npumoe::f32_linear_rows``, both reading their matrices where
    they lie (no gathered copies; no packed copy of the head, the largest matrix, in XNNPACK's memory)."""

    def __init__(self, program: Program, weights, impls: Mapping[str, Callable] = OP_IMPLS,
                 expert_dtype: torch.dtype = torch.float32, in_place: bool = False):
        super().__init__()
        self.impls, self.in_place = impls, in_place
        spec = self.spec = program.spec
        self.program, self.chunk, self.max_context = program, program.chunk, program.max_context
        self.alias = {"lm_head.weight": "embed.weight"} if spec.tie_embeddings else {}
        graphs = [g for g in program.graphs.values() if g.kind != "experts"]
        names = {n for g in graphs for n in g.weight_names()}
        self.packed = _packed_linears(graphs, weights)  # weight name → (bits, group): npumoe::lut_linear_rows
        for name in sorted((names | {"embed.weight"}) - set(self.alias)):
            if name not in self.packed:
                self.register_buffer(_buffer_name(name), _fp32(weights[name]))
                continue
            linear = weights.packed[name]
            zeros = torch.zeros(0, dtype=torch.uint8) if linear.zeros is None else linear.zeros
            for part, tensor in zip(PACKED_PARTS, (linear.tiles, linear.scales, zeros)):
                self.register_buffer(f"{_buffer_name(name)}_{part}", tensor)
        ropes = [(ls.attention.rope, ls.attention.qk_rope_head_dim if ls.attention.kind == "mla"
                  else ls.attention.head_dim) for ls in spec.layers]
        self.rope_of = [ropes.index(rope) for rope in ropes]  # per layer, the first layer alike in rope
        for key in sorted(set(self.rope_of)):  # every position a chunk can reach, padding rows included
            cos, sin = cos_sin(*ropes[key], np.arange(program.max_context + program.chunk))
            self.register_buffer(f"rope_cos_{key}", torch.from_numpy(cos))
            self.register_buffer(f"rope_sin_{key}", torch.from_numpy(sin))
        self.moe = torch.nn.ModuleDict()
        for i, step in enumerate(program.layers):
            graph = program.graphs[step.attention[1]]
            self.register_buffer(f"k_cache_{i}", torch.zeros(graph.inputs["k_cache"].shape))
            self.register_buffer(f"v_cache_{i}", torch.zeros(graph.inputs["v_cache"].shape))
            if step.moe is not None:
                self.moe[str(i)] = StaticMoE(spec, i, weights, step.moe.groups[program.chunk], program.chunk,
                                              expert_dtype, in_place)

    def _impls(self, valid: torch.Tensor | None) -> Mapping[str, Callable]:
        """The ops for a pass whose first ``valid`` rows are real (None: all): packed linears then compute those."""
        return {**self.impls, "linear": _or_packed(self.impls["linear"], valid)} if self.packed else self.impls

    def weight(self, name: str) -> torch.Tensor | PackedMatrix:
        name = self.alias.get(name, name)
        if name in self.packed:
            return PackedMatrix(*(getattr(self, f"{_buffer_name(name)}_{part}") for part in PACKED_PARTS),
                                *self.packed[name])
        return getattr(self, _buffer_name(name))

    def prefill(self, tokens: torch.Tensor, start: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
        """tokens [chunk] int64 at positions start.. (start [1]), the first ``valid`` [1] real → the last real
        position's logits [1, vocab] and the MoE layers' [padded rows, spilled pairs] (int64 [2]); their keys and
        values are in the cache."""
        x, tally = self._layers(tokens, start, valid)
        return self._head(x.index_select(0, valid - 1)), tally

    def decode(self, token: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """token [1] int64 at position ``start`` [1] → its logits [1, vocab]."""
        return self._head(self._layers(token, start, torch.ones_like(start))[0])

    def _layers(self, ids: torch.Tensor, start: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor,
                                                                                           torch.Tensor]:
        seq, spec = ids.shape[0], self.spec
        x = self.weight("embed.weight").index_select(0, ids)
        if spec.embedding_scale != 1.0:
            x = x * spec.embedding_scale
        positions = start + torch.arange(seq)
        rope_rows = {key: (getattr(self, f"rope_cos_{key}").index_select(0, positions),
                           getattr(self, f"rope_sin_{key}").index_select(0, positions)) for key in set(self.rope_of)}
        masks, tally, impls = {}, torch.zeros(2, dtype=torch.int64), self._impls(valid)
        for i, step in enumerate(self.program.layers):
            window = spec.layers[i].attention.sliding_window
            if window not in masks:
                masks[window] = attention_mask(window, start, valid, seq, self.max_context)
            k_cache, v_cache = getattr(self, f"k_cache_{i}"), getattr(self, f"v_cache_{i}")
            cos, sin = rope_rows[self.rope_of[i]]
            out = evaluate(self.program.graphs[step.attention[seq]], {
                "x": x, "cos": cos, "sin": sin, "mask": masks[window], "k_cache": k_cache, "v_cache": v_cache},
                self.weight, impls)
            # padding rows repeat the last real row's key and value at its slot, so every write is a real one
            source = torch.minimum(torch.arange(seq), valid - 1)
            k_cache[:, start + source] = out["k_new"].index_select(1, source)
            v_cache[:, start + source] = out["v_new"].index_select(1, source)
            y, counted = self._feed_forward(i, out["z"], valid, impls)
            x, tally = out["h"] + y, tally + counted
        return x, tally

    def _feed_forward(self, i: int, z: torch.Tensor, valid: torch.Tensor,
                      impls: Mapping[str, Callable]) -> tuple[torch.Tensor, torch.Tensor]:
        step, seq, none = self.program.layers[i], z.shape[0], torch.zeros(2, dtype=torch.int64)
        if step.moe is None:
            return evaluate(self.program.graphs[step.dense[seq]], {"z": z}, self.weight, impls)["y"], none
        moe = self.moe[str(i)]
        y, tally = (moe.decode(z), none) if seq == 1 else moe.prefill(z, valid)
        if step.moe.shared is not None:
            y = y + evaluate(self.program.graphs[step.moe.shared[seq]], {"z": z}, self.weight, impls)["y"]
        return y, tally

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        impls = self._impls(None)
        if self.in_place:
            impls = {**impls, "linear": _in_place(impls["linear"])}
        return evaluate(self.program.graphs[self.program.lm_head[1]], {"x": x}, self.weight, impls)["logits"]


class Method(torch.nn.Module):
    """One method of :class:`WholeModel` as a module's forward, for torch.export; every method's module holds the
    same model, so their buffers have the same names (the program's methods share what the names share)."""

    def __init__(self, model: WholeModel, name: str):
        super().__init__()
        self.model, self.method = model, name

    def forward(self, *inputs):
        return getattr(self.model, self.method)(*inputs)
