"""Which graphs share a Core ML package: weights stored once, no package over the size limit.

Graphs that read any weight in common (a layer's attention at prefill and decode length, an
expert group's prefill graph and the decode graphs cut from its experts) are one *unit*: they
must share a package or those weights are stored twice. Units of one kind are then packed in order:

* attention: all layers' units, split into contiguous shards; each shard's K and V caches
  are its two states (:class:`~npumoe.backends.apple_ane.kvstate.KVState`);
* expert groups, dense / shared FFNs: one package per layer and kind;
* LM head: one package.

A unit larger than the package limit cannot be built: the plan must change.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from npumoe.backends.apple_ane.compress import precision_for, scheme
from npumoe.backends.apple_ane.kvstate import KVState
from npumoe.backends.apple_ane.rules import MAX_PACKAGE_BYTES
from npumoe.core.base.errors import InputError
from npumoe.core.ir.graph import Graph
from npumoe.core.ir.weights import weight_shape


@dataclass
class PackagePlan:
    name: str
    kind: str  # the graphs' kind: "attention", "experts", "ffn" or "lm_head"
    graphs: list[Graph]
    weight_bytes: int  # estimated as stored
    kv: KVState | None = None


def function_name(graph: Graph) -> str:
    """A MIL function name (an identifier) for a graph name such as ``L0.experts.g1.c16``."""
    return re.sub(r"\W", "_", graph.name)


def _kind_key(g: Graph) -> str:
    return "attention" if g.kind == "attention" else "lm_head" if g.layer is None else f"L{g.layer}_{g.kind}"


def _units(graphs: list[Graph]) -> list[tuple[set[str], list[Graph]]]:
    """(weight names, graphs) of each set of graphs joined by shared weights, in the order of their first graph."""
    units: list[tuple[set[str], list[Graph]]] = []
    for g in graphs:
        names = set(g.weight_names())
        joined = [u for u in units if u[0] & names]
        units = [u for u in units if all(u is not j for j in joined)]
        units.append((names.union(*(u[0] for u in joined)), [x for u in joined for x in u[1]] + [g]))
    order = {id(g): i for i, g in enumerate(graphs)}
    return sorted(((names, sorted(unit, key=lambda g: order[id(g)])) for names, unit in units),
                  key=lambda u: order[id(u[1][0])])


def plan_packages(graphs: list[Graph], weights: Mapping, precision: str, platform: str) -> list[PackagePlan]:
    limit = MAX_PACKAGE_BYTES[platform]
    by_kind: dict[str, list[Graph]] = {}
    for g in graphs:
        by_kind.setdefault(_kind_key(g), []).append(g)
    packages = []
    for key, members in by_kind.items():
        shards: list[tuple[list[Graph], int]] = []
        bits = scheme(precision_for(members[0].kind, precision)).bits
        for names, unit in _units(members):
            size = math.ceil(sum(math.prod(weight_shape(weights, n)) for n in names) * bits / 8)
            if size > limit:
                raise InputError(
                    f"graph {unit[0].name} needs {size / 1e9:.2f} GB of weights but an ANE package may hold "
                    f"{limit / 1e9:g} GB on {platform}; re-plan with smaller groups or build with --precision int4."
                )
            if not shards or shards[-1][1] + size > limit:
                shards.append(([], 0))
            shards[-1] = (shards[-1][0] + unit, shards[-1][1] + size)
        for k, (shard, size) in enumerate(shards):
            name = key if len(shards) == 1 else f"{key}_{k}"
            kv = KVState.for_graphs(shard) if key == "attention" else None
            packages.append(PackagePlan(name, members[0].kind, shard, size, kv))
    return packages
