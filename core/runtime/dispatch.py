"""Dispatch routed tokens into static, zero-padded group buffers, and combine the results.

All index arithmetic is vectorised: a stable sort by expert gives every (token, expert)
pair its rank within the expert; rank < capacity lands at a fixed row of one preallocated
buffer that concatenates every static group's [G·C, H] slice; the rest overflow.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from npumoe.core.program import ExpertGroup


@dataclass
class Layout:
    """Where each expert's slots live in the concatenated buffer of a layer's static groups."""

    groups: list[ExpertGroup]
    row_base: torch.Tensor  # [E] first row of expert e's slice (0 where it has none)
    capacity: torch.Tensor  # [E] static slots of expert e (0: not in a static group)
    group_offsets: list[int]
    rows: int

    @classmethod
    def of(cls, groups: list[ExpertGroup], num_experts: int) -> Layout:
        row_base = torch.zeros(num_experts, dtype=torch.long)
        capacity = torch.zeros(num_experts, dtype=torch.long)
        offsets, rows = [], 0
        for grp in groups:
            offsets.append(rows)
            for g, e in enumerate(grp.experts):
                row_base[e] = rows + g * grp.capacity
                capacity[e] = grp.capacity
            rows += len(grp.experts) * grp.capacity
        return cls(groups, row_base, capacity, offsets, rows)


@dataclass
class Dispatch:
    """One chunk's routed (token, expert) pairs and where each one runs."""

    token: torch.Tensor  # [P] token row of each pair
    expert: torch.Tensor  # [P]
    weight: torch.Tensor  # [P] combine weight
    row: torch.Tensor  # [P] static buffer row, meaningful where ``fits``
    fits: torch.Tensor  # [P] bool: has a static slot
    compact: torch.Tensor  # [P] bool: its expert is CPU-resident (never a static slot)

    @property
    def overflow_static(self) -> torch.Tensor:
        """Pairs that wanted a static slot and found none."""
        return ~self.fits & ~self.compact

    def renormalise(self, keep: torch.Tensor, target: torch.Tensor) -> None:
        """Rescale the kept pairs' weights so each token's sum equals ``target[token]``."""
        tokens = int(target.numel())
        kept_sum = torch.zeros(tokens).index_add_(0, self.token[keep], self.weight[keep])
        scale = torch.where(kept_sum > 0, target / kept_sum.clamp_min(1e-30), torch.ones_like(target))
        self.weight = torch.where(keep, self.weight * scale[self.token], self.weight)


def assign(experts: torch.Tensor, weights: torch.Tensor, layout: Layout,
           order_key: torch.Tensor | None = None, skip: torch.Tensor | None = None) -> Dispatch:
    """Rank each (token, expert) pair within its expert; a rank below capacity gets a row.

    ``order_key`` [S] decides who gets an expert's slots first (higher first; default:
    sequence order). ``skip`` [E] marks CPU-resident experts, which get no static slots.
    """
    tokens, k = experts.shape
    token = torch.arange(tokens).repeat_interleave(k)
    expert, weight = experts.reshape(-1), weights.reshape(-1).float()
    priority = torch.arange(tokens) if order_key is None else torch.argsort(
        torch.argsort(order_key, descending=True, stable=True), stable=True
    )
    order = torch.argsort(expert * tokens + priority[token], stable=True)
    counts = torch.bincount(expert, minlength=layout.capacity.numel())
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(expert)
    rank[order] = torch.arange(expert.numel()) - starts[expert[order]]
    compact = skip[expert] if skip is not None else torch.zeros_like(expert, dtype=torch.bool)
    fits = (rank < layout.capacity[expert]) & ~compact
    row = torch.where(fits, layout.row_base[expert] + rank, torch.zeros_like(rank))
    return Dispatch(token, expert, weight, row, fits, compact)


def gather(z: torch.Tensor, d: Dispatch, buffer: torch.Tensor) -> torch.Tensor:
    """Copy routed tokens into their rows of the (already zeroed) static buffer [rows, H]."""
    buffer[d.row[d.fits]] = z[d.token[d.fits]]
    return buffer


def combine(y: torch.Tensor, d: Dispatch, tokens: int) -> torch.Tensor:
    """Weighted scatter-add of the static groups' outputs back to token rows."""
    out = y.new_zeros(tokens, y.shape[1])
    out.index_add_(0, d.token[d.fits], y[d.row[d.fits]] * d.weight[d.fits, None].to(y.dtype))
    return out
