"""Qwen2-MoE (Qwen1.5-MoE): GQA with q/k/v bias, softmax top-k routing, and a shared expert
that every token also runs, scaled by sigmoid(shared_expert_gate · x); optional dense layers
and sliding window."""

from __future__ import annotations

from dataclasses import replace

from npumoe.core.base.errors import UnsupportedModelError
from npumoe.core.ir.spec import AttentionSpec, LayerSpec, MLPSpec, ModelSpec, MoESpec, RouterSpec
from npumoe.models.base import (
    Adapter,
    activation,
    gqa_attention,
    is_sparse,
    layer_windows,
    model_spec,
    require,
    rms_norm,
)

# transformers' Qwen2MoeConfig defaults, for keys a config.json may leave out
DEFAULTS = {
    "qkv_bias": True, "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28,
    "max_position_embeddings": 32768,
}  # fmt: skip


def windows(cfg: dict) -> list[int | None]:
    """Each layer's window as transformers derives it: from ``layer_types``, else (only with
    ``use_sliding_window``) even layers below ``max_window_layers`` slide."""
    sliding = bool(cfg["use_sliding_window"])
    if not sliding and "sliding_attention" in (cfg.get("layer_types") or ()):
        raise UnsupportedModelError(
            "layer_types has sliding_attention layers but use_sliding_window is false, which gives them a window "
            "of 0; set use_sliding_window to true or make those layers full_attention."
        )

    def default_kinds(n: int) -> list[str]:
        slides = [sliding and i % 2 == 0 and i < cfg["max_window_layers"] for i in range(n)]
        return ["sliding_attention" if s else "full_attention" for s in slides]

    return layer_windows(cfg, default_kinds)


def attention(cfg: dict, window: int | None) -> AttentionSpec:
    """``qkv_bias`` biases q, k and v; the output projection never has one."""
    return replace(gqa_attention(cfg, sliding_window=window), qkv_bias=bool(cfg["qkv_bias"]), o_bias=False)


def experts(cfg: dict) -> MoESpec:
    act = activation(cfg)
    return MoESpec(
        num_experts=require(cfg, "num_experts"),
        router=RouterSpec(top_k=require(cfg, "num_experts_per_tok"), normalize=bool(cfg.get("norm_topk_prob"))),
        expert=MLPSpec(require(cfg, "moe_intermediate_size"), act),
        shared=MLPSpec(require(cfg, "shared_expert_intermediate_size"), act),
        shared_gate=True,
    )


class Qwen2MoeAdapter(Adapter):
    model_types = ("qwen2_moe",)

    def spec(self, cfg: dict) -> ModelSpec:
        cfg = {**DEFAULTS, **cfg}
        moe, norm = experts(cfg), rms_norm(cfg)
        dense = MLPSpec(require(cfg, "intermediate_size"), activation(cfg))
        layers = tuple(
            LayerSpec(attention(cfg, window), moe if is_sparse(cfg, i, moe.num_experts) else dense, norm)
            for i, window in enumerate(windows(cfg))
        )
        return model_spec(cfg, "qwen2_moe", layers, norm)
