"""A decode routing predictor: a MoE layer's experts guessed from the hidden state entering the layer,
before its attention runs, so that their weights can be loaded while it does (the seed's "routing-pattern
predictor with incremental preloading").

The guess starts from the layer's own router applied one attention early (to ``ffn_norm(x)`` instead of
``ffn_norm(x + attn(x))``): the residual stream changes little across one attention block, so this alone
ranks the right experts high. A small linear map fitted on calibration traces then corrects it, also
reading which experts the previous MoE layer chose for the same token (routing is correlated across layers).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from npumoe.core.base.progress import track
from npumoe.core.compiler.interpreter import OP_IMPLS
from npumoe.core.ir.spec import ModelSpec, MoESpec


def early_logits(spec: ModelSpec, weights, layer: int, x: torch.Tensor) -> torch.Tensor:
    """[S, E] the router logits of ``layer`` on ``ffn_norm(x)``, x being the hidden state entering the layer."""
    ls, prefix = spec.layers[layer], f"layers.{layer}"
    if ls.norm.kind == "layer":
        bias = [weights[f"{prefix}.ffn_norm.bias"]] if ls.norm.bias else []
        z = OP_IMPLS["layernorm"](x.float(), weights[f"{prefix}.ffn_norm.weight"], *bias, eps=ls.norm.eps)
    else:
        z = OP_IMPLS["rmsnorm"](x.float(), weights[f"{prefix}.ffn_norm.weight"], eps=ls.norm.eps)
    router = f"{prefix}.moe.router"
    bias = weights[f"{router}.bias"].float() if ls.ffn.router.bias else None
    return torch.nn.functional.linear(z, weights[f"{router}.weight"].float(), bias)


class RoutingPredictor:
    """Scores every expert of a MoE layer for the tokens entering it. Without fitted maps the scores are the
    early router logits; :meth:`fit` learns, per layer, a ridge-regression map from [early logits, the previous
    MoE layer's k-hot choice, 1] to this layer's k-hot choice."""

    def __init__(self, model, maps: dict[int, np.ndarray] | None = None):
        self.spec, self.weights = model.spec, model.weights
        self.maps = maps or {}
        moe_layers = list(self.spec.moe_layers)
        self.previous = dict(zip(moe_layers[1:], moe_layers))  # MoE layer → the MoE layer before it

    def scores(self, layer: int, x: torch.Tensor, previous: torch.Tensor | None = None) -> torch.Tensor:
        """[S, E]; ``previous`` [S, k] is the experts the previous MoE layer chose for these tokens."""
        early = early_logits(self.spec, self.weights, layer, x)
        if layer not in self.maps:
            return early
        return torch.from_numpy(self._features(layer, early, previous) @ self.maps[layer])

    def top(self, layer: int, x: torch.Tensor, budget: int, previous: torch.Tensor | None = None) -> list[int]:
        """The ``budget`` experts most likely to be routed to by any of the tokens (by their summed rank-scores)."""
        s = self.scores(layer, x, previous)
        ranks = torch.argsort(torch.argsort(s, dim=-1), dim=-1).float()  # per token: higher = likelier
        return torch.topk(ranks.sum(0), min(budget, s.shape[-1])).indices.tolist()

    def _features(self, layer: int, early: torch.Tensor, previous: torch.Tensor | None) -> np.ndarray:
        parts = [early.numpy()]
        if layer in self.previous:
            before: MoESpec = self.spec.layers[self.previous[layer]].ffn
            hot = np.zeros((early.shape[0], before.num_experts), dtype=np.float32)
            if previous is not None:
                np.put_along_axis(hot, previous.numpy(), 1.0, axis=1)
            parts.append(hot)
        parts.append(np.ones((early.shape[0], 1), dtype=np.float32))
        return np.concatenate(parts, axis=1)

    def fit(self, traces: Iterable[tuple[int, torch.Tensor, torch.Tensor | None, torch.Tensor]],
            ridge: float = 1e-2) -> RoutingPredictor:
        """Fit each layer's map from calibration ``traces`` of (layer, x entering it, the previous MoE layer's
        experts or None, this layer's experts [S, k]); returns self."""
        rows: dict[int, tuple[list, list]] = {}
        for layer, x, previous, experts in traces:
            features = self._features(layer, early_logits(self.spec, self.weights, layer, x), previous)
            target = np.zeros((len(experts), self.spec.layers[layer].ffn.num_experts), dtype=np.float32)
            np.put_along_axis(target, experts.numpy(), 1.0, axis=1)
            rows.setdefault(layer, ([], []))[0].append(features)
            rows[layer][1].append(target)
        for layer, (features, targets) in rows.items():
            f, t = np.concatenate(features).astype(np.float64), np.concatenate(targets)
            gram = f.T @ f
            gram[np.diag_indices_from(gram)] += ridge * np.trace(gram) / len(gram)
            self.maps[layer] = np.linalg.solve(gram, f.T @ t).astype(np.float32)
        return self


def recall_at(predicted: list[int], experts: torch.Tensor) -> float:
    """Share of the routed experts (the unique ids in ``experts``) that the prediction holds."""
    routed = set(experts.reshape(-1).tolist())
    return len(routed & set(predicted)) / len(routed)


def routing_traces(model, windows: Iterable, chunk: int) -> list[tuple[int, torch.Tensor, torch.Tensor | None,
                                                                        torch.Tensor]]:
    """(layer, x entering it, the previous MoE layer's experts, this layer's experts) for every chunk of every
    token window, as the unplanned engine routes them: :meth:`RoutingPredictor.fit`'s traces."""
    from npumoe.core.runtime.engine import Engine

    traces, entering, chosen = [], {}, {}
    moe_layers = list(model.spec.moe_layers)
    before = dict(zip(moe_layers[1:], moe_layers))

    def on_route(layer, experts, weights, attn_out):
        traces.append((layer, entering.pop(layer)[:len(experts)], chosen.get(before.get(layer)), experts.clone()))
        chosen[layer] = experts.clone()

    class Recording:  # a layer's attention executor that keeps the hidden state entering the layer
        def __init__(self, layer, executor):
            self.layer, self.executor, self.keeps_state = layer, executor, executor.keeps_state

        def __call__(self, inputs):
            entering[self.layer] = inputs["x"].clone()
            return self.executor(inputs)

    # chunk by chunk (not layer-major buffering): each routing call follows its own chunk's attention
    engine = Engine(model, chunk=chunk, max_context=max(len(w) for w in windows), on_route=on_route, buffering=False)
    for i, step in enumerate(engine.program.layers):
        if step.moe is not None:
            for name in step.attention.values():
                engine.executors[name] = Recording(i, engine.executors[name])
    for ids in track(windows, "tracing routing", "windows"):
        engine.route(np.asarray(ids))
    return traces
