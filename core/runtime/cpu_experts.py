"""One MoE layer's experts on the CPU: cold experts, spilled tokens, and every expert of an unplanned model.

The experts are the reference interpreter's one-expert graphs. This is the one place that decides how few kernel
calls they take, and the one place their calls are counted: a decode token's experts run as one fused call where
every expert is a plain SwiGLU (:meth:`TorchGraphExecutor.combine_many`), else side by side, one kernel call a graph
step (:meth:`~TorchGraphExecutor.run_many`); a prompt's rows, grouped by expert, as one batched pass over bf16
SwiGLU experts (:meth:`~TorchGraphExecutor.prompt_many`), else side by side; and, where the router is plain softmax
top-k, a decode token's routing and experts as one call for the whole layer (:meth:`layer_call`). Every way computes
what running each graph on its rows computes.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch

from npumoe.core.compiler.graphs import experts_graph
from npumoe.core.compiler.interpreter import TorchGraphExecutor
from npumoe.core.ir.spec import ModelSpec, RouterSpec
from npumoe.core.ir.weights import compute_bytes
from npumoe.core.runtime.metrics import Metrics
from npumoe.luts.decode import MoEBlock

_UNBUILT = object()  # the whole-layer call, not yet asked for


class CpuExperts:
    """A MoE layer's experts as interpreter graphs, by expert index, and how they run together."""

    def __init__(self, executors: Mapping[int, TorchGraphExecutor], expert_bytes: int = 0):
        """``expert_bytes``: the weights one expert call reads (counted as ``weight_bytes``)."""
        self.executors, self.expert_bytes = executors, expert_bytes
        self._names = {e: executor.graph.name for e, executor in executors.items()}
        self._block: MoEBlock | None | object = _UNBUILT

    @classmethod
    def of(cls, spec: ModelSpec, layer: int, weights) -> CpuExperts:
        """Layer ``layer``'s experts, each a graph of capacity 1 that any row count runs (``L{layer}.cpu.e{e}``)."""
        executors = {e: TorchGraphExecutor(experts_graph(spec, layer, (e,), (1,), f"L{layer}.cpu.e{e}"), weights)
                     for e in range(spec.layers[layer].ffn.num_experts)}
        return cls(executors, compute_bytes(weights, executors[0].graph.weight_names()))  # (experts alike)

    def token(self, z: torch.Tensor, experts: list[int], gates: torch.Tensor, m: Metrics) -> torch.Tensor:
        """Σ_i gates[i] · expert_i(z) for one token z [1, H]."""
        executors = [self.executors[e] for e in experts]
        with m.time("cpu_expert_ffn"):
            self.count(experts, m)
            with m.time("executor"):
                y = TorchGraphExecutor.combine_many(executors, z, gates)
                if y is not None:
                    return y
                results = TorchGraphExecutor.run_many(executors, [{"x": z}] * len(executors))
            return gates[None].to(z.dtype) @ torch.cat([r["y"] for r in results])  # [1, k] @ [k, H]

    def rows(self, x: torch.Tensor, experts: list[int], counts: list[int], m: Metrics) -> torch.Tensor:
        """Expert ``experts[i]``'s ``counts[i]`` consecutive rows of x through it: the outputs' rows in x's order."""
        executors = [self.executors[e] for e in experts]
        self.count(experts, m)
        with m.time("executor"):
            y = TorchGraphExecutor.prompt_many(executors, x, counts)
            if y is None:
                results = TorchGraphExecutor.run_many(executors, [{"x": part} for part in torch.split(x, counts)])
                y = torch.cat([r["y"] for r in results])
        return y

    def layer_call(self, router: RouterSpec, router_matrix: torch.Tensor) -> MoEBlock | None:
        """The whole layer — softmax top-k over ``router_matrix`` (fp32, no bias), then the picked experts' weighted
        sum — as one kernel call for a decode token, where every expert is a plain SwiGLU; built at first use,
        None where it does not apply."""
        if self._block is _UNBUILT:
            records = [self.executors[e].fused_expert for e in sorted(self.executors)]
            self._block = MoEBlock.of(router_matrix, records, router.top_k, router.normalize, router.routed_scaling)
        return self._block

    def run_layer(self, block: MoEBlock, z: torch.Tensor, m: Metrics):
        """(y, experts [1, k], gates [1, k]) of one token through :meth:`layer_call`'s block, timed as the step by
        step path times it (routing as ``router``, the experts as executor calls); None where it does not fit."""
        start = time.perf_counter()
        out = block(z)
        if out is None:
            return None
        end = time.perf_counter()
        y, experts, gates, _, routing = out
        m.record("router", start, start + routing)
        m.record("cpu_expert_ffn", start + routing, end)
        m.record("executor", start + routing, end)
        self.count(experts[0].tolist(), m)
        return y, experts, gates

    def count(self, experts: list[int], m: Metrics) -> None:
        """One call of each expert: its graph run, a CPU launch, its weights read."""
        m.count_runs([self._names[e] for e in experts])
        m.add("cpu_launches", len(experts))
        m.add("weight_bytes", len(experts) * self.expert_bytes)
