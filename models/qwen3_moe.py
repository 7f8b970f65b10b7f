"""Qwen3-MoE: GQA with per-head qk-norm, softmax top-k routing, optional dense layers."""

from __future__ import annotations

from npumoe.core.spec import AttentionSpec, LayerSpec, MLPSpec, ModelSpec, MoESpec, RouterSpec
from npumoe.models.base import Adapter, eos_ids, first, require, rms_norm, rope_spec


def is_sparse(cfg: dict, i: int, num_experts: int) -> bool:
    """Qwen's rule: MoE unless listed in ``mlp_only_layers`` or off the ``decoder_sparse_step`` beat."""
    step = cfg.get("decoder_sparse_step") or 1
    return i not in (cfg.get("mlp_only_layers") or []) and num_experts > 0 and (i + 1) % step == 0


class Qwen3MoeAdapter(Adapter):
    model_types = ("qwen3_moe",)

    def spec(self, cfg: dict) -> ModelSpec:
        hidden, heads = require(cfg, "hidden_size"), require(cfg, "num_attention_heads")
        head_dim = first(cfg, "head_dim", default=hidden // heads)
        bias = bool(cfg.get("attention_bias", False))
        attention = AttentionSpec(
            kind="gqa",
            num_heads=heads,
            num_kv_heads=first(cfg, "num_key_value_heads", default=heads),
            head_dim=head_dim,
            v_head_dim=head_dim,
            scale=head_dim**-0.5,
            rope=rope_spec(cfg, head_dim),
            qkv_bias=bias,
            o_bias=bias,
            qk_norm="head",
            qk_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window") else None,
        )
        act = cfg.get("hidden_act", "silu")
        num_experts = require(cfg, "num_experts", "num_local_experts")
        moe = MoESpec(
            num_experts=num_experts,
            router=RouterSpec(top_k=require(cfg, "num_experts_per_tok"), normalize=bool(cfg.get("norm_topk_prob"))),
            expert=MLPSpec(require(cfg, "moe_intermediate_size"), act),
        )
        dense = MLPSpec(require(cfg, "intermediate_size"), act)
        norm = rms_norm(cfg)
        layers = tuple(
            LayerSpec(attention, moe if is_sparse(cfg, i, num_experts) else dense, norm)
            for i in range(require(cfg, "num_hidden_layers"))
        )
        return ModelSpec(
            family="qwen3_moe",
            vocab_size=require(cfg, "vocab_size"),
            hidden_size=hidden,
            layers=layers,
            norm=norm,
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids(cfg),
            max_position=int(cfg.get("max_position_embeddings", 2048)),
        )
