"""A prompt's KV cache on its way from the engine that prefilled it to the engine that decodes it.

Disaggregated generation (ANE prefill, GPU decode: :mod:`npumoe.core.runtime.disaggregated`) hands the cache over
once, between the prompt and the first decode step: read from where the prefill device keeps it (an ANE package's
fp16 states, padded to powers of two; the host cache of every other target), converted to fp32 in the engine's
per-layer [heads, length, dim] layout, written into the decode engine's cache. Nothing is converted per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVHandoff:
    model: str  # the spec fingerprint of the model that filled it: decoding another model's cache is refused
    model_name: str
    length: int  # positions 0..length-1 are filled
    k: list[torch.Tensor]  # per layer [heads, length, Dk], fp32
    v: list[torch.Tensor]  # per layer [heads, length, Dv], fp32
    source: str  # where it was read: "host cache", or which executors' device state

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))
