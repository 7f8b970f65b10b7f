"""Mixtral: GQA, softmax top-k routing renormalised over the k picked, every layer MoE, and an
optional sliding window on every layer.

Checkpoints name experts ``block_sparse_moe.experts.N.w1/w3/w2`` (gate/up/down) or, as
transformers 5 holds them, stacked ``mlp.experts.gate_up_proj``; the common table reads both.
"""

from __future__ import annotations

from npumoe.core.ir.spec import LayerSpec, MLPSpec, ModelSpec, MoESpec, RouterSpec
from npumoe.models.base import Adapter, activation, gqa_attention, model_spec, require, rms_norm

# transformers' MixtralConfig defaults, for keys a config.json may leave out
DEFAULTS = {
    "rope_theta": 1e6, "rms_norm_eps": 1e-5, "num_key_value_heads": 8, "num_experts_per_tok": 2,
    "max_position_embeddings": 131072, "eos_token_id": 2,
}  # fmt: skip


class MixtralAdapter(Adapter):
    model_types = ("mixtral",)

    def spec(self, cfg: dict) -> ModelSpec:
        cfg = {**DEFAULTS, **cfg}
        attention = gqa_attention(cfg, sliding_window=cfg.get("sliding_window"))
        moe = MoESpec(
            num_experts=require(cfg, "num_local_experts", "num_experts"),
            router=RouterSpec(top_k=require(cfg, "num_experts_per_tok"), normalize=True),
            expert=MLPSpec(require(cfg, "intermediate_size"), activation(cfg)),
        )
        norm = rms_norm(cfg)
        layers = [LayerSpec(attention, moe, norm)] * require(cfg, "num_hidden_layers")
        return model_spec(cfg, "mixtral", layers, norm)
