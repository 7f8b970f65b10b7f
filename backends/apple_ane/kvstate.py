"""The KV cache of one attention package as two Core ML states.

One K and one V state per package, each [layers, heads, length, dim] over the package's
layers: per-layer states fail to compile once there are many of them, and states whose
dims (after the first) are not powers of two fail at run time (SqueezeBits, "Disaggregated
inference on Apple Silicon", 2025). So every dim after the first is padded to a power of
two, and length and head dim to at least 32; each layer uses the unpadded corner.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from npumoe.backends.apple_ane.rules import MIN_STATE_DIM
from npumoe.core.ir.graph import Graph, Role


def pow2_at_least(n: int, floor: int = 1) -> int:
    return max(floor, 1 << max(0, math.ceil(math.log2(n))))


@dataclass(frozen=True)
class KVState:
    layers: tuple[int, ...]
    shapes: dict[str, tuple[int, int, int, int]]  # cache input name ("k_cache", "v_cache") → padded state shape

    @classmethod
    def for_graphs(cls, graphs: list[Graph]) -> KVState:
        """The states covering every attention graph given (all their layers, all their sequence
        lengths). Prefill chunks start at multiples of the chunk below the capacity, so the
        length rounds the capacity up to a whole number of chunks."""
        layers = tuple(sorted({g.layer for g in graphs}))
        shapes = {}
        for name in graphs[0].inputs_with(Role.KV_CACHE):  # each cache input becomes a state of its name
            heads = max(g.inputs[name].shape[0] for g in graphs)
            length = max(-(-g.inputs[name].shape[1] // g.meta["seq"]) * g.meta["seq"] for g in graphs)
            dim = max(g.inputs[name].shape[2] for g in graphs)
            shapes[name] = (len(layers), pow2_at_least(heads), pow2_at_least(length, MIN_STATE_DIM),
                            pow2_at_least(dim, MIN_STATE_DIM))
        return cls(layers, shapes)

    def slot(self, layer: int) -> int:
        return self.layers.index(layer)

    def to_json(self) -> dict:
        return {"layers": list(self.layers), "shapes": {k: list(v) for k, v in self.shapes.items()}}
