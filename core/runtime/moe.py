"""One MoE layer on the host: route, dispatch into static group buffers, run, combine.

Overflow policies (tokens past an expert's capacity in a static group):

* ``spill`` — run them on the CPU with the same weights; nothing is lost (default).
* ``drop`` — NPUMoE's policy: the lowest-saliency tokens lose their slot first
  (saliency = L2 norm of the token's attention output).
* ``reroute`` — move the pair to the token's next-best expert that still has room, taking
  that expert's router score as its weight, then rescale the token's weights so they sum
  to what they summed to before; a pair with nowhere to go is dropped.

Experts of CPU-resident groups (the plan's cold experts) run on exactly their tokens,
without padding: the CPU has no static-shape rule to pay for.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from npumoe.core.program import ExpertGroup
from npumoe.core.runtime.dispatch import Dispatch, Layout, assign, combine, gather
from npumoe.core.runtime.metrics import Metrics
from npumoe.core.runtime.router import all_scores, route
from npumoe.core.spec import MoESpec

Run = Callable[[str, Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]


class MoELayer:
    """Everything one MoE layer needs at run time, for one sequence length."""

    def __init__(self, layer: int, moe: MoESpec, weights, groups: list[ExpertGroup],
                 expert_executors: Mapping[int, Callable], overflow: str = "spill"):
        self.layer, self.moe, self.overflow = layer, moe, overflow
        prefix = f"layers.{layer}.moe.router"
        self.router_weight = weights[f"{prefix}.weight"]
        self.router_bias = weights[f"{prefix}.bias"] if moe.router.bias else None
        self.correction = weights[f"{prefix}.correction_bias"] if moe.router.correction_bias else None
        self.layout = Layout.of([g for g in groups if g.capacity], moe.num_experts)
        self.compact = torch.zeros(moe.num_experts, dtype=torch.bool)
        for g in groups:
            if not g.capacity:
                self.compact[list(g.experts)] = True
        self.expert_executors = expert_executors
        self._buffer: torch.Tensor | None = None

    def __call__(self, z: torch.Tensor, attn_out: torch.Tensor, valid: int, run: Run, m: Metrics,
                 on_route=None) -> torch.Tensor:
        seq = z.shape[0]
        with m.time("router"):
            experts, gates, logits = route(z[:valid], self.moe.router, self.router_weight, self.router_bias,
                                           self.correction)
        if on_route is not None:
            on_route(self.layer, experts, gates, attn_out[:valid])
        m.add("routed", experts.numel())
        if valid == 1 and seq == 1 and bool(self.compact[experts[0]].all()):
            return self._decode_on_cpu(z, experts[0].tolist(), gates[0], m)
        with m.time("gather"):
            saliency = attn_out[:valid].norm(dim=-1) if self.overflow == "drop" else None
            d = assign(experts, gates, self.layout, order_key=saliency, skip=self.compact)
            if self.overflow == "reroute" and d.overflow_static.any():
                d = self._reroute(d, experts, logits, m)
        with m.time("pad"):
            if self._buffer is None:
                self._buffer = z.new_zeros(self.layout.rows, z.shape[1])
            else:
                self._buffer.zero_()
        with m.time("gather"):
            buf = gather(z, d, self._buffer)
        y_buf = self._run_groups(buf, d, run, m)
        with m.time("scatter"):
            y = combine(y_buf, d, seq)
        overflow = d.overflow_static
        if self.overflow == "spill":
            m.add("spilled", int(overflow.sum()))
            cpu_pairs = d.compact | overflow
        else:  # drop, and reroute's pairs with nowhere to go
            m.add("dropped", int(overflow.sum()))
            cpu_pairs = d.compact
        if cpu_pairs.any():
            y += self._run_compact(z, d, cpu_pairs, m)
        return y

    def _run_groups(self, buf: torch.Tensor, d: Dispatch, run: Run, m: Metrics) -> torch.Tensor:
        """Launch each static group that received at least one token; empty ones are skipped."""
        used = torch.bincount(d.row[d.fits], minlength=max(self.layout.rows, 1))
        y_buf = torch.empty_like(buf)  # rows of skipped groups are never read
        with m.time("expert_ffn"):
            for grp, offset in zip(self.layout.groups, self.layout.group_offsets):
                rows = len(grp.experts) * grp.capacity
                filled = int(used[offset:offset + rows].sum())
                if filled == 0:
                    continue
                m.add("padded", rows - filled)
                y_buf[offset:offset + rows] = run(grp.graph, {"x": buf[offset:offset + rows]})["y"]
        return y_buf

    def _decode_on_cpu(self, z: torch.Tensor, experts: list[int], gates: torch.Tensor, m: Metrics) -> torch.Tensor:
        """One token whose experts all run on the CPU: each on the token's row, weighted and summed, with no
        dispatch tables (what :meth:`_run_compact` computes for one token, at a fraction of the host work)."""
        with m.time("cpu_expert_ffn"):
            executors = [self.expert_executors[e] for e in experts]
            with m.running([f"L{self.layer}.cpu.e{e}" for e in experts]):
                results = _run_side_by_side(executors, [{"x": z}] * len(experts))
            m.add("cpu_launches", len(experts))
            return gates[None].to(z.dtype) @ torch.cat([r["y"] for r in results])  # [1, k] @ [k, H]

    def _run_compact(self, z: torch.Tensor, d: Dispatch, pairs_mask: torch.Tensor, m: Metrics) -> torch.Tensor:
        """CPU path on exactly the given (token, expert) pairs: spilled tokens and cold experts."""
        out = torch.zeros_like(z)
        pairs = pairs_mask.nonzero().flatten()
        with m.time("cpu_expert_ffn"):
            experts = torch.unique(d.expert[pairs]).tolist()
            mine = [pairs[d.expert[pairs] == e] for e in experts]
            executors = [self.expert_executors[e] for e in experts]
            inputs = [{"x": z[d.token[pairs_e]]} for pairs_e in mine]
            with m.running([f"L{self.layer}.cpu.e{e}" for e in experts]):
                results = _run_side_by_side(executors, inputs)
            m.add("cpu_launches", len(experts))
            for pairs_e, result in zip(mine, results):
                out.index_add_(0, d.token[pairs_e], result["y"] * d.weight[pairs_e, None])
        return out

    def _reroute(self, d: Dispatch, experts: torch.Tensor, logits: torch.Tensor, m: Metrics) -> Dispatch:
        """Move overflowing pairs to each token's next-best expert with a free static slot."""
        scores = all_scores(logits, self.moe.router)
        ranking = scores.argsort(dim=-1, descending=True)
        free = self.layout.capacity - torch.bincount(d.expert[d.fits], minlength=self.moe.num_experts)
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
            d.row[moved] = self.layout.row_base[to] + (self.layout.capacity[to] - free[to]) + rank[accept]
            d.fits[moved] = True
            d.weight[moved] = scores[d.token[moved], to]
            free -= torch.bincount(to, minlength=self.moe.num_experts)
            taken[d.token[moved], to] = True
            m.add("rerouted", moved.numel())
            pending = pending[~torch.isin(pending, moved)]
        d.renormalise(d.fits | d.compact, target)
        return d


def _run_side_by_side(executors: list, inputs: list[Mapping[str, torch.Tensor]]) -> list[dict]:
    """Each executor on its inputs; together when their class offers ``run_many`` (the interpreter steps experts
    of one shape side by side: one kernel call per step for all of them). Duck-typed: core imports no backend."""
    run_many = getattr(type(executors[0]), "run_many", None) if executors else None
    if run_many is not None and all(type(e) is type(executors[0]) for e in executors):
        return run_many(executors, inputs)
    return [run(i) for run, i in zip(executors, inputs)]
