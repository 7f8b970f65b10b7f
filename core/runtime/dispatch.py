"""Dispatch routed tokens into static, zero-padded group buffers, and combine the results.

All index arithmetic is vectorised: a stable sort by expert gives every (token, expert)
pair its rank within the expert; rank < capacity lands at a fixed row of one preallocated
buffer that concatenates every group's [G·C, H] slice; the rest overflow.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from npumoe.core.program import ExpertGroup


@dataclass
class Layout:
    """Where each expert's slots live in the concatenated buffer of a layer's groups."""

    groups: list[ExpertGroup]
    row_base: torch.Tensor  # [E] first row of expert e's slice (-1: not in any group)
    capacity: torch.Tensor  # [E] slots of expert e (0: not in any group)
    group_offsets: list[int]
    rows: int

    @classmethod
    def of(cls, groups: list[ExpertGroup], num_experts: int) -> Layout:
        row_base = torch.full((num_experts,), -1, dtype=torch.long)
        capacity = torch.zeros(num_experts, dtype=torch.long)
        offsets, rows = [], 0
        for grp in groups:
            offsets.append(rows)
            for g, e in enumerate(grp.experts):
                row_base[e] = rows + grp.slot_base(g)
                capacity[e] = grp.capacity
            rows += len(grp.experts) * grp.capacity
        return cls(groups, row_base, capacity, offsets, rows)


@dataclass
class Dispatch:
    """One chunk's routed pairs: which fit the static buffers and which overflow."""

    token: torch.Tensor  # [P] token row of each routed pair
    expert: torch.Tensor  # [P]
    weight: torch.Tensor  # [P]
    row: torch.Tensor  # [P] buffer row, valid where fits
    fits: torch.Tensor  # [P] bool

    @property
    def overflow(self) -> torch.Tensor:
        return ~self.fits


def assign(experts: torch.Tensor, weights: torch.Tensor, layout: Layout, order_key: torch.Tensor | None = None) -> Dispatch:
    """Give each (token, expert) pair its rank within the expert, and a row if rank < capacity.

    ``order_key`` [S] decides who gets an expert's slots first (higher first); by default
    tokens in sequence order.
    """
    tokens, k = experts.shape
    token = torch.arange(tokens).repeat_interleave(k)
    expert, weight = experts.reshape(-1), weights.reshape(-1)
    priority = torch.arange(tokens) if order_key is None else torch.argsort(
        torch.argsort(order_key, descending=True, stable=True), stable=True
    )
    key = expert * tokens + priority[token]
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(expert, minlength=layout.capacity.numel())
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(expert)
    rank[order] = torch.arange(expert.numel()) - starts[expert[order]]
    fits = rank < layout.capacity[expert]
    row = torch.where(fits, layout.row_base[expert] + rank, torch.zeros_like(rank))
    return Dispatch(token, expert, weight, row, fits)


def gather(z: torch.Tensor, d: Dispatch, layout: Layout, out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy routed tokens into the zero-padded buffer [rows, H] (reused when given)."""
    buf = out if out is not None else z.new_zeros(layout.rows, z.shape[1])
    if out is not None:
        buf.zero_()
    buf[d.row[d.fits]] = z[d.token[d.fits]]
    return buf


def combine(y: torch.Tensor, d: Dispatch, tokens: int) -> torch.Tensor:
    """Weighted scatter-add of expert outputs back to token rows."""
    out = y.new_zeros(tokens, y.shape[1])
    rows, toks = d.row[d.fits], d.token[d.fits]
    out.index_add_(0, toks, y[rows] * d.weight[d.fits, None].to(y.dtype))
    return out
