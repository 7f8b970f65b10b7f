"""OLMoE: qk-norm over the whole projected q and k (not per head), then optional clamping of
q, k and v; softmax top-k routing, optionally renormalised; every layer is MoE."""

from __future__ import annotations

from npumoe.core.ir.spec import LayerSpec, MLPSpec, ModelSpec, MoESpec, RouterSpec
from npumoe.models.base import Adapter, activation, gqa_attention, model_spec, require, rms_norm

# transformers' OlmoeConfig defaults, for keys a config.json may leave out
DEFAULTS = {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096}


class OlmoeAdapter(Adapter):
    model_types = ("olmoe",)

    def spec(self, cfg: dict) -> ModelSpec:
        cfg = {**DEFAULTS, **cfg}
        norm = rms_norm(cfg)
        attention = gqa_attention(cfg, qk_norm="full", qk_norm_eps=norm.eps, clip_qkv=cfg.get("clip_qkv"))
        moe = MoESpec(
            num_experts=require(cfg, "num_experts", "num_local_experts"),
            router=RouterSpec(top_k=require(cfg, "num_experts_per_tok"), normalize=bool(cfg.get("norm_topk_prob"))),
            expert=MLPSpec(require(cfg, "intermediate_size"), activation(cfg)),
        )
        layers = [LayerSpec(attention, moe, norm)] * require(cfg, "num_hidden_layers")
        return model_spec(cfg, "olmoe", layers, norm)
