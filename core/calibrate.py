"""Calibration: how a model's experts are really used, measured by running it.

Issue "Calibration, capacity tiers…" grows this into the RoutingProfile; the recorder is
the one piece the demo needs already.
"""

from __future__ import annotations

import numpy as np
import torch

from npumoe.core.spec import ModelSpec


class LoadRecorder:
    """An ``Engine(on_route=...)`` observer: tokens per expert, per MoE layer, per routing call."""

    def __init__(self, spec: ModelSpec):
        self.num_experts = {i: spec.layers[i].ffn.num_experts for i in spec.moe_layers}
        self.loads: dict[int, list[np.ndarray]] = {i: [] for i in spec.moe_layers}

    def __call__(self, layer: int, experts: torch.Tensor, weights: torch.Tensor, attn_out: torch.Tensor) -> None:
        counts = torch.bincount(experts.reshape(-1), minlength=self.num_experts[layer])
        self.loads[layer].append(counts.numpy())

    def matrix(self, layer: int) -> np.ndarray:
        """[calls, experts] token counts."""
        return np.stack(self.loads[layer]) if self.loads[layer] else np.zeros((0, self.num_experts[layer]), int)


def imbalance(loads: np.ndarray) -> float:
    """Mean over chunks of max/mean expert load (NPUMoE's r_l); 1.0 is perfectly balanced."""
    busy = loads[loads.sum(axis=1) > 0]
    if busy.size == 0:
        return float("nan")
    return float(np.mean(busy.max(axis=1) / busy.mean(axis=1)))
