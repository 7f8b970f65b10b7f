"""Calibration: run the reference engine over text and record how its experts are really used.

The engine prefills calibration text in chunks of B tokens exactly as at run time; a
:class:`~npumoe.core.planning.profile.LoadRecorder` keeps, per MoE layer, the token count of every
expert in every full chunk: a :class:`~npumoe.core.planning.profile.RoutingProfile`.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from npumoe.core.base.errors import InputError, whole_number
from npumoe.core.base.progress import track
from npumoe.core.planning.profile import LoadRecorder, RoutingProfile
from npumoe.core.runtime.engine import Engine


def calibrate(model, texts, chunk: int = 256, window: int = 2048, progress: bool | None = None,
              sources: list[str] | None = None) -> RoutingProfile:
    """Prefill calibration text with the reference engine; record per-chunk expert loads.

    Texts are cut into windows of up to ``window`` tokens (a multiple of the chunk), each
    prefilled from an empty cache in chunks exactly as at run time, so routing sees the same
    context it will see in deployment. Only full chunks count: a partial chunk has fewer
    tokens and would bias capacities low. ``progress``: see :mod:`npumoe.core.base.progress`.
    """
    spec = model.spec
    chunk, window = whole_number(chunk, "chunk", 1), whole_number(window, "window", 1)
    if not spec.moe_layers:
        raise InputError(f"{model.name} has no MoE layers; there is nothing to calibrate.")
    if isinstance(texts, str) or not isinstance(texts, Iterable):
        raise InputError(f"calibrate takes a list of texts (or of token id lists), got {texts!r:.40}.")
    token_lists = [model.tokenizer.encode(t) if isinstance(t, str) else list(t) for t in texts]
    if not token_lists:
        raise InputError("no calibration text was given; pass at least one text (or list of token ids).")
    if not any(len(t) >= chunk for t in token_lists):
        longest = max((len(t) for t in token_lists), default=0)
        raise InputError(
            f"calibration text is too short: the longest text has {longest} tokens, but at least one full "
            f"chunk of {chunk} tokens is needed; give more text or a smaller --chunk."
        )
    window = max(chunk, min(window, spec.max_position) // chunk * chunk)
    windows = [t[s:s + window] for t in token_lists for s in range(0, len(t), window) if len(t) - s >= chunk]
    recorder = LoadRecorder(spec)
    engine = Engine(model, chunk=chunk, max_context=window, on_route=recorder)
    for piece in track(windows, f"calibrating (chunk {chunk})", "windows", progress):
        engine.route(np.asarray(piece[: len(piece) // chunk * chunk]))
    return RoutingProfile(
        model=spec.fingerprint(),
        model_name=model.name,
        chunk=chunk,
        top_k={i: spec.layers[i].ffn.top_k for i in spec.moe_layers},
        loads={i: recorder.matrix(i, tokens=chunk) for i in spec.moe_layers},
        sources=list(sources or []),
        weights=model.weights_fingerprint(),
    )


def default_calibration_texts() -> dict[str, str]:
    """Python's own documentation topics: always on disk, so calibration needs no download."""
    import pydoc_data.topics

    return {f"pydoc_data.topics:{k}": v for k, v in sorted(pydoc_data.topics.topics.items())}
