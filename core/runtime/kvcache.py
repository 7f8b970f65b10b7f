"""The KV cache lives on the host; graphs see it as fixed-length inputs plus an additive mask. A device step
(:mod:`npumoe.core.runtime.device_step`) may hold newer slots on its device; ``on_host`` brings them back."""

from __future__ import annotations

import numpy as np
import torch

from npumoe.core.compiler.program import Program
from npumoe.core.ir.spec import AttentionSpec

MASKED = float("-inf")


class KVCache:
    """Per layer K [heads, L, Dk] and V [heads, L, Dv], slot j holding absolute position j."""

    def __init__(self, program: Program):
        self.capacity = program.max_context
        self.k, self.v = [], []
        for i in range(program.spec.num_layers):
            g = program.graphs[program.layers[i].attention[1]]
            self.k.append(torch.zeros(g.inputs["k_cache"].shape))
            self.v.append(torch.zeros(g.inputs["v_cache"].shape))
        self.length = 0
        self.held_by = None  # a device step whose slots are newer than these tensors'

    def on_host(self) -> None:
        """Make these tensors the cache again, before the host reads or writes them."""
        if self.held_by is not None:
            self.held_by.write_back(self.k, self.v, self.length)
            self.held_by = None

    def reset(self) -> None:
        self.length, self.held_by = 0, None
        for t in (*self.k, *self.v):
            t.zero_()

    def write(self, i: int, k_new: torch.Tensor, v_new: torch.Tensor, start: int, valid: int) -> None:
        """Write layer ``i``'s first ``valid`` new positions at slots start.. (the engine advances ``length``
        once every layer has them)."""
        self.k[i][:, start:start + valid] = k_new[:, :valid]
        self.v[i][:, start:start + valid] = v_new[:, :valid]


def attention_mask(att: AttentionSpec, start: int, seq: int, valid: int, capacity: int) -> torch.Tensor:
    """Additive mask [seq, capacity + seq] for queries at positions start..start+seq-1.

    Columns [0, capacity) are cache slots (valid below ``start``), the rest this chunk's
    own keys (causal, valid below ``valid``). Padding rows see only themselves, so no row
    is empty and no NaN can appear.
    """
    q_pos = start + np.arange(seq)[:, None]
    cache_pos = np.arange(capacity)[None, :]
    new_pos = start + np.arange(seq)[None, :]
    visible_cache = np.broadcast_to(cache_pos < start, (seq, capacity)).copy()
    visible_new = (new_pos <= q_pos) & (new_pos < start + valid)
    if att.sliding_window is not None:
        visible_cache &= cache_pos > q_pos - att.sliding_window
        visible_new &= new_pos > q_pos - att.sliding_window
    visible = np.concatenate([visible_cache, visible_new], axis=1)
    pad_rows = np.arange(seq) >= valid
    visible[pad_rows] = False
    visible[pad_rows, capacity + np.arange(seq)[pad_rows]] = True
    return torch.from_numpy(np.where(visible, 0.0, MASKED).astype(np.float32))


class DecodeMasks:
    """Decode's one-row masks, one per (window, cache slots), moved along a column a step instead of rebuilt:
    the next position sees the slot just written and, under a sliding window, loses the oldest one."""

    def __init__(self):
        self._held: dict[tuple, tuple[int, torch.Tensor]] = {}

    def get(self, att: AttentionSpec, start: int, slots: int) -> torch.Tensor:
        """``attention_mask(att, start, 1, 1, slots)``, the tensor it returned for start - 1 updated in place."""
        key = (att.sliding_window, slots)
        held_start, mask = self._held.get(key, (None, None))
        if held_start == start:
            return mask
        if held_start == start - 1:
            mask[0, start - 1] = 0.0
            if att.sliding_window is not None and start - att.sliding_window >= 0:
                mask[0, start - att.sliding_window] = MASKED
        else:
            mask = attention_mask(att, start, 1, 1, slots)
        self._held[key] = start, mask
        return mask
