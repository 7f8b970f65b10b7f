"""Dispatch routed tokens into static, zero-padded group buffers, and combine the results.

All index arithmetic is vectorised: a stable sort by expert gives every (token, expert)
pair its rank within the expert; rank < capacity lands at a fixed row of one preallocated
buffer that concatenates each launch's [Σ C, H] slice; the rest overflow.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from npumoe.core.compiler.program import ExpertGroup, StaticShape


@dataclass
class Layout:
    """Where each expert's slots live in the concatenated buffer of the launches: a static shape of each
    static group per chunk, or (buffered prefill) several launches of a group, an expert's slots then
    spread over them in launch order."""

    launches: list[tuple[ExpertGroup, StaticShape]]
    slot_rows: torch.Tensor  # [Σ capacity] buffer row of each slot, expert by expert
    slot_base: torch.Tensor  # [E] index of expert e's first slot in slot_rows
    capacity: torch.Tensor  # [E] static slots of expert e (0: not in a static group)
    offsets: list[int]  # first row of each launch
    rows: int

    @classmethod
    def of(cls, launches: list[tuple[ExpertGroup, StaticShape]], num_experts: int) -> Layout:
        slots: list[list[torch.Tensor]] = [[] for _ in range(num_experts)]
        offsets, rows = [], 0
        for group, shape in launches:
            offsets.append(rows)
            for e, cap in zip(group.experts, shape.capacities):
                slots[e].append(torch.arange(rows, rows + cap))
                rows += cap
        capacity = torch.tensor([sum(len(r) for r in s) for s in slots], dtype=torch.long)
        slot_rows = torch.cat([r for s in slots for r in s]) if rows else torch.zeros(0, dtype=torch.long)
        return cls(launches, slot_rows, torch.cumsum(capacity, 0) - capacity, capacity, offsets, rows)

    def row(self, expert: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
        """Buffer rows of expert[i]'s rank[i]-th slot (every rank below that expert's capacity)."""
        return self.slot_rows[self.slot_base[expert] + rank]


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
    row = torch.zeros_like(rank)
    row[fits] = layout.row(expert[fits], rank[fits])
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
