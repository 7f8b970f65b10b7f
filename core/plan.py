"""The planner: static capacity tiers, expert groups and residency from a RoutingProfile.

Driven only by the profile (per-chunk expert loads at chunk size B) and the target's
:class:`~npumoe.core.backend.Capabilities`.

Capacities. For expert e at capacity C, over calibration chunks c with load n_ce:
padding(C) = E[max(0, C − n_ce)] and overflow(C) = E[max(0, n_ce − C)]. Three methods:

* ``uniform`` — NPUMoE's single capacity: every expert gets C = r_l·B·k/E.
* ``paper`` — NPUMoE's tiers: C_base = B·k/E (the mean load; the paper writes B/E with B
  counting routed slots), n_max = r_l·C_base, tiers {n_max, midpoint, C_base}, each expert
  in the smallest tier at or above its mean load.
* ``optimal`` (default) — choose ≤ 3 tier values and expert→tier to minimise
  Σ_e padding + λ·overflow, with λ raised until expected overflow is within
  ``max_overflow`` of routed slots.

Groups: the experts of one tier, ordered by popularity, cut into graphs of at most G
experts (G bounded by the target's max graph bytes), so hot and cold experts never share
a graph. Residency: a group runs on the NPU when its expected useful tokens per launch pay
for the dispatch cost (``auto``), always (``npu``) or never (``cpu``).
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from npumoe.core.backend import Capabilities, capabilities, plugin
from npumoe.core.calibrate import RoutingProfile, imbalance
from npumoe.core.identity import check_weights
from npumoe.core.io import atomic_write_text, read_json_artifact
from npumoe.core.outputs import OutputKind, claim, json_kind
from npumoe.core.graphs import experts_graph
from npumoe.core.program import ExpertGroup, build_program
from npumoe.core.spec import ModelSpec
from npumoe.core.weights import expected_shapes, mlp_shapes
from npumoe.errors import ArtifactError, InputError

METHODS = ("optimal", "paper", "uniform")
OVERFLOW_POLICIES = ("spill", "drop", "reroute")
RESIDENCY = ("auto", "npu", "cpu")
MAX_TIERS = 3
MAX_GROUP_EXPERTS = 16
KIND = "npumoe.Plan"
PLAN = OutputKind("a plan (npumoe plan)", directory=False, recognise=json_kind(KIND))


@dataclass
class GroupPlan:
    experts: list[int]
    capacity: int  # per expert; 0 = CPU-resident, runs on exactly its tokens
    residency: str  # "npu" | "cpu"
    expected_tokens: float  # useful token-slots per chunk
    weight_bytes: int


@dataclass
class LayerPlan:
    tiers: list[int]
    expert_tier: list[int]  # tier index per expert
    groups: list[GroupPlan]
    predicted: dict = field(default_factory=dict)


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
    weights: str | None = None  # weights fingerprint (npumoe.core.identity); None in plans made before it
    # graphs the target cannot take → why (its declared ops and sizes); they run on the CPU. A layer
    # whose expert graphs it cannot take is keyed "L{i}.experts" (its groups are then CPU-resident).
    cpu_graphs: dict[str, str] = field(default_factory=dict)

    # -- what the program builder asks ---------------------------------------------------------
    def groups(self, layer: int, seq: int) -> list[ExpertGroup]:
        """Static groups for prefill chunks; the same groups at the smallest aligned capacity
        for single-token decode (each expert sees at most one token per step)."""
        out = []
        for j, g in enumerate(self.layers[layer].groups):
            cap = g.capacity if seq == self.chunk else (self.alignment if g.capacity else 0)
            name = f"L{layer}.experts.g{j}.c{cap}" if cap else f"L{layer}.cpu.g{j}"
            out.append(ExpertGroup(name, tuple(g.experts), cap))
        return out

    def place(self, graphs: dict) -> None:
        npu_groups = {
            grp.graph for i, lp in self.layers.items() for s in {self.chunk, 1}
            for grp, g in zip(self.groups(i, s), lp.groups) if g.residency == "npu"
        }
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

        if self.chunk < 1 or self.alignment < 1:
            bad(f"chunk {self.chunk} and alignment {self.alignment} must be ≥ 1")
        for name, value, allowed in (("overflow", self.overflow, OVERFLOW_POLICIES),
                                     ("dense_placement", self.dense_placement, ("cpu", "npu"))):
            if value not in allowed:
                bad(f"its {name} is {value!r}, not one of {', '.join(allowed)}")
        if sorted(self.layers) != sorted(spec.moe_layers):
            bad(f"it plans layers {sorted(self.layers)}, but the model's MoE layers are {list(spec.moe_layers)}")
        for i, lp in self.layers.items():
            experts = sorted(e for g in lp.groups for e in g.experts)
            if experts != list(range(spec.layers[i].ffn.num_experts)):
                bad(f"layer {i}'s groups do not hold each of its {spec.layers[i].ffn.num_experts} experts once")
            for g in lp.groups:
                if g.capacity < 0 or g.residency not in ("npu", "cpu") or (g.residency == "npu") != (g.capacity > 0):
                    bad(f"layer {i} has a group of capacity {g.capacity} with residency {g.residency!r}")

    # -- files -----------------------------------------------------------------------------------
    def to_json(self) -> dict:
        data = asdict(self)
        data["layers"] = {str(i): v for i, v in data["layers"].items()}
        return {"kind": KIND, **data}

    def save(self, path: str | Path) -> Path:
        return atomic_write_text(claim(path, PLAN), json.dumps(self.to_json(), indent=1))

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
            _check_fields(LayerPlan, lp, f"{where}'s layer {i}")
            for j, g in enumerate(lp["groups"]):
                _check_fields(GroupPlan, g, f"{where}'s layer {i} group {j}")
            layers[int(i)] = LayerPlan(lp["tiers"], lp["expert_tier"], [GroupPlan(**g) for g in lp["groups"]],
                                       lp.get("predicted", {}))
        return cls(layers=layers, **data)


_JSON_TYPES = {"str": str, "int": int, "float": (int, float), "dict": dict, "list[int]": list, "list[GroupPlan]": list,
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
        value, kind = data[f.name], _JSON_TYPES[f.type]
        whole = f.type == "int" or f.type == "list[int]"
        items = value if f.type == "list[int]" and isinstance(value, list) else [value]
        if (not isinstance(value, kind) or isinstance(value, bool)
                or (whole and not all(isinstance(x, int) and not isinstance(x, bool) for x in items))):
            raise ArtifactError(f"{where} is damaged: its {f.name!r} is {value!r:.60}, not a {f.type}; make a new "
                                "one with npumoe plan.")
    unknown = sorted(set(data) - {f.name for f in fields(cls)})
    if unknown:
        raise ArtifactError(f"{where} is damaged: it has an unknown field {unknown[0]!r}; make a new one with "
                            "npumoe plan.")


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


def optimal_tiers(loads: np.ndarray, align: int, max_overflow: float, max_tiers: int = MAX_TIERS,
                  overflow_cost: float = 1.0) -> tuple[list[int], list[int]]:
    """Tier values and expert→tier minimising padding + λ·overflow within an overflow budget."""
    chunk_slots = int(loads.sum(axis=1).max())
    top = _aligned(loads.max(), align, chunk_slots)
    candidates = np.arange(align, top + 1, align)
    pad, over = expected_padding(loads, candidates), expected_overflow(loads, candidates)
    routed = loads.sum(axis=1).mean()
    lam = overflow_cost
    for _ in range(40):
        cost = pad + lam * over  # [E, K]
        tiers_idx = _best_tier_set(cost, max_tiers)
        choice = np.asarray(tiers_idx)[np.argmin(cost[:, tiers_idx], axis=1)]
        if over[np.arange(len(choice)), choice].sum() <= max_overflow * routed:
            break
        lam *= 1.5
    tiers = sorted({int(candidates[i]) for i in choice}, reverse=True)
    return tiers, [tiers.index(int(candidates[i])) for i in choice]


def _best_tier_set(cost: np.ndarray, max_tiers: int) -> list[int]:
    """Indices of ≤ max_tiers candidate capacities minimising Σ_e min over the set.

    Exhaustive over a shortlist (each expert's own best capacity and its neighbours), then
    coordinate descent over all candidates: exact for small E, near-exact beyond."""
    best_each = np.unique(np.argmin(cost, axis=1))
    if max_tiers >= len(best_each):  # every expert at its own best: optimal, and no search (--max-tiers 1e10)
        return sorted(int(i) for i in best_each)
    shortlist = np.unique(np.clip(np.concatenate([best_each - 1, best_each, best_each + 1]), 0, cost.shape[1] - 1))
    if len(shortlist) > 24:
        shortlist = shortlist[np.linspace(0, len(shortlist) - 1, 24).round().astype(int)]
    best, best_total = None, np.inf
    for n in range(1, max_tiers + 1):
        for combo in itertools.combinations(shortlist, n):
            total = cost[:, combo].min(axis=1).sum()
            if total < best_total:
                best, best_total = list(combo), total
    improved = True
    while improved:
        improved = False
        for t in range(len(best)):
            others = best[:t] + best[t + 1:]
            rest = cost[:, others].min(axis=1) if others else np.full(cost.shape[0], np.inf)
            totals = np.minimum(rest[:, None], cost).sum(axis=0)
            k = int(np.argmin(totals))
            if totals[k] < best_total - 1e-9:
                best[t], best_total, improved = k, totals[k], True
    return sorted(set(best))


# -- groups and residency --------------------------------------------------------------------------
def expert_bytes(spec: ModelSpec, layer: int, bytes_per_weight: float = 2.0) -> int:
    shapes = mlp_shapes("e", spec.layers[layer].ffn.expert, spec.hidden_size)
    return int(sum(math.prod(s) for s in shapes.values()) * bytes_per_weight)


def make_groups(order: list[int], per_expert_bytes: int, caps: Capabilities) -> list[list[int]]:
    """Cut a popularity-ordered tier into graphs under the target's max graph bytes."""
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


def pays_for_npu(useful_tokens: float, slots: int, flops_per_token: float, caps: Capabilities,
                 cpu: Capabilities, experts: int) -> bool:
    """Is one NPU launch of the group faster than running its useful tokens on the CPU?"""
    npu = caps.dispatch_seconds + slots * flops_per_token / caps.flops_per_second
    host = experts * cpu.dispatch_seconds + useful_tokens * flops_per_token / cpu.flops_per_second
    return npu < host


def predict(loads: np.ndarray, groups: list[GroupPlan]) -> dict:
    """Expected per-chunk figures for one layer under spill: padding, overflow, launches, NPU share."""
    routed = loads.sum(axis=1)
    padded = overflow = npu_tokens = launches = npu_slots = 0.0
    for g in groups:
        sub = loads[:, g.experts]
        if g.residency != "npu":
            continue
        fill = np.minimum(sub, g.capacity).sum(axis=1)
        launched = fill > 0
        launches += launched.mean()
        npu_slots += (launched * len(g.experts) * g.capacity).mean()
        padded += ((len(g.experts) * g.capacity - fill) * launched).mean()
        overflow += np.maximum(sub - g.capacity, 0).sum(axis=1).mean()
        npu_tokens += fill.mean()
    mean_routed = float(routed.mean())
    return {
        "padded_pct": 100 * padded / npu_slots if npu_slots else 0.0,
        "overflow_pct": 100 * overflow / mean_routed,
        "npu_share_pct": 100 * npu_tokens / mean_routed,
        "npu_launches": float(launches),
    }


def plan(model, profile: RoutingProfile, target: str = "htp", overflow: str = "spill", residency: str = "auto",
         method: str = "optimal", max_overflow: float = 0.10, max_tiers: int = MAX_TIERS) -> Plan:
    """Make a Plan for ``model`` on ``target`` from a calibration ``profile``.

    ``max_overflow`` and ``max_tiers`` steer the optimiser: a larger spill budget or more
    distinct capacities (each one more graph per layer) buy less padding."""
    spec: ModelSpec = model.spec
    for name, value, allowed in (("overflow", overflow, OVERFLOW_POLICIES), ("residency", residency, RESIDENCY),
                                 ("method", method, METHODS)):
        if value not in allowed:
            raise InputError(f"{name} {value!r} is not one of {', '.join(allowed)}.")
    profile.check_model(model)
    caps, cpu = capabilities(target), capabilities("cpu")
    cpu_graphs = unsupported_graphs(spec, profile.chunk, target)
    layers: dict[int, LayerPlan] = {}
    for i in spec.moe_layers:
        loads = profile.loads[i]
        if method == "optimal":
            tiers, tier_of = optimal_tiers(loads, caps.alignment, max_overflow, max_tiers)
        else:
            tiers, tier_of = paper_tiers(loads, caps.alignment, uniform=method == "uniform")
        popularity = [int(e) for e in profile.popularity(i)]
        per_expert = expert_bytes(spec, i)
        flops_per_token = 2 * per_expert / 2  # a multiply-add per weight; per_expert counts 2-byte weights
        groups = []
        for t, cap in enumerate(tiers):
            members = [e for e in popularity if tier_of[e] == t]
            for experts in make_groups(members, per_expert, caps) if members else []:
                useful = float(np.minimum(loads[:, experts], cap).sum(axis=1).mean())
                on_npu = f"L{i}.experts" not in cpu_graphs and (residency == "npu" or (
                    residency == "auto" and pays_for_npu(useful, len(experts) * cap, flops_per_token, caps, cpu,
                                                         len(experts))
                ))
                groups.append(GroupPlan(experts, cap if on_npu else 0, "npu" if on_npu else "cpu", useful,
                                        per_expert * len(experts)))
        layers[i] = LayerPlan(tiers, tier_of, groups, predict(loads, groups))
    totals = {k: float(np.mean([lp.predicted[k] for lp in layers.values()])) for k in next(iter(layers.values())).predicted}
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
        one = experts_graph(spec, i, (0,), record.caps.alignment, f"L{i}.experts")
        if reason := why_not(one):
            found[one.name] = reason
    return found
