"""The router: host-side, fp32, every scoring rule the supported families use.

Top-k, group masks and comparisons are exactly the ops NPUs reject (NPUMoE §3), so they
run here; the NPU only ever sees dense expert groups.
"""

from __future__ import annotations

import torch

from npumoe.core.ir.spec import RouterSpec


def _group_limited(choice: torch.Tensor, spec: RouterSpec) -> torch.Tensor:
    """Rule out (-inf) every expert outside the ``topk_group`` best groups (DeepSeek-V3).
    Not zero: with a correction bias, in-group choices can be negative."""
    tokens, experts = choice.shape
    grouped = choice.view(tokens, spec.n_group, experts // spec.n_group)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(spec.topk_group, dim=-1).indices, 1.0)
    return choice.masked_fill(~keep.bool().repeat_interleave(experts // spec.n_group, dim=1), float("-inf"))


def _sparsemixer(logits: torch.Tensor, top_k: int, jitter_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PhiMoE's inference-time sparsemixer: pick the argmax, softmax over logits within a
    relative threshold of it, repeat with the chosen experts masked out."""
    picks, weights = [], []
    masked = logits
    for _ in range(top_k):
        best, idx = masked.max(dim=-1, keepdim=True)
        factor = logits.abs().clamp(min=best)
        outside = (best - logits) / factor > 2 * jitter_eps
        gate = torch.softmax(masked.masked_fill(outside, float("-inf")), dim=-1)
        picks.append(idx)
        weights.append(gate.gather(-1, idx))
        masked = masked.scatter(-1, idx, float("-inf"))
    return torch.cat(picks, dim=-1), torch.cat(weights, dim=-1)


def route(z: torch.Tensor, spec: RouterSpec, weight: torch.Tensor, bias: torch.Tensor | None = None,
          correction: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """z[S, H] → (experts[S, k] int64, weights[S, k] fp32, router logits[S, E])."""
    logits = torch.nn.functional.linear(z.float(), weight.float(), None if bias is None else bias.float())
    k = spec.top_k
    if spec.scoring == "softmax":
        scores = torch.softmax(logits, dim=-1)
        top_w, top_i = scores.topk(k, dim=-1)
    elif spec.scoring == "sigmoid":
        scores = torch.sigmoid(logits)
        choice = scores + correction if correction is not None else scores
        if spec.n_group > 1:
            choice = _group_limited(choice, spec)
        top_i = choice.topk(k, dim=-1, sorted=False).indices
        top_w = scores.gather(1, top_i)
    elif spec.scoring == "softmax_topk":
        top_logits, top_i = logits.topk(k, dim=-1)
        top_w = torch.softmax(top_logits, dim=-1)
    elif spec.scoring == "sparsemixer":
        top_i, top_w = _sparsemixer(logits, k, spec.jitter_eps)
    else:
        raise ValueError(f"unknown router scoring {spec.scoring!r}")
    if spec.normalize:
        top_w = top_w / (top_w.sum(dim=-1, keepdim=True) + (1e-20 if spec.scoring == "sigmoid" else 0.0))
    if spec.routed_scaling != 1.0:
        top_w = top_w * spec.routed_scaling
    return top_i, top_w, logits


def all_scores(logits: torch.Tensor, spec: RouterSpec) -> torch.Tensor:
    """Every expert's score [S, E] on the scale the router's weights use (for rerouting)."""
    return torch.sigmoid(logits) if spec.scoring == "sigmoid" else torch.softmax(logits, dim=-1)
