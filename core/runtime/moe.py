"""One MoE layer on the host: route, dispatch into static group buffers, run, combine.

Overflow policies (tokens past an expert's capacity in a static group):

* ``spill`` — run them on the CPU with the same weights; nothing is lost (default).
* ``drop`` — NPUMoE's policy: the lowest-saliency tokens lose their slot first
  (saliency = L2 norm of the token's attention output).
* ``reroute`` — move the pair to the token's next-best expert that still has room, taking
  that expert's router score as its weight, then rescale the token's weights so they sum
  to what they summed to before; a pair with nowhere to go is dropped.

Experts of CPU-resident groups (the plan's cold experts) run on exactly their tokens,
without padding: the CPU has no static-shape rule to pay for. They, spilled tokens and every
expert of an unplanned layer run through the layer's :class:`~npumoe.core.runtime.cpu_experts.CpuExperts`,
which picks the fused kernel calls and counts the calls: one path, whatever runs the experts.

A static group compiled in several shapes launches, per chunk, the shape that fits the chunk's
routing best: the host knows every expert's load before it launches anything.

With a ``device`` (one worker thread standing for the NPU's queue), the static groups' launches run
there while the CPU computes the spilled tokens and CPU-resident experts; metrics count the CPU expert
time spent beside NPU launches (``cpu_beside_npu``) and the part of it the NPU's time hid
(``cpu_hidden``). Executors release the GIL while they compute (torch ops, ONNX Runtime, Core ML), so
the two really run at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor as Worker

import torch

from npumoe.core.compiler.program import ExpertGroup
from npumoe.core.ir.spec import MoESpec
from npumoe.core.runtime.cpu_experts import CpuExperts
from npumoe.core.runtime.dispatch import Dispatch, Layout, assign, combine, gather
from npumoe.core.runtime.metrics import Metrics
from npumoe.core.runtime.router import all_scores, route
from npumoe.luts.decode import softmax_route

Run = Callable[[str, Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]


class MoELayer:
    """Everything one MoE layer needs at run time, for one sequence length."""

    def __init__(self, layer: int, moe: MoESpec, weights, groups: list[ExpertGroup], cpu: CpuExperts,
                 overflow: str = "spill", device: Worker | None = None):
        """``cpu``: the layer's experts on the CPU, for spilled tokens, CPU-resident groups and unplanned layers."""
        self.layer, self.moe, self.overflow, self.device, self.cpu = layer, moe, overflow, device, cpu
        prefix = f"layers.{layer}.moe.router"
        self.router_weight = weights[f"{prefix}.weight"]
        self.router_bias = weights[f"{prefix}.bias"] if moe.router.bias else None
        self.correction = weights[f"{prefix}.correction_bias"] if moe.router.correction_bias else None
        self._router_fp32: torch.Tensor | None = None  # the decode router's matrix, at first use
        self.static = [g for g in groups if g.shapes]
        self._shape_capacities = [torch.tensor([s.capacities for s in g.shapes]) for g in self.static]  # [V, G]
        self._layouts: dict[tuple[int, ...], Layout] = {}
        self.compact = torch.zeros(moe.num_experts, dtype=torch.bool)
        for g in groups:
            if not g.shapes:
                self.compact[list(g.experts)] = True
        self._buffer = torch.empty(0, self.router_weight.shape[-1])  # grows to the largest launch set's rows

    def __call__(self, z: torch.Tensor, attn_out: torch.Tensor, valid: int, run: Run, m: Metrics,
                 on_route=None, chunks: int = 0) -> torch.Tensor:
        """y for the chunk ``z`` (its first ``valid`` rows real). With ``chunks``, ``z`` is a prompt's tokens at this
        layer, that many chunks of them, and each static group launches on them as :meth:`_buffered_layout` says."""
        seq = z.shape[0]
        decode = seq == valid == 1
        fused = self.fused_layer() if decode and not self.static else None
        if fused is not None and (out := self.cpu.run_layer(fused, z, m)) is not None:
            y, experts, gates = out  # routed and run in one call
        else:
            with m.time("router"):
                routed = self._route_one(z) if decode else None
                experts, gates, logits = routed or route(z[:valid], self.moe.router, self.router_weight,
                                                         self.router_bias, self.correction)
            y = None
        if on_route is not None:
            on_route(self.layer, experts, gates, attn_out[:valid])
        m.add("routed", experts.numel())
        if y is not None:
            return y
        if decode and (not self.static or bool(self.compact[experts[0]].all())):  # a token on CPU experts only
            return self.cpu.token(z, experts[0].tolist(), gates[0], m)
        with m.time("gather"):
            layout = self._buffered_layout(experts, chunks) if chunks else self._layout(experts)
            saliency = attn_out[:valid].norm(dim=-1) if self.overflow == "drop" else None
            d = assign(experts, gates, layout, order_key=saliency, skip=self.compact)
            if self.overflow == "reroute" and d.overflow_static.any():
                d = self._reroute(d, layout, experts, logits, m)
        with m.time("pad"):
            if self._buffer.shape[0] < layout.rows or self._buffer.dtype != z.dtype:
                self._buffer = z.new_zeros(layout.rows, z.shape[1])
            buf = self._buffer[:layout.rows].zero_()
        with m.time("gather"):
            buf = gather(z, d, buf)
        overflow = d.overflow_static
        if self.overflow == "spill":
            m.add("spilled", int(overflow.sum()))
            cpu_pairs = d.compact | overflow
        else:  # drop, and reroute's pairs with nowhere to go
            m.add("dropped", int(overflow.sum()))
            cpu_pairs = d.compact
        if not cpu_pairs.any():
            y_cpu = None
            y_buf = self._run_groups(buf, d, layout, run, m)
        elif self.device is None or not layout.launches:
            y_buf = self._run_groups(buf, d, layout, run, m)
            y_cpu = self._run_compact(z, d, cpu_pairs, m)
        else:
            y_buf, y_cpu = self._overlapped(buf, z, d, layout, cpu_pairs, run, m)
        with m.time("scatter"):
            y = combine(y_buf, d, seq)
        if y_cpu is not None:
            y += y_cpu
        return y

    def fused_layer(self):
        """The layer as one kernel call for a decode token (:meth:`CpuExperts.layer_call`), where its router is
        plain softmax top-k; None elsewhere."""
        return self.cpu.layer_call(self.moe.router, self._router_matrix()) if self._plain_softmax_router() else None

    def count_decode(self, experts: list[int], m: Metrics) -> None:
        """A decode token's counts when a whole-step call ran the layer: its routed pairs and its experts' calls."""
        m.add("routed", len(experts))
        self.cpu.count(experts, m)

    def _plain_softmax_router(self) -> bool:
        """Softmax top-k with no router bias and no correction: the router the fused decode calls compute."""
        return self.moe.router.scoring == "softmax" and self.router_bias is None and self.correction is None

    def _router_matrix(self) -> torch.Tensor:
        """The router in fp32 for the decode kernels (a bf16 one widened once, not every token: E·H·4 bytes)."""
        if self._router_fp32 is None:
            self._router_fp32 = self.router_weight.float().contiguous()
        return self._router_fp32

    def _route_one(self, z: torch.Tensor):
        """A decode token's softmax routing in one kernel call, where the router is plain softmax top-k (no bias,
        no correction) over an fp32 matrix; None elsewhere (:func:`route` then)."""
        router = self.moe.router
        if not self._plain_softmax_router():
            return None
        return softmax_route(z, self._router_matrix(), router.top_k, router.normalize, router.routed_scaling)

    def _overlapped(self, buf, z, d, layout, cpu_pairs, run: Run, m: Metrics):
        """The static launches on the device worker while the CPU pairs run here; their outputs, and how much of
        the CPU expert time the launches' time covered."""
        def launch():
            with torch.inference_mode():  # (thread-local: the engine's caller thread is in it)
                return self._run_groups(buf, d, layout, run, m), time.perf_counter()

        npu_start = time.perf_counter()
        launched = self.device.submit(launch)
        cpu_start = time.perf_counter()
        y_cpu = self._run_compact(z, d, cpu_pairs, m)
        cpu_end = time.perf_counter()
        y_buf, npu_end = launched.result()
        m.seconds["cpu_beside_npu"] += cpu_end - cpu_start  # the worker is done: no other writer now
        m.seconds["cpu_hidden"] += max(0.0, min(cpu_end, npu_end) - max(cpu_start, npu_start))
        return y_buf, y_cpu

    def _layout(self, experts: torch.Tensor) -> Layout:
        """Each static group's best-fitting shape for this chunk's expert loads: the least padding +
        overflow_cost · overflow (the cost the planner fitted the shapes to)."""
        loads = torch.bincount(experts.reshape(-1), minlength=self.moe.num_experts)
        choice = []
        for group, caps in zip(self.static, self._shape_capacities):
            if len(caps) == 1:
                choice.append(0)
                continue
            excess = caps - loads[list(group.experts)]  # [V, G]
            cost = excess.clamp(min=0).sum(1) + group.overflow_cost * (-excess).clamp(min=0).sum(1)
            choice.append(int(cost.argmin()))
        key = tuple(choice)
        if key not in self._layouts:
            self._layouts[key] = Layout.of([(g, g.shapes[v]) for g, v in zip(self.static, key)], self.moe.num_experts)
        return self._layouts[key]

    def _buffered_layout(self, experts: torch.Tensor, chunks: int) -> Layout:
        """Expert-wise token buffering: a prompt's routed tokens wait per expert, and each static group launches
        its best-fitting shape on what is waiting, again and again — at most once per chunk the prompt spans, as
        chunk by chunk it would, and while a launch is at least half full (or, when overflow costs more than
        padding, while its padding costs less than sending its tokens to the CPU). What is left spills. Launches
        run full but for the last, where chunk by chunk every launch pads to its chunk's routing burstiness."""
        loads = torch.bincount(experts.reshape(-1), minlength=self.moe.num_experts)
        launches = []
        for group, caps in zip(self.static, self._shape_capacities):
            waiting, launched = loads[list(group.experts)], 0
            while int(waiting.sum()) and launched < chunks:
                excess = caps - waiting  # [V, G]
                v = int((excess.clamp(min=0).sum(1) + group.overflow_cost * (-excess).clamp(min=0).sum(1)).argmin())
                fill = int(torch.minimum(caps[v], waiting).sum())
                if int(caps[v].sum()) - fill > max(1.0, group.overflow_cost) * fill:
                    break
                launches.append((group, group.shapes[v]))
                waiting, launched = (waiting - caps[v]).clamp(min=0), launched + 1
        return Layout.of(launches, self.moe.num_experts)

    @staticmethod
    def _run_groups(buf: torch.Tensor, d: Dispatch, layout: Layout, run: Run, m: Metrics) -> torch.Tensor:
        """Launch each group's chosen shape if it received at least one token; empty ones are skipped."""
        used = torch.bincount(d.row[d.fits], minlength=max(layout.rows, 1))
        y_buf = torch.empty_like(buf)  # rows of skipped launches are never read
        with m.time("expert_ffn"):
            for (_, shape), offset in zip(layout.launches, layout.offsets):
                rows = shape.rows
                filled = int(used[offset:offset + rows].sum())
                if filled == 0:
                    continue
                m.add("padded", rows - filled)
                y_buf[offset:offset + rows] = run(shape.graph, {"x": buf[offset:offset + rows]})["y"]
        return y_buf

    def _run_compact(self, z: torch.Tensor, d: Dispatch, pairs_mask: torch.Tensor, m: Metrics) -> torch.Tensor:
        """CPU path on exactly the given (token, expert) pairs: spilled tokens and cold experts. The pairs are
        sorted by expert once, so each expert's rows are one slice of a single gather (not a mask and a gather per
        expert), the experts run together (:meth:`CpuExperts.rows`), and the weighted outputs are added back in one
        call, pair after pair as expert after expert did."""
        out = torch.zeros_like(z)
        pairs = pairs_mask.nonzero().flatten()
        with m.time("cpu_expert_ffn"):
            pairs = pairs[torch.argsort(d.expert[pairs], stable=True)]
            experts, counts = torch.unique_consecutive(d.expert[pairs], return_counts=True)
            tokens = d.token[pairs]
            y = self.cpu.rows(z[tokens], experts.tolist(), counts.tolist(), m)
            out.index_add_(0, tokens, y.mul_(d.weight[pairs, None]))  # (y: this call's own tensor)
        return out

    def _reroute(self, d: Dispatch, layout: Layout, experts: torch.Tensor, logits: torch.Tensor,
                 m: Metrics) -> Dispatch:
        """Move overflowing pairs to each token's next-best expert with a free static slot."""
        scores = all_scores(logits, self.moe.router)
        ranking = scores.argsort(dim=-1, descending=True)
        free = layout.capacity - torch.bincount(d.expert[d.fits], minlength=self.moe.num_experts)
        taken = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, experts, True)
        target = torch.zeros(experts.shape[0]).index_add_(0, d.token, d.weight)
        pending = d.overflow_static.nonzero().flatten()
        for r in range(self.moe.top_k, self.moe.num_experts):
            if pending.numel() == 0:
                break
            cand = ranking[d.token[pending], r]
            ok = ~taken[d.token[pending], cand] & (free[cand] > 0) & ~self.compact[cand]
            pend, cand = pending[ok], cand[ok]
            order = torch.argsort(cand, stable=True)
            pend, cand = pend[order], cand[order]
            counts = torch.bincount(cand, minlength=self.moe.num_experts)
            rank = torch.arange(cand.numel()) - (torch.cumsum(counts, 0) - counts)[cand]
            accept = rank < free[cand]
            moved, to = pend[accept], cand[accept]
            d.expert[moved] = to
            d.row[moved] = layout.row(to, layout.capacity[to] - free[to] + rank[accept])
            d.fits[moved] = True
            d.weight[moved] = scores[d.token[moved], to]
            free -= torch.bincount(to, minlength=self.moe.num_experts)
            taken[d.token[moved], to] = True
            m.add("rerouted", moved.numel())
            pending = pending[~torch.isin(pending, moved)]
        d.renormalise(d.fits | d.compact, target)
        return d

