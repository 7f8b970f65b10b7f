"""Rotary-embedding tables, computed on the host and fed to graphs as inputs.

Graphs take ``cos``/``sin`` of shape [S, R] (R = rotary dims, laid out as two repeated
halves) so the NPU never sees positions, only static-shaped tensors.
"""

from __future__ import annotations

import math

import numpy as np

from npumoe.core.base.errors import UnsupportedModelError
from npumoe.core.ir.spec import RopeSpec


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: RopeSpec, dim: int, base_inv: np.ndarray) -> tuple[np.ndarray, float]:
    p = rope.p
    factor = p.get("factor") or rope.max_position / p["original_max_position_embeddings"]
    orig = p["original_max_position_embeddings"]
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = yarn_mscale(factor, p["mscale"]) / yarn_mscale(factor, p["mscale_all_dim"])
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv = (base_inv / factor) * (1 - extrapolation) + base_inv * extrapolation
    return inv.astype(np.float32), float(attention_factor)


def _llama3(rope: RopeSpec, base_inv: np.ndarray) -> np.ndarray:
    p = rope.p
    factor, low_f, high_f = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    orig = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = orig / low_f, orig / high_f
    wavelen = 2 * math.pi / base_inv
    inv = np.where(wavelen > low_wavelen, base_inv / factor, base_inv)
    smooth = (orig / wavelen - low_f) / (high_f - low_f)
    smoothed = (1 - smooth) * inv / factor + smooth * inv
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, inv).astype(np.float32)


def short_context(rope: RopeSpec) -> int | None:
    """The longest sequence whose rope tables do not depend on its length (None: any length).

    longrope swaps its short factors for long ones once a sequence passes
    ``original_max_position_embeddings``, which changes the rotation of every key already
    cached; a static KV cache cannot follow, so the engine stops sequences at this length.
    """
    return rope.p["original_max_position_embeddings"] if rope.kind == "longrope" else None


def inverse_frequencies(rope: RopeSpec, head_dim: int) -> tuple[np.ndarray, float]:
    """(inv_freq [R/2], cos/sin scaling) for this rope (longrope: within its short context)."""
    dim = rope.rotary_dim or head_dim
    exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim
    base_inv = (1.0 / (rope.theta ** exponent)).astype(np.float32)
    p = rope.p
    if rope.kind == "default":
        return base_inv, 1.0
    if rope.kind == "linear":
        return (base_inv / p["factor"]).astype(np.float32), 1.0
    if rope.kind == "yarn":
        return _yarn(rope, dim, base_inv)
    if rope.kind == "llama3":
        return _llama3(rope, base_inv), 1.0
    if rope.kind == "longrope":
        orig = p["original_max_position_embeddings"]
        factor = p.get("factor") or rope.max_position / orig
        scaling = p.get("attention_factor")
        if scaling is None:
            scaling = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig))
        ext = np.asarray(p["short_factor"], dtype=np.float32)
        return (1.0 / (ext * rope.theta ** exponent)).astype(np.float32), float(scaling)
    raise UnsupportedModelError(
        f"rope type {rope.kind!r} is not supported; supported: default, linear, yarn, llama3, longrope."
    )


def cos_sin(rope: RopeSpec, head_dim: int, positions: np.ndarray):
    """cos, sin tables [len(positions), R] in fp32 (halves repeated, scaling applied)."""
    inv, scaling = inverse_frequencies(rope, head_dim)
    freqs = np.outer(positions.astype(np.float32), inv).astype(np.float32)
    emb = np.concatenate([freqs, freqs], axis=-1)
    return (np.cos(emb) * scaling).astype(np.float32), (np.sin(emb) * scaling).astype(np.float32)
