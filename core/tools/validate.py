"""How close a target's run comes to the fp32 reference, on text the calibration did not see.

One record per target, the same fields for every target, so a cross-vendor table compares devices:
logit cosine, top-1 agreement, how many greedy tokens match, perplexity beside the reference's, and
what the static shapes cost on that text (padding, spill, drops, NPU launches per prefill chunk).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from npumoe.core.base.errors import InputError
from npumoe.core.base.progress import task
from npumoe.core.runtime.engine import Engine

GREEDY_TOKENS = 16
MIN_TOKENS = 8


@dataclass(frozen=True)
class Validation:
    tokens: int  # held-out positions compared
    cosine: float  # mean over positions of the cosine between the target's and the reference's logits
    top1_agreement: float  # share of positions whose most likely next token is the reference's
    greedy_match: int  # leading greedy tokens equal to the reference's, of ``greedy_tokens``
    greedy_tokens: int
    perplexity: float  # the target's, on the held-out tokens
    reference_perplexity: float
    padded_pct: float  # of NPU expert slots, padding
    spilled_pct: float  # of routed token-slots, run on the CPU past a group's capacity
    dropped_pct: float
    npu_launches_per_chunk: float

    def to_json(self) -> dict:
        return asdict(self)


def validate(model, target: str, artifacts, ids, greedy_tokens: int = GREEDY_TOKENS,
             progress: bool | None = None) -> Validation:
    """``target``'s built ``artifacts`` against the fp32 reference on held-out token ``ids`` (``progress``: see
    :mod:`npumoe.core.base.progress`)."""
    ids = np.asarray(ids)
    if ids.size < MIN_TOKENS:
        raise InputError(f"the held-out text has {ids.size} tokens; validation needs at least {MIN_TOKENS}.")
    with task(f"validating {target}", 3, "steps", progress) as step:
        step.describe(f"validating {target}: loading its graphs")
        run = Engine(model, backend=target, artifacts=artifacts)
        ids = ids[: run.cache.capacity - greedy_tokens]  # room for the greedy continuation
        reference = Engine(model, chunk=run.program.chunk, max_context=run.cache.capacity)
        step.advance()
        step.describe(f"validating {target}: {len(ids)} held-out tokens against the reference")
        want, got = reference.forward(ids), run.forward(ids)
        step.advance()
        step.describe(f"validating {target}: {greedy_tokens} greedy tokens against the reference")
        prompt = ids[: max(1, len(ids) // 2)]
        greedy = _leading_matches(reference.generate(prompt, greedy_tokens), run.generate(prompt, greedy_tokens))
        step.advance()
    m = run.metrics
    routed, npu_slots = max(m["routed"], 1), m["routed"] - m["spilled"] - m["dropped"] + m["padded"]
    chunks = -(-len(ids) // run.program.chunk)
    return Validation(
        tokens=int(len(ids)),
        cosine=float(np.mean(_cosine(got, want))),
        top1_agreement=float(np.mean(got.argmax(-1) == want.argmax(-1))),
        greedy_match=greedy,
        greedy_tokens=greedy_tokens,
        perplexity=_perplexity(got, ids),
        reference_perplexity=_perplexity(want, ids),
        padded_pct=100 * m["padded"] / max(npu_slots, 1),
        spilled_pct=100 * m["spilled"] / routed,
        dropped_pct=100 * m["dropped"] / routed,
        npu_launches_per_chunk=m["npu_launches"] / chunks,
    )


def perplexity(model, ids, window: int | None = None, chunk: int = 64) -> float:
    """``model``'s perplexity on token ``ids``, run by the unplanned CPU engine in consecutive windows of
    ``window`` tokens (default: all of them), each from an empty cache, as llama.cpp's perplexity tool does.

    Windows keep every position inside the context a model was trained at: scored far beyond it, a small
    model's perplexity swings with any perturbation and no longer measures what a format costs. A last window
    shorter than ``MIN_TOKENS`` is left out."""
    ids = np.asarray(ids)
    window = window or len(ids)
    pieces = [ids[i:i + window] for i in range(0, len(ids), window)]
    pieces = [p for p in pieces if len(p) >= MIN_TOKENS] or pieces[:1]
    engine = Engine(model, chunk=chunk, max_context=max(len(p) for p in pieces))
    nll = [np.log(_perplexity(engine.forward(p), p)) * (len(p) - 1) for p in pieces]
    return float(np.exp(sum(nll) / sum(len(p) - 1 for p in pieces)))


def _leading_matches(a: np.ndarray, b: np.ndarray) -> int:
    """Tokens equal from the start (generation may stop early at an end-of-sequence token)."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1) + 1e-30)


def _perplexity(logits: np.ndarray, ids: np.ndarray) -> float:
    """exp of the mean cross-entropy of each next token (float64 log-softmax)."""
    z = logits[:-1].astype(np.float64)
    z -= z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return float(np.exp(-logp[np.arange(len(ids) - 1), ids[1:]].mean()))
