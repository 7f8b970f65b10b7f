"""Qwen3-MoE: GQA with per-head qk-norm, softmax top-k routing, optional dense layers."""

from __future__ import annotations

from npumoe.core.ir.spec import LayerSpec, MLPSpec, ModelSpec, MoESpec, RouterSpec
from npumoe.models.base import Adapter, activation, gqa_attention, is_sparse, model_spec, require, rms_norm


class Qwen3MoeAdapter(Adapter):
    model_types = ("qwen3_moe",)

    def spec(self, cfg: dict) -> ModelSpec:
        norm = rms_norm(cfg)
        attention = gqa_attention(
            cfg,
            qk_norm="head",
            qk_norm_eps=norm.eps,  # the model's own eps (null: not set, the default)
            sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window") else None,
        )
        act = activation(cfg)
        num_experts = require(cfg, "num_experts", "num_local_experts")
        moe = MoESpec(
            num_experts=num_experts,
            router=RouterSpec(top_k=require(cfg, "num_experts_per_tok"), normalize=bool(cfg.get("norm_topk_prob"))),
            expert=MLPSpec(require(cfg, "moe_intermediate_size"), act),
        )
        dense = MLPSpec(require(cfg, "intermediate_size"), act)
        layers = tuple(
            LayerSpec(attention, moe if is_sparse(cfg, i, num_experts) else dense, norm)
            for i in range(require(cfg, "num_hidden_layers"))
        )
        return model_spec(cfg, "qwen3_moe", layers, norm)
