"""Calibration: how a model's experts are really used, measured by running it.

The reference engine prefills calibration text in chunks of B tokens; per MoE layer we
keep the token count of every expert in every full chunk. Everything the planner needs
(imbalance r_l = max/mean, popularity, load quantiles) derives from those counts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from npumoe.core.identity import check_weights
from npumoe.core.io import atomic_write_text, read_json_artifact
from npumoe.core.outputs import OutputKind, claim, json_kind
from npumoe.core.spec import ModelSpec
from npumoe.errors import ArtifactError, InputError

QUANTILES = (0.5, 0.9, 0.99, 1.0)
KIND = "npumoe.RoutingProfile"
PROFILE = OutputKind("a routing profile (npumoe calibrate)", directory=False, recognise=json_kind(KIND))


class LoadRecorder:
    """An ``Engine(on_route=...)`` observer: tokens per expert, per MoE layer, per routing call."""

    def __init__(self, spec: ModelSpec):
        self.num_experts = {i: spec.layers[i].ffn.num_experts for i in spec.moe_layers}
        self.loads: dict[int, list[np.ndarray]] = {i: [] for i in spec.moe_layers}
        self.tokens: dict[int, list[int]] = {i: [] for i in spec.moe_layers}

    def __call__(self, layer: int, experts: torch.Tensor, weights: torch.Tensor, attn_out: torch.Tensor) -> None:
        counts = torch.bincount(experts.reshape(-1), minlength=self.num_experts[layer])
        self.loads[layer].append(counts.numpy())
        self.tokens[layer].append(int(experts.shape[0]))

    def matrix(self, layer: int, tokens: int | None = None) -> np.ndarray:
        """[calls, experts] token counts; only calls of exactly ``tokens`` tokens if given."""
        rows = [c for c, t in zip(self.loads[layer], self.tokens[layer]) if tokens is None or t == tokens]
        return np.stack(rows) if rows else np.zeros((0, self.num_experts[layer]), dtype=np.int64)


def imbalance(loads: np.ndarray) -> float:
    """Mean over chunks of max/mean expert load (NPUMoE's r_l); 1.0 is perfectly balanced."""
    busy = loads[loads.sum(axis=1) > 0]
    if busy.size == 0:
        return float("nan")
    return float(np.mean(busy.max(axis=1) / busy.mean(axis=1)))


@dataclass
class RoutingProfile:
    """Per MoE layer, a [chunks, experts] matrix of routed-token counts at chunk size ``chunk``."""

    model: str  # the spec fingerprint: a profile only fits the architecture it was measured on
    model_name: str
    chunk: int
    top_k: dict[int, int]
    loads: dict[int, np.ndarray]
    sources: list[str] = field(default_factory=list)
    weights: str | None = None  # weights fingerprint (npumoe.core.identity); None in profiles made before it

    @property
    def layers(self) -> list[int]:
        return sorted(self.loads)

    def num_experts(self, layer: int) -> int:
        return self.loads[layer].shape[1]

    def imbalance(self, layer: int) -> float:
        return imbalance(self.loads[layer])

    def popularity(self, layer: int) -> np.ndarray:
        """Experts from most to least routed-to."""
        return np.argsort(-self.loads[layer].sum(axis=0), kind="stable")

    def quantiles(self, layer: int) -> dict[float, np.ndarray]:
        return {q: np.quantile(self.loads[layer], q, axis=0) for q in QUANTILES}

    def summary(self, layer: int) -> dict:
        total = self.loads[layer].sum(axis=0)
        return {
            "chunks": int(self.loads[layer].shape[0]),
            "tokens_per_expert": total.tolist(),
            "imbalance": self.imbalance(layer),
            "popularity": self.popularity(layer).tolist(),
            "quantiles": {str(q): v.tolist() for q, v in self.quantiles(layer).items()},
        }

    def check_model(self, model, what: str = "profile") -> None:
        spec = model.spec
        expected = {i: spec.layers[i].ffn.num_experts for i in spec.moe_layers}
        got = {i: self.num_experts(i) for i in self.layers}
        if self.model != spec.fingerprint() or expected != got:
            raise ArtifactError(
                f"this {what} was measured on another model ({len(got)} MoE layers, "
                f"{sorted(set(got.values()))} experts; fingerprint {self.model}) but the model has "
                f"{len(expected)} MoE layers with {sorted(set(expected.values()))} experts (fingerprint "
                f"{spec.fingerprint()}); calibrate this model first."
            )
        check_weights(self.weights, model, f"this {what}", self.model_name, f"calibrate {model.name} first")

    # -- files --------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "kind": KIND,
            "model": self.model,
            "model_name": self.model_name,
            "chunk": self.chunk,
            "sources": self.sources,
            "weights": self.weights,
            "layers": {
                str(i): {"top_k": self.top_k[i], "loads": self.loads[i].tolist(), **self.summary(i)}
                for i in self.layers
            },
        }

    def save(self, path: str | Path) -> Path:
        return atomic_write_text(claim(path, PROFILE), json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> RoutingProfile:
        data = read_json_artifact(path, KIND, "a routing profile (npumoe calibrate --out)")
        layers = {int(i): v for i, v in data["layers"].items()}
        return cls(
            model=data["model"],
            model_name=data.get("model_name", ""),
            chunk=int(data["chunk"]),
            top_k={i: int(v["top_k"]) for i, v in layers.items()},
            loads={i: np.asarray(v["loads"], dtype=np.int64).reshape(-1, len(v["tokens_per_expert"]))
                   for i, v in layers.items()},
            sources=list(data.get("sources", [])),
            weights=data.get("weights"),
        )


def overlap_at_k(a: RoutingProfile, b: RoutingProfile, k: int) -> dict[int, float]:
    """Per layer, |top-k experts of a ∩ top-k of b| / k: do two datasets favour the same experts?"""
    return {i: len(set(a.popularity(i)[:k]) & set(b.popularity(i)[:k])) / k for i in a.layers if i in b.loads}


def calibrate(model, texts, chunk: int = 256, window: int = 2048, progress: bool = False,
              sources: list[str] | None = None) -> RoutingProfile:
    """Prefill calibration text with the reference engine; record per-chunk expert loads.

    Texts are cut into windows of up to ``window`` tokens (a multiple of the chunk), each
    prefilled from an empty cache in chunks exactly as at run time, so routing sees the same
    context it will see in deployment. Only full chunks count: a partial chunk has fewer
    tokens and would bias capacities low.
    """
    from npumoe.core.runtime.engine import Engine

    spec = model.spec
    if not spec.moe_layers:
        raise InputError(f"{model.name} has no MoE layers; there is nothing to calibrate.")
    token_lists = [model.tokenizer.encode(t) if isinstance(t, str) else list(t) for t in texts]
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
    iterator = windows
    if progress:
        from rich.progress import track

        iterator = track(windows, description=f"calibrating ({len(windows)} windows, chunk {chunk})")
    for piece in iterator:
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
