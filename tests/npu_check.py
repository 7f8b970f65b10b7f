"""Shared checks for backend tests: byte prompts and per-position logit agreement."""

import numpy as np


def ids(prompt: bytes) -> np.ndarray:
    return np.frombuffer(prompt, dtype=np.uint8).astype(np.int64)


def row_cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine similarity of each position's logits (rows of [T, vocab])."""
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)
