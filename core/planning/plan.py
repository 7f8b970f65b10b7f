"""The planner: expert groups, their static capacity shapes and residency from a RoutingProfile.

Driven only by the profile (per-chunk expert loads at chunk size B) and the target's
:class:`~npumoe.core.ir.backend.Capabilities`.

Capacities. For expert e at capacity C, over calibration chunks c with load n_ce:
padding(C) = E[max(0, C − n_ce)] and overflow(C) = E[max(0, n_ce − C)]. Three methods:

* ``uniform`` — NPUMoE's single capacity: every expert gets C = r_l·B·k/E.
* ``paper`` — NPUMoE's tiers: C_base = B·k/E (the mean load; the paper writes B/E with B
  counting routed slots), n_max = r_l·C_base, tiers {n_max, midpoint, C_base}, each expert
  in the smallest tier at or above its mean load (here as its capacity in its group's one shape).
* ``optimal`` (default) — per expert group, up to ``graphs_per_layer`` compiled shapes (a capacity
  per expert each), fitted like k-medians to the calibration chunks' routing patterns: each chunk
  goes to the shape with the least padding + λ·overflow, each shape's capacities are that cost's
  optimum over its chunks (the λ/(1+λ) quantile of each expert's load), and λ is the smallest
  that keeps expected overflow within ``max_overflow`` of routed slots. The runtime launches,
  per chunk, the shape that fits its routing best. One capacity per graph padded every chunk's
  quiet experts to the busiest pattern's size: routing is bursty (a topic shift moves load
  between experts), and it is the same few patterns again and again.

Groups: every expert, ordered by popularity, cut into graphs of at most G experts (G bounded
by the target's max graph bytes). A group graph stacks each expert's own capacity, so the
capacities cost no extra graphs. A target whose graphs cannot share weights (``one_graph_per_weights``: the
HTP) gets its groups cut as its decode graphs would be, one shape each, and decodes on them
(``decode="prefill"``): each compiled graph then holds its experts' only copy, and a decode launch reads no more
than a decode graph would. Residency: a group runs on the NPU when its expected useful
tokens per launch pay for the dispatch cost (``auto``), always (``npu``) or never (``cpu``).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from npumoe.core.base.errors import ArtifactError, InputError
from npumoe.core.base.io import read_json_artifact, write_output
from npumoe.core.base.outputs import OutputKind, json_kind
from npumoe.core.compiler.graphs import experts_graph
from npumoe.core.compiler.program import ExpertGroup, StaticShape, build_program
from npumoe.core.ir.backend import Capabilities, Device, capabilities, plugin
from npumoe.core.ir.identity import check_weights
from npumoe.core.ir.spec import ModelSpec
from npumoe.core.ir.weights import expected_shapes, mlp_shapes
from npumoe.core.planning import (
    DECODE,
    DECODE_GRAPHS_PER_LAYER,
    GRAPH_OVERHEAD_SHARE,
    GRAPHS_PER_LAYER,
    METHODS,
    OVERFLOW_POLICIES,
    RESIDENCY,
)
from npumoe.core.planning.profile import RoutingProfile, imbalance

MAX_GROUP_EXPERTS = 16
MAX_ALIGNMENT = 1024  # far beyond any NPU's tile (ANE 16, HTP 8, Intel 16): a larger one is an edited plan
KIND = "npumoe.Plan"
PLAN = OutputKind("a plan (npumoe plan)", directory=False, recognise=json_kind(KIND))


@dataclass
class GroupPlan:
    experts: list[int]
    shapes: list[list[int]]  # per compiled shape, each expert's static slots; none = CPU-resident
    residency: str  # "npu" | "cpu"
    expected_tokens: float  # useful token-slots per chunk
    weight_bytes: int
    decode_experts: int = 0  # experts per decode graph, in the group's order (0: the whole group, one graph)

    def decode_parts(self) -> list[list[int]]:
        """The group's experts as its decode graphs hold them."""
        return cut(self.experts, self.decode_experts or len(self.experts))


def cut(items, size: int) -> list:
    """``items`` in consecutive runs of ``size`` (the last may be shorter)."""
    return [items[a:a + size] for a in range(0, len(items), size)]


@dataclass
class LayerPlan:
    groups: list[GroupPlan]
    predicted: dict = field(default_factory=dict)
    overflow_cost: float = 1.0  # λ: an overflowing token's cost in padded slots, when a shape is chosen


@dataclass
class Plan:
    model: str  # spec fingerprint
    model_name: str
    target: str
    chunk: int
    overflow: str
    residency: str
    method: str
    dense_placement: str  # attention, dense FFN, shared experts, LM head
    layers: dict[int, LayerPlan]
    predicted: dict = field(default_factory=dict)
    alignment: int = 1
    weights: str | None = None  # weights fingerprint (npumoe.core.ir.identity); None in plans made before it
    # graphs the target cannot take → why (its declared ops and sizes); they run on the CPU. A layer
    # whose expert graphs it cannot take is keyed "L{i}.experts" (its groups are then CPU-resident).
    cpu_graphs: dict[str, str] = field(default_factory=dict)
    decode: str = "own"  # single-token decode on graphs of its own, or on the groups' prefill graphs (DECODE)

    # -- what the program builder asks ---------------------------------------------------------
    def groups(self, layer: int, seq: int) -> list[ExpertGroup]:
        """Static groups for prefill chunks, each in its compiled shapes; for single-token decode, each group
        cut into graphs of ``decode_experts`` experts at the smallest aligned capacity (each expert sees at
        most one token per step), so that a step reads the weights of the graphs its experts are in; or, with
        ``decode`` "prefill", the prefill groups themselves."""
        lp, out = self.layers[layer], []
        for j, g in enumerate(lp.groups):
            if not g.shapes:
                out.append(ExpertGroup(f"L{layer}.cpu.g{j}", tuple(g.experts)))
            elif seq == self.chunk or self.decode == "prefill":
                shapes = tuple(StaticShape(f"L{layer}.experts.g{j}.p{v}", tuple(c)) for v, c in enumerate(g.shapes))
                out.append(ExpertGroup(f"L{layer}.g{j}", tuple(g.experts), shapes, lp.overflow_cost))
            else:
                parts = g.decode_parts()
                for t, part in enumerate(parts):
                    suffix = "" if len(parts) == 1 else str(t)
                    shape = StaticShape(f"L{layer}.experts.g{j}.d{suffix}", (self.alignment,) * len(part))
                    out.append(ExpertGroup(f"L{layer}.g{j}{'.' * bool(suffix)}{suffix}", tuple(part), (shape,),
                                           lp.overflow_cost))
        return out

    def place(self, graphs: dict) -> None:
        npu_groups = {shape.graph for i in self.layers for s in {self.chunk, 1} for grp in self.groups(i, s)
                      for shape in grp.shapes}
        for g in graphs.values():
            if g.kind == "experts":
                g.placement = "npu" if g.name in npu_groups else "cpu"
            else:
                g.placement = "cpu" if g.name in self.cpu_graphs else self.dense_placement

    def check_model(self, model) -> None:
        if self.model != model.spec.fingerprint():
            raise ArtifactError(
                f"this plan was made for another model ({self.model_name}, fingerprint {self.model}); "
                f"make one for {model.name} (fingerprint {model.spec.fingerprint()}) with npumoe plan."
            )
        check_weights(self.weights, model, "this plan", self.model_name, f"make one for {model.name} with npumoe plan")
        self._check_fits(model.spec)

    def _check_fits(self, spec: ModelSpec) -> None:
        """Values the fingerprints do not cover, checked against the model: an edited plan (or one inside
        an artifact manifest) naming layer 7 of a 2-layer model or a negative capacity is refused here."""
        def bad(what: str):
            raise ArtifactError(f"this plan is damaged: {what}; make a new one with npumoe plan.")

        if self.chunk < 1 or not 1 <= self.alignment <= MAX_ALIGNMENT:
            bad(f"chunk {self.chunk} must be ≥ 1 and alignment {self.alignment} between 1 and {MAX_ALIGNMENT}")
        if not all(isinstance(why, str) for why in self.cpu_graphs.values()):
            bad("its cpu_graphs must map graph names to the reasons they run on the CPU")
        for name, value, allowed in (("overflow", self.overflow, OVERFLOW_POLICIES), ("decode", self.decode, DECODE),
                                     ("dense_placement", self.dense_placement, ("cpu", "npu"))):
            if value not in allowed:
                bad(f"its {name} is {value!r}, not one of {', '.join(allowed)}")
        if sorted(self.layers) != sorted(spec.moe_layers):
            bad(f"it plans layers {sorted(self.layers)}, but the model's MoE layers are {list(spec.moe_layers)}")
        for i, lp in self.layers.items():
            moe = spec.layers[i].ffn
            experts = sorted(e for g in lp.groups for e in g.experts)
            if experts != list(range(moe.num_experts)) or not all(g.experts for g in lp.groups):
                bad(f"layer {i}'s groups do not hold each of its {moe.num_experts} experts once")
            if not (math.isfinite(lp.overflow_cost) and lp.overflow_cost >= 0):
                bad(f"layer {i}'s overflow_cost is {lp.overflow_cost}, not a number ≥ 0")
            # an expert gets at most chunk · top-k slots (the planner's bound, aligned); a capacity
            # beyond it is an edit, and would shape graphs of up to 2^63 rows
            most = -(-self.chunk * moe.top_k // self.alignment) * self.alignment
            for j, g in enumerate(lp.groups):
                npu = g.residency == "npu"
                if (g.residency not in ("npu", "cpu") or npu != bool(g.shapes)
                        or any(len(c) != len(g.experts) for c in g.shapes)):
                    bad(f"layer {i} has a group of shapes {g.shapes} for {len(g.experts)} experts with residency "
                        f"{g.residency!r}")
                if not all(1 <= capacity <= most for c in g.shapes for capacity in c):
                    bad(f"layer {i} group {j}'s shapes {g.shapes} hold a capacity outside 1-{most} (chunk "
                        f"{self.chunk} × top-k {moe.top_k}, aligned to {self.alignment})")
                if not 0 <= g.decode_experts <= len(g.experts):
                    bad(f"layer {i} cuts a group of {len(g.experts)} experts into decode graphs of {g.decode_experts}")
                if not (math.isfinite(g.expected_tokens) and g.expected_tokens >= 0 and g.weight_bytes >= 0):
                    bad(f"layer {i} group {j} expects {g.expected_tokens} tokens of {g.weight_bytes} weight bytes")

    # -- files -----------------------------------------------------------------------------------
    def to_json(self) -> dict:
        data = asdict(self)
        data["layers"] = {str(i): v for i, v in data["layers"].items()}
        return {"kind": KIND, **data}

    def save(self, path: str | Path) -> Path:
        return write_output(path, PLAN, json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        return cls.from_json(read_json_artifact(path, KIND, "a plan (npumoe plan --out)"))

    @classmethod
    def from_json(cls, data: dict, where: str = "the plan") -> Plan:
        """A plan from its JSON, every field checked for its type first: a plan is a file a user may edit,
        and a wrong one must be named (ArtifactError), never fail deep in the runtime."""
        data = {k: v for k, v in data.items() if k != "kind"}
        _check_fields(cls, data, where)
        if not isinstance(data["layers"], dict) or not all(str(i).isdigit() for i in data["layers"]):
            raise ArtifactError(f"{where} is damaged: its 'layers' must map layer numbers to layer plans; "
                                "make a new one with npumoe plan.")
        layers = {}
        for i, lp in data.pop("layers").items():
            lp = _upgraded_layer(lp)
            _check_fields(LayerPlan, lp, f"{where}'s layer {i}")
            for j, g in enumerate(lp["groups"]):
                _check_fields(GroupPlan, g, f"{where}'s layer {i} group {j}")
            layers[int(i)] = LayerPlan(**{**lp, "groups": [GroupPlan(**g) for g in lp["groups"]]})
        return cls(layers=layers, **data)


def _upgraded_layer(layer):
    """A layer of a plan made before shapes (capacity tiers, one ``capacity`` for all of a group's experts)
    in today's form; anything else as it is."""
    if not isinstance(layer, dict) or "tiers" not in layer or not isinstance(layer.get("groups"), list):
        return layer
    groups = []
    for g in layer["groups"]:
        if isinstance(g, dict) and isinstance(g.get("experts"), list) and isinstance(g.get("capacity"), int):
            g = {k: v for k, v in g.items() if k != "capacity"} | {
                "shapes": [[g["capacity"]] * len(g["experts"])] if g["capacity"] else []}
        groups.append(g)
    return {k: v for k, v in layer.items() if k not in ("tiers", "expert_tier")} | {"groups": groups}


_JSON_TYPES = {"str": str, "int": int, "float": (int, float), "dict": dict, "list[int]": list, "list[GroupPlan]": list,
               "list[list[int]]": list,
               "dict[int, LayerPlan]": dict, "str | None": (str, type(None)), "dict[str, str]": dict}


def _check_fields(cls, data, where: str) -> None:
    """Every field of dataclass ``cls`` without a default is in ``data``, and every present one has its
    annotated JSON type (ints are whole numbers, never booleans; list[int] holds only ints)."""
    if not isinstance(data, dict):
        raise ArtifactError(f"{where} is damaged: expected a JSON object, got {data!r:.60}; make a new one with "
                            "npumoe plan.")
    from dataclasses import MISSING, fields

    for f in fields(cls):
        if f.name not in data:
            if f.default is MISSING and f.default_factory is MISSING:
                raise ArtifactError(f"{where} is damaged: it has no {f.name!r}; make a new one with npumoe plan.")
            continue
        value = data[f.name]
        whole = _whole_numbers(f.type, value) if isinstance(value, _JSON_TYPES[f.type]) else None
        if whole is None or isinstance(value, bool) or not all(isinstance(x, int) and not isinstance(x, bool)
                                                               for x in whole):
            raise ArtifactError(f"{where} is damaged: its {f.name!r} is {value!r:.60}, not a {f.type}; make a new "
                                "one with npumoe plan.")
    unknown = sorted(set(data) - {f.name for f in fields(cls)})
    if unknown:
        raise ArtifactError(f"{where} is damaged: it has an unknown field {unknown[0]!r}; make a new one with "
                            "npumoe plan.")


def _whole_numbers(kind: str, value) -> list | None:
    """The values inside ``value`` (of JSON type ``kind``) that must be whole numbers; None where a list of
    lists holds something else than lists (a capacity where a shape belongs)."""
    if kind == "int":
        return [value]
    if kind == "list[int]":
        return value
    if kind == "list[list[int]]":
        return [x for row in value for x in row] if all(isinstance(row, list) for row in value) else None
    return []


def artifacts_plan(manifest: dict, where, given: Plan | None = None) -> Plan:
    """The plan artifacts were built from (their manifest's), or ``given`` only where it is that very plan:
    the compiled graphs hold its experts in its order, and a plan for another target, chunk or expert order
    would run them as other experts (or fail deep in a toolchain)."""
    built = Plan.from_json(manifest["plan"], f"the plan in {where}")
    if given is not None and (difference := _first_difference(given.to_json(), built.to_json())):
        field, mine, theirs = difference
        raise ArtifactError(f"the plan passed (--plan) is not the one {where} was built from: its {field} is "
                            f"{mine:.60}, the artifacts' {theirs:.60}; run without --plan (artifacts carry their "
                            "plan) or rebuild with this plan.")
    return built


def _first_difference(mine, theirs, path: str = "") -> tuple[str, str, str] | None:
    """Where two JSON values first differ (fields in ``mine``'s order): (dotted path, mine, theirs), the
    values as JSON, or None when they are equal."""
    if isinstance(mine, dict) and isinstance(theirs, dict):
        for key in [*mine, *(k for k in theirs if k not in mine)]:
            if key not in mine or key not in theirs:
                return f"{path}{key}", *(json.dumps(side[key]) if key in side else "absent" for side in (mine, theirs))
            if found := _first_difference(mine[key], theirs[key], f"{path}{key}."):
                return found
        return None
    if isinstance(mine, list) and isinstance(theirs, list) and len(mine) == len(theirs):
        for i, (a, b) in enumerate(zip(mine, theirs)):
            if found := _first_difference(a, b, f"{path}{i}."):
                return found
        return None
    return None if mine == theirs else (path.rstrip("."), json.dumps(mine), json.dumps(theirs))


# -- capacities ----------------------------------------------------------------------------------
def expected_padding(loads: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """[E, K] mean padded slots of each expert at each candidate capacity."""
    return np.maximum(capacity[None, :, None] - loads.T[:, None, :], 0).mean(axis=2)


def expected_overflow(loads: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    return np.maximum(loads.T[:, None, :] - capacity[None, :, None], 0).mean(axis=2)


def _aligned(x: float, align: int, chunk_slots: int) -> int:
    return int(min(max(align, math.ceil(x / align) * align), math.ceil(chunk_slots / align) * align))


def paper_tiers(loads: np.ndarray, align: int, uniform: bool) -> tuple[list[int], list[int]]:
    chunk_slots = int(loads.sum(axis=1).max())
    experts = loads.shape[1]
    base = chunk_slots / experts
    n_max = _aligned(base * imbalance(loads), align, chunk_slots)
    if uniform:
        return [n_max], [0] * experts
    tiers = sorted({n_max, _aligned((n_max + base) / 2, align, chunk_slots), _aligned(base, align, chunk_slots)},
                   reverse=True)
    mean_load = loads.mean(axis=0)
    assignment = []
    for m in mean_load:
        fitting = [j for j, c in enumerate(tiers) if c >= m]
        assignment.append(fitting[-1] if fitting else 0)
    return tiers, assignment


def shape_costs(loads: np.ndarray, shapes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[C, V] padded and overflowing slots of each chunk (loads [C, G]) under each shape (shapes [V, G])."""
    excess = shapes[None, :, :] - loads[:, None, :]
    return np.maximum(excess, 0).sum(axis=2), np.maximum(-excess, 0).sum(axis=2)


def chosen_shapes(loads: np.ndarray, shapes: np.ndarray, overflow_cost: float) -> np.ndarray:
    """[C] the shape each chunk launches: the least padding + overflow_cost · overflow (as the runtime picks)."""
    pad, over = shape_costs(loads, shapes)
    return np.argmin(pad + overflow_cost * over, axis=1)


def fit_shapes(loads: np.ndarray, align: int, overflow_cost: float, count: int, chunk_slots: int) -> np.ndarray:
    """Up to ``count`` capacity vectors [V, G] for a group's chunk loads [C, G], fitted like k-medians: each
    chunk goes to the shape it costs least under, and each shape takes, per expert, the aligned capacity
    minimising padding + overflow_cost · overflow over its chunks (the cost is convex in the capacity, so
    it sits at an aligned neighbour of the overflow_cost/(1+overflow_cost) quantile)."""
    quantile, count = overflow_cost / (1 + overflow_cost), min(count, len(loads))  # no more shapes than chunks
    top = math.ceil(chunk_slots / align) * align

    def best(chunks: np.ndarray) -> np.ndarray:
        q = np.quantile(chunks, quantile, axis=0)
        low = np.clip(np.floor(q / align) * align, align, top)
        high = np.clip(np.ceil(q / align) * align, align, top)
        cost = [np.maximum(c - chunks, 0).sum(0) + overflow_cost * np.maximum(chunks - c, 0).sum(0)
                for c in (low, high)]
        return np.where(cost[0] <= cost[1], low, high)

    centred = loads - loads.mean(axis=0)  # first split: along the main direction routing varies in
    direction = np.linalg.svd(centred, full_matrices=False)[2][0] if len(loads) > 1 else np.zeros(loads.shape[1])
    along = centred @ direction
    member = np.digitize(along, np.quantile(along, np.linspace(0, 1, count + 1)[1:-1])) if count > 1 else \
        np.zeros(len(loads), dtype=int)
    for _ in range(20):
        shapes = np.unique(np.stack([best(loads[member == v]) for v in np.unique(member)]), axis=0)
        again = chosen_shapes(loads, shapes, overflow_cost)
        if len(shapes) == len(np.unique(member)) and np.array_equal(again, member):
            break
        member = again
    return shapes.astype(int)


def optimal_shapes(group_loads: list[np.ndarray], align: int, max_overflow: float,
                   count: int) -> tuple[list[np.ndarray], float]:
    """Each group's shapes (fit_shapes) and the overflow cost λ they were fitted at: the smallest λ (by
    bisection) whose expected overflow over the layer stays within ``max_overflow`` of routed slots,
    so the least padding the budget allows."""
    routed = sum(loads.sum(axis=1) for loads in group_loads)
    chunk_slots, budget = int(routed.max()), max_overflow * routed.mean()

    def fit(lam: float) -> tuple[list[np.ndarray], bool]:
        shapes = [fit_shapes(loads, align, lam, count, chunk_slots) for loads in group_loads]
        over = sum(shape_costs(loads, s)[1][np.arange(len(loads)), chosen_shapes(loads, s, lam)].mean()
                   for loads, s in zip(group_loads, shapes))
        return shapes, over <= budget + 1e-9

    low, high = -12.0, 12.0  # log2 λ: overflow only falls as λ grows
    best = fit(2.0**high)[0]
    for _ in range(24):
        mid = (low + high) / 2
        shapes, ok = fit(2.0**mid)
        if ok:
            best, high = shapes, mid
        else:
            low = mid
    return best, 2.0**high


# -- groups and residency --------------------------------------------------------------------------
def expert_bytes(spec: ModelSpec, layer: int, bytes_per_weight: float = 2.0) -> int:
    shapes = mlp_shapes("e", spec.layers[layer].ffn.expert, spec.hidden_size)
    return int(sum(math.prod(s) for s in shapes.values()) * bytes_per_weight)


def make_groups(order: list[int], per_expert_bytes: int, caps: Capabilities) -> list[list[int]]:
    """Cut popularity-ordered experts into graphs under the target's max graph bytes."""
    if per_expert_bytes > caps.max_graph_bytes:
        raise InputError(
            f"one expert needs {per_expert_bytes / 1e9:.2f} GB but a {caps.name} graph may hold "
            f"{caps.max_graph_bytes / 1e9:.2f} GB; this model cannot be planned for {caps.name} without "
            "lower-bit weights."
        )
    size = max(1, min(MAX_GROUP_EXPERTS, caps.max_graph_bytes // per_expert_bytes))
    n_groups = math.ceil(len(order) / size)
    bounds = np.linspace(0, len(order), n_groups + 1).round().astype(int)
    return [order[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def graph_hit(hit: np.ndarray, top_k: int) -> float:
    """P(a decode token routes to any of the experts whose own probabilities are ``hit``), its top_k picks taken
    as independent draws from hit / top_k: an estimate, close for rarely hit graphs, a little low for busy ones,
    and 1 for a graph of every expert."""
    return 1.0 - (1.0 - min(1.0, float(hit.sum()) / top_k)) ** top_k


def decode_graph_experts(hit: np.ndarray, top_k: int, per_expert_bytes: int, caps: Capabilities) -> int:
    """Experts per decode graph for a group whose experts (in order) a decode token hits with probabilities
    ``hit``: the size with the least expected time per token. A launch reads its whole graph's weights, so one
    graph per group reads the group for the one or two experts a token hit, and a graph per expert pays a launch
    for each hit."""
    def seconds(size: int) -> float:
        return sum(graph_hit(p, top_k) * (caps.dispatch_seconds + len(p) * per_expert_bytes /
                                          caps.weight_bytes_per_second) for p in cut(hit, size))

    sizes = sorted({len(hit)} | {1 << b for b in range(len(hit).bit_length()) if 1 << b < len(hit)}, reverse=True)
    return min(sizes, key=seconds)  # (the largest of equals: fewer graphs to build)


def decode_sized(members: list[list[int]], hit: np.ndarray, top_k: int, per_expert_bytes: int, caps: Capabilities,
                 cap: int) -> list[list[int]]:
    """The groups cut as their decode graphs would be (the cost model's size, widened to at most ``cap`` a layer):
    where decode launches the prefill groups, a group is what one decode launch reads."""
    groups = []
    for m in members:
        size = decode_graph_experts(hit[m], top_k, per_expert_bytes, caps)
        groups.append(GroupPlan(m, [[1] * len(m)], "npu", 0.0, 0, 0 if size == len(m) else size))
    cap_decode_graphs(groups, cap)
    return [part for g in groups for part in g.decode_parts()]


def cap_decode_graphs(groups: list[GroupPlan], cap: int) -> None:
    """Widen the decode graphs of the groups cut into the most until the layer has at most ``cap`` of them (or
    every group is one graph): each step doubles one group's experts per graph, as the sizes the cost model chose
    among are powers of two."""
    def parts(g: GroupPlan) -> int:
        return len(g.decode_parts()) if g.shapes else 0

    while sum(map(parts, groups)) > cap:
        widest = max(groups, key=parts)
        if parts(widest) <= 1:
            return
        wider = 2 * widest.decode_experts
        widest.decode_experts = 0 if wider >= len(widest.experts) else wider


def decode_figures(hit: np.ndarray, top_k: int, groups: list[GroupPlan], per_expert_bytes: int) -> dict[str, float]:
    """Expected per decode token for one layer: NPU launches, and weight bytes read — NPU graphs whole,
    CPU-resident experts only when hit."""
    launches = read = 0.0
    for g in groups:
        if not g.shapes:
            read += hit[g.experts].sum() * per_expert_bytes
            continue
        for part in g.decode_parts():
            launched = graph_hit(hit[part], top_k)
            launches += launched
            read += launched * len(part) * per_expert_bytes
    return {"decode_launches": float(launches), "decode_weight_mb": float(read / 1e6)}


def pays_for_npu(useful_tokens: float, slots: float, flops_per_token: float, caps: Capabilities,
                 cpu: Capabilities, experts: int) -> bool:
    """Is one NPU launch of the group faster than running its useful tokens on the CPU?"""
    npu = caps.dispatch_seconds + slots * flops_per_token / caps.flops_per_second
    host = experts * cpu.dispatch_seconds + useful_tokens * flops_per_token / cpu.flops_per_second
    return npu < host


def launch_figures(loads: np.ndarray, shapes: np.ndarray, overflow_cost: float) -> dict[str, np.ndarray]:
    """Per chunk (loads [C, G]), what launching each chunk's chosen shape gives: slots, useful tokens,
    overflow, and whether it launches at all (a chunk that routes nothing to the group does not)."""
    choice = chosen_shapes(loads, shapes, overflow_cost)
    slots = shapes.sum(axis=1)[choice]
    fill = np.minimum(loads, shapes[choice]).sum(axis=1)
    return {"slots": slots, "fill": fill, "overflow": loads.sum(axis=1) - fill, "launched": fill > 0}


def predict(loads: np.ndarray, groups: list[GroupPlan], overflow_cost: float) -> dict:
    """Expected per-chunk figures for one layer under spill: padding, overflow, launches, NPU share."""
    padded = overflow = npu_tokens = launches = npu_slots = 0.0
    for g in groups:
        if not g.shapes:
            continue
        f = launch_figures(loads[:, g.experts], np.asarray(g.shapes), overflow_cost)
        launches += f["launched"].mean()
        npu_slots += (f["launched"] * f["slots"]).mean()
        padded += ((f["slots"] - f["fill"]) * f["launched"]).mean()
        overflow += f["overflow"].mean()
        npu_tokens += f["fill"].mean()
    mean_routed = float(loads.sum(axis=1).mean())
    return {
        "padded_pct": 100 * padded / npu_slots if npu_slots else 0.0,
        "overflow_pct": 100 * overflow / mean_routed,
        "npu_share_pct": 100 * npu_tokens / mean_routed,
        "npu_launches": float(launches),
    }


@dataclass(frozen=True)
class DecodeCap:
    """Decode graphs per layer a target's devices allow, and where the figure comes from."""

    graphs: int
    source: str


def decode_graph_cap(target: str, moe_layers: int) -> DecodeCap:
    """At most this many decode graphs a layer: every MoE layer's, each costing its device's ``graph_overhead_mb``
    once loaded, within ``GRAPH_OVERHEAD_SHARE`` of what one app may hold on the tightest of the target's devices;
    ``DECODE_GRAPHS_PER_LAYER`` where no device records a per-graph overhead."""
    priced = [d for d in plugin(target).devices if d.ram_gb and d.graph_overhead_mb]
    if not priced or moe_layers < 1:
        return DecodeCap(DECODE_GRAPHS_PER_LAYER, f"npumoe's fixed {DECODE_GRAPHS_PER_LAYER}: no {target} device "
                                                  "records a per-graph overhead")

    def allowed(d: Device) -> float:
        return GRAPH_OVERHEAD_SHARE * d.ram_gb * d.app_share * 1e3 / (d.graph_overhead_mb * moe_layers)

    tightest = min(priced, key=allowed)
    return DecodeCap(max(1, int(allowed(tightest))),
                     f"{GRAPH_OVERHEAD_SHARE:.0%} of the {tightest.ram_gb * tightest.app_share:.1f} GB an app may "
                     f"hold on the {tightest.name} ({tightest.source('app_share')}), over {moe_layers} MoE layers at "
                     f"{tightest.graph_overhead_mb:g} MB a loaded graph ({tightest.source('graph_overhead_mb')})")


def plan(model, profile: RoutingProfile, target: str = "htp", overflow: str = "spill", residency: str = "auto",
         method: str = "optimal", max_overflow: float = 0.10, graphs_per_layer: int = GRAPHS_PER_LAYER,
         decode_graphs_per_layer: int | None = None) -> Plan:
    """Make a Plan for ``model`` on ``target`` from a calibration ``profile``.

    ``max_overflow`` and ``graphs_per_layer`` steer the optimiser: a larger spill budget, or more compiled
    shapes for the runtime to choose from (the layer's groups share them), buy less padding.
    ``decode_graphs_per_layer`` caps a layer's decode graphs (a layer with more NPU groups keeps one each); None:
    what the target's devices allow (:func:`decode_graph_cap`)."""
    spec: ModelSpec = model.spec
    for name, value, allowed in (("overflow", overflow, OVERFLOW_POLICIES), ("residency", residency, RESIDENCY),
                                 ("method", method, METHODS)):
        if value not in allowed:
            raise InputError(f"{name} {value!r} is not one of {', '.join(allowed)}.")
    if decode_graphs_per_layer is None:
        decode_graphs_per_layer = decode_graph_cap(target, len(spec.moe_layers)).graphs
    if decode_graphs_per_layer < 1:
        raise InputError(f"decode graphs per layer must be at least 1, not {decode_graphs_per_layer}.")
    profile.check_model(model)
    caps, cpu = capabilities(target), capabilities("cpu")
    once = plugin(target).one_graph_per_weights  # a shape per group, decoded on: each weight in one graph
    cpu_graphs = unsupported_graphs(spec, profile.chunk, target)
    layers: dict[int, LayerPlan] = {}
    for i in spec.moe_layers:
        loads = profile.loads[i]
        per_expert = expert_bytes(spec, i)
        members = make_groups([int(e) for e in profile.popularity(i)], per_expert, caps)
        hit = loads.sum(axis=0) / max(loads.sum() / profile.top_k[i], 1)  # per expert: P(a token routes to it)
        if once:
            members = decode_sized(members, hit, profile.top_k[i], per_expert, caps, decode_graphs_per_layer)
        if method == "optimal":
            shapes, lam = optimal_shapes([loads[:, g] for g in members], caps.alignment, max_overflow,
                                         1 if once else max(1, graphs_per_layer // len(members)))
        else:
            tiers, tier_of = paper_tiers(loads, caps.alignment, uniform=method == "uniform")
            shapes, lam = [np.asarray([[tiers[tier_of[e]] for e in g]]) for g in members], 1.0
        flops = 2 * per_expert / 2  # per token: a multiply-add per weight; per_expert counts 2-byte weights
        groups = []
        for experts, group_shapes in zip(members, shapes):
            f = launch_figures(loads[:, experts], group_shapes, lam)
            useful = float(f["fill"].mean())
            on_npu = f"L{i}.experts" not in cpu_graphs and (residency == "npu" or (
                residency == "auto" and pays_for_npu(useful, float(f["slots"].mean()), flops, caps, cpu, len(experts))))
            decode = decode_graph_experts(hit[experts], profile.top_k[i], per_expert, caps) if on_npu and not once \
                else 0
            groups.append(GroupPlan(experts, group_shapes.tolist() if on_npu else [], "npu" if on_npu else "cpu",
                                    useful, per_expert * len(experts), 0 if decode == len(experts) else decode))
        cap_decode_graphs(groups, decode_graphs_per_layer)
        predicted = predict(loads, groups, lam) | decode_figures(hit, profile.top_k[i], groups, per_expert)
        layers[i] = LayerPlan(groups, predicted, lam)
    totals = {k: float(np.mean([lp.predicted[k] for lp in layers.values()]))
              for k in next(iter(layers.values())).predicted}
    return Plan(
        model=spec.fingerprint(),
        model_name=model.name,
        target=target,
        chunk=profile.chunk,
        overflow=overflow,
        residency=residency,
        method=method,
        dense_placement="cpu" if target == "cpu" else "npu",
        layers=layers,
        predicted=totals,
        alignment=caps.alignment,
        weights=model.weights_fingerprint(),
        cpu_graphs=cpu_graphs,
        decode="prefill" if once else "own",
    )


def unsupported_graphs(spec: ModelSpec, chunk: int, target: str) -> dict[str, str]:
    """Every graph of the program ``target``'s backend cannot take, with the reason: dense graphs by name,
    and each MoE layer's expert graphs as one (they share their ops and their size per expert)."""
    record = plugin(target)
    shapes = expected_shapes(spec) | {"lm_head.weight": (spec.vocab_size, spec.hidden_size)}  # tied or not

    def why_not(graph) -> str | None:
        weight_bytes = 2 * sum(math.prod(shapes[name]) for name in graph.weight_names())
        return record.supports(graph, weight_bytes)

    program = build_program(spec, chunk=chunk, max_context=1)  # shapes beyond ops and weights do not matter
    found = {name: reason for name, g in program.graphs.items() if g.kind != "experts" and (reason := why_not(g))}
    for i in spec.moe_layers:
        one = experts_graph(spec, i, (0,), (record.caps.alignment,), f"L{i}.experts")
        if reason := why_not(one):
            found[one.name] = reason
    return found
