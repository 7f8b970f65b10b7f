"""The Program: every static graph a model needs, and the host steps that connect them.

Built from a spec and (optionally) a plan. Without a plan every expert is CPU-resident and
runs on exactly the tokens routed to it: nothing can overflow, nothing is padded, and the
program computes exactly what the checkpoint defines.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from npumoe.core.base.errors import InputError
from npumoe.core.base.machine import available_memory
from npumoe.core.compiler import graphs
from npumoe.core.ir.graph import Graph
from npumoe.core.ir.spec import MLPSpec, ModelSpec, MoESpec

HOST_OPS = ("embed", "rope_tables", "attention_mask", "kv_append", "router", "dispatch", "combine", "residual",
            "sample")


@dataclass(frozen=True)
class StaticShape:
    """One compiled graph of an expert group: its input stacks each expert's own slots, [Σ capacities, H]
    (expert g's rows follow expert g−1's), so a busy and a quiet expert share a launch without the quiet
    one padding to the busy one's size."""

    graph: str
    capacities: tuple[int, ...]  # static slots per expert, in the group's expert order

    @property
    def rows(self) -> int:
        return sum(self.capacities)


@dataclass(frozen=True)
class ExpertGroup:
    """Experts that run together. With static shapes they launch as one graph per chunk: the shape whose
    capacities fit that chunk's routing best (padding + ``overflow_cost`` · overflow), so a group need not
    pad every chunk to its busiest pattern. Without shapes they are CPU-resident and run on exactly their
    tokens."""

    name: str
    experts: tuple[int, ...]
    shapes: tuple[StaticShape, ...] = ()
    overflow_cost: float = 1.0  # an overflowing token's cost in padded slots, when choosing a shape

    def __post_init__(self):
        for shape in self.shapes:
            if len(shape.capacities) != len(self.experts):
                raise ValueError(f"{shape.graph}: {len(self.experts)} experts but {len(shape.capacities)} capacities")


@dataclass
class MoEStep:
    groups: dict[int, list[ExpertGroup]]  # by sequence length
    shared: dict[int, str] | None  # shared-expert graph by sequence length
    overflow: str = "spill"


@dataclass
class LayerStep:
    attention: dict[int, str]
    dense: dict[int, str] | None = None
    moe: MoEStep | None = None


@dataclass
class Program:
    spec: ModelSpec
    chunk: int
    max_context: int
    graphs: dict[str, Graph]
    layers: list[LayerStep]
    lm_head: dict[int, str]
    host_ops: tuple[str, ...] = field(default=HOST_OPS)

    @property
    def seqs(self) -> tuple[int, ...]:
        return tuple(sorted({self.chunk, 1}, reverse=True))


def _add(graphs_: dict[str, Graph], g: Graph) -> str:
    graphs_[g.name] = g
    return g.name


def unplanned_groups(spec: ModelSpec, i: int) -> list[ExpertGroup]:
    """Every expert CPU-resident, each run on its own tokens only: exact, never overflows, and a
    chunk of T tokens costs top-k·T expert rows, not T rows for every expert it hits."""
    moe: MoESpec = spec.layers[i].ffn
    return [ExpertGroup(f"L{i}.cpu.all", tuple(range(moe.num_experts)))]


def running_bytes(spec: ModelSpec, chunk: int, max_context: int) -> int:
    """fp32 bytes a run holds besides the weights: the KV cache, and one prefill chunk's activations (hidden
    states, the widest feed-forward, attention scores over the cache, logits). An estimate, within a small factor."""
    kv = sum(ls.attention.num_kv_heads * (ls.attention.head_dim + ls.attention.v_head_dim) for ls in spec.layers)
    widest = max((ls.ffn.intermediate if isinstance(ls.ffn, MLPSpec) else ls.ffn.expert.intermediate * ls.ffn.top_k)
                 for ls in spec.layers)
    heads = max(ls.attention.num_heads for ls in spec.layers)
    per_token = spec.vocab_size + 4 * spec.hidden_size + 3 * widest + heads * (max_context + chunk)
    return 4 * (max_context * kv + chunk * per_token)


def check_fits(spec: ModelSpec, chunk: int, max_context: int, planned: bool = False) -> None:
    """Refuse a chunk or context the machine cannot hold before anything is allocated: a typo such as
    --chunk 100000000 would otherwise ask the allocator for hundreds of GB and die with its message. ``planned``:
    the chunk is a plan's, so the fix is a new plan, not an option of this command."""
    need, free = running_bytes(spec, chunk, max_context), available_memory()
    if free and need > free:
        what = f"the plan's chunk {chunk}" if planned else f"--chunk {chunk}"
        fix = "make a plan with a smaller --chunk" if planned else "use a smaller --chunk"
        raise InputError(f"{what} with a {max_context}-token context needs about {need / 1e9:.3g} GB for "
                         f"activations and the KV cache, but {free / 1e9:.3g} GB is free; {fix} (or --max-context).")


def build_program(spec: ModelSpec, chunk: int = 64, max_context: int = 512, plan=None) -> Program:
    """Lay out every graph for prefill chunks of ``chunk`` tokens and single-token decode."""
    check_fits(spec, chunk, max_context, planned=plan is not None)
    out: dict[str, Graph] = {}
    seqs = sorted({chunk, 1}, reverse=True)
    steps: list[LayerStep] = []
    for i, ls in enumerate(spec.layers):
        step = LayerStep(attention={s: _add(out, graphs.attention_graph(spec, i, s, max_context)) for s in seqs})
        if isinstance(ls.ffn, MoESpec):
            groups = {s: (plan.groups(i, s) if plan is not None else unplanned_groups(spec, i)) for s in seqs}
            for s in seqs:
                for grp in groups[s]:
                    for shape in grp.shapes:
                        if shape.graph not in out:
                            _add(out, graphs.experts_graph(spec, i, grp.experts, shape.capacities, shape.graph))
            shared = {s: _add(out, graphs.ffn_graph(spec, i, s, shared=True)) for s in seqs} if ls.ffn.shared else None
            overflow = plan.overflow if plan is not None else "spill"
            step.moe = MoEStep(groups=groups, shared=shared, overflow=overflow)
        else:
            step.dense = {s: _add(out, graphs.ffn_graph(spec, i, s)) for s in seqs}
        steps.append(step)
    lm_head = {s: _add(out, graphs.lm_head_graph(spec, s)) for s in seqs}
    if plan is not None:
        plan.place(out)
    return Program(spec, chunk, max_context, out, steps, lm_head)
