"""Shared checks for backend tests: byte prompts, per-position logit agreement, texts for build --targets."""

import numpy as np


def ids(prompt: bytes) -> np.ndarray:
    return np.frombuffer(prompt, dtype=np.uint8).astype(np.int64)


def row_cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine similarity of each position's logits (rows of [T, vocab])."""
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def write_texts(folder, heldout_chars: int):
    """(calibration, held-out) text files from the demo corpus, small enough for a quick build --targets."""
    from npumoe.models.demo import corpus

    calibration, heldout = folder / "calibration.txt", folder / "heldout.txt"
    calibration.write_text("\n".join(t[:1500] for t in corpus.calibration_texts(4)))
    heldout.write_text(corpus.heldout_texts(1)[0][:heldout_chars])
    return calibration, heldout
