"""The routing profile: how a model's experts are really used, as the planner reads it.

Per MoE layer, the token count of every expert in every full prefill chunk of calibration text
(:mod:`npumoe.core.runtime.calibrate` measures it). Everything the planner needs (imbalance
r_l = max/mean, popularity, load quantiles) derives from those counts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from npumoe.core.base.errors import ArtifactError
from npumoe.core.base.io import read_json_artifact, write_output
from npumoe.core.base.outputs import OutputKind, json_kind
from npumoe.core.ir.identity import check_weights
from npumoe.core.ir.spec import ModelSpec

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
    weights: str | None = None  # weights fingerprint (npumoe.core.ir.identity); None in profiles made before it

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
        return write_output(path, PROFILE, json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> RoutingProfile:
        return cls.from_json(read_json_artifact(path, KIND, "a routing profile (npumoe calibrate --out)"), str(path))

    @classmethod
    def from_json(cls, data: dict, where: str = "the profile") -> RoutingProfile:
        """A profile from its JSON, every field checked first: a profile is a file a user may edit, and counts
        no calibration gives (NaN, negative, more than a chunk holds) would plan from nonsense: negative ones
        planned graphs "reading −1509.9 MB"."""
        def bad(what: str) -> ArtifactError:
            return ArtifactError(f"{where} is damaged: {what}; make a new one with npumoe calibrate.")

        chunk, layers, sources = data.get("chunk"), data.get("layers"), data.get("sources", [])
        if not isinstance(data.get("model"), str) or not isinstance(data.get("model_name", ""), str):
            raise bad("its 'model' and 'model_name' must be strings")
        if not isinstance(data.get("weights"), (str, type(None))):
            raise bad(f"its 'weights' is {data['weights']!r:.40}, not a fingerprint string")
        if not isinstance(sources, list) or not all(isinstance(source, str) for source in sources):
            raise bad("its 'sources' must be a list of strings")
        if not _whole(chunk, 1):
            raise bad(f"its 'chunk' is {chunk!r:.40}, not a whole number ≥ 1")
        if not isinstance(layers, dict) or not layers or not all(i.isdigit() and isinstance(v, dict)
                                                                 for i, v in layers.items()):
            raise bad("its 'layers' must map layer numbers to their counts")
        for i, layer in layers.items():
            _check_layer(i, layer.get("top_k"), layer.get("loads"), chunk, bad)
        return cls(
            model=data["model"],
            model_name=data.get("model_name", ""),
            chunk=chunk,
            top_k={int(i): v["top_k"] for i, v in layers.items()},
            loads={int(i): np.asarray(v["loads"], dtype=np.int64) for i, v in layers.items()},
            sources=sources,
            weights=data.get("weights"),
        )


def _whole(value, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _check_layer(i: str, top_k, loads, chunk: int, bad) -> None:
    """One layer's counts as calibration records them: per full chunk, each expert's tokens (0 to the chunk's
    length: a token picks an expert at most once), summing to chunk × top-k."""
    if not _whole(top_k, 1):
        raise bad(f"layer {i}'s top_k is {top_k!r:.40}, not a whole number ≥ 1")
    if not (isinstance(loads, list) and loads and all(isinstance(row, list) and len(row) == len(loads[0]) >= top_k
                                                      for row in loads)):
        raise bad(f"layer {i}'s loads must be a list of chunks, each counting the tokens of every expert")
    wrong = [n for row in loads for n in row if not (_whole(n, 0) and n <= chunk)]
    if wrong:
        raise bad(f"layer {i}'s loads hold the count {wrong[0]!r:.40}, where 0 to the chunk's {chunk} tokens belong")
    if any(sum(row) != chunk * top_k for row in loads):
        raise bad(f"layer {i}'s loads do not count chunk {chunk} × top-k {top_k} = {chunk * top_k} routed tokens in "
                  "every chunk")


def overlap_at_k(a: RoutingProfile, b: RoutingProfile, k: int) -> dict[int, float]:
    """Per layer, |top-k experts of a ∩ top-k of b| / k: do two datasets favour the same experts?"""
    return {i: len(set(a.popularity(i)[:k]) & set(b.popularity(i)[:k])) / k for i in a.layers if i in b.loads}
