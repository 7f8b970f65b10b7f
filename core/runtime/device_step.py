"""A whole decode step run by a backend on its device, for targets whose graphs can be composed lazily there (mlx).

The engine's layer-by-layer step reads every graph's outputs back to the host: routing, dispatch, combine and
residuals run in torch, and the KV cache is an input of each attention graph. A device that builds work lazily
(MLX) then evaluates once a graph and copies the cache in every token. Where every graph of a decode step runs on
executors of one type that offers ``decode_step(request) -> DeviceStep | None``, the engine hands it the step
instead: embedding row in, logits out, the cache kept on the device between tokens. The host cache
(:class:`~npumoe.core.runtime.kvcache.KVCache`) stays the reference: the step loads it once after the host has
written it (a prefill, a hand-over) and writes its slots back before the host path reads it again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from npumoe.core.compiler.program import Program
from npumoe.core.ir.backend import Executor


@dataclass(frozen=True)
class StepRequest:
    """What a backend needs to run a decode step by itself: the program and the decode graphs' executors, each rope
    table (cos, sin over every position, per layer), each MoE layer's router (``routers[layer]``: its RouterSpec,
    weight, bias, correction bias; None for the last two where it has none), and the other graphs' executors, with
    which the step may share its weights."""

    program: Program
    executors: Mapping[str, Executor]
    rope: list[tuple[torch.Tensor, torch.Tensor]]
    routers: dict[int, tuple]
    others: Mapping[str, Executor]


class DeviceStep(Protocol):
    def __call__(self, x: torch.Tensor, start: int) -> tuple[torch.Tensor, list[list[int]]]:
        """The embedded token x [1, H] at position ``start`` (its keys and values written at that slot on the
        device) → logits [1, vocab] fp32 and the experts each MoE layer routed it to."""

    def load(self, k: list[torch.Tensor], v: list[torch.Tensor], length: int) -> None:
        """Take the host cache's first ``length`` slots of every layer."""

    def write_back(self, k: list[torch.Tensor], v: list[torch.Tensor], length: int) -> None:
        """Write its first ``length`` slots of every layer into the host cache."""


def decode_graphs(program: Program) -> list[str] | None:
    """Every graph a decode token runs, or None where a decode step runs experts on the host (CPU-resident
    groups)."""
    names = []
    for step in program.layers:
        names.append(step.attention[1])
        if step.moe is None:
            names.append(step.dense[1])
            continue
        for group in step.moe.groups[1]:
            if not group.shapes:
                return None
            names += [shape.graph for shape in group.shapes]
        if step.moe.shared:
            names.append(step.moe.shared[1])
    return names + [program.lm_head[1]]
